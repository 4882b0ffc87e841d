"""Handing memory back after a large request.

Parsing and tokenizing a long prompt leaves many small blocks in the allocator's free lists, which glibc
keeps (the process stays gigabytes larger). After a request whose body was large, once it is answered, a
collection and `malloc_trim(0)` return them to the system.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
from functools import cache

log = logging.getLogger("strata.server")

LARGE_BODY_BYTES = 1 << 20  # bodies from this size on are followed by a release
_RELEASE_KEY = "strata.release_memory"


def release_memory_soon(scope: dict) -> None:
    """Mark the request: `Guard` calls `release_memory` once its response has been sent."""
    scope[_RELEASE_KEY] = True


def wants_release(scope: dict) -> bool:
    """Whether the request was marked by `release_memory_soon`."""
    return bool(scope.get(_RELEASE_KEY))


def release_memory() -> bool:
    """Collect garbage and return free heap memory to the system (glibc's malloc_trim); False where the C
    library has no malloc_trim (musl, macOS), after the collection alone."""
    gc.collect()
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


async def release_memory_async() -> None:
    """`release_memory` on a worker thread (the event loop keeps serving while it runs)."""
    try:
        await asyncio.to_thread(release_memory)
    except Exception:  # never fails a request that was already answered
        log.exception("releasing memory failed")


@cache
def _malloc_trim():  # -> the C function, or None
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None
