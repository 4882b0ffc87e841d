"""The one generation loop: the scheduler and its step, sampling, pacing, requests, warm-up and text."""
