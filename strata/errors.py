"""strata's error types.

Every error a user can cause (a bad checkpoint, a wrong config, a bad request, missing hardware)
is a `StrataError` whose message is one line naming the problem and, where there is one, the fix.
The CLI prints that line and exits with status 2; the server turns it into an OpenAI-shaped error.
"""

from __future__ import annotations


class StrataError(Exception):
    """Base class: a user-facing problem with a one-line message."""


class CheckpointError(StrataError):
    """A checkpoint directory or file is missing, truncated, corrupt or inconsistent."""


class UnsupportedError(StrataError):
    """A valid input strata does not handle yet (an architecture, a dtype, a RoPE type)."""


class ConfigError(StrataError):
    """A configuration file, dict or argument is invalid."""


class RequestError(StrataError):
    """A generation request has invalid arguments (wrong type, out of range)."""
