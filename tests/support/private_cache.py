"""A private $STRATA_CACHE for a test run (tests/ and bench/tests/ conftests): stores built on first use go to a
temporary directory, not the user's ~/.cache/strata, while the compiled CPU kernels (`ext`, keyed by a hash of their
sources and flags) are the user's own, so a run compiles them only where no earlier run did."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def private_strata_cache(path: Path) -> Iterator[Path]:
    """$STRATA_CACHE = `path` while the context lasts, its `ext` a link to the default cache's."""
    old = os.environ.pop("STRATA_CACHE", None)
    from strata.tiers.store.files import cache_root

    shared = cache_root() / "ext"  # the default cache's, $STRATA_CACHE unset
    try:
        shared.mkdir(parents=True, exist_ok=True)
        (path / "ext").symlink_to(shared, target_is_directory=True)
    except OSError:  # a read-only home: the private cache compiles its own
        pass
    os.environ["STRATA_CACHE"] = str(path)
    try:
        yield path
    finally:
        if old is None:
            os.environ.pop("STRATA_CACHE", None)
        else:
            os.environ["STRATA_CACHE"] = old
