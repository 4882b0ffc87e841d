"""Tools for finding where time goes: profiles, timelines and traces of decode and prefill."""
