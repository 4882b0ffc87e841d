"""Advise an anonymous mapping for transparent huge pages (2 MiB), where the kernel offers them.

A CPU pass streams large weights (dense matrices, whole experts) from RAM once per token; in 4 KiB pages that is a
TLB miss every 4 KiB. Linux gives anonymous memory 2 MiB pages when THP is `always`, or in the common `madvise`
mode when the mapping asks before its pages are touched. Where THP is off or not compiled in, the advice is a no-op.
"""

from __future__ import annotations

import mmap

HUGE_PAGE = 2 << 20


def advise_huge_pages(mm: mmap.mmap, nbytes: int, offset: int = 0) -> bool:
    """madvise(MADV_HUGEPAGE) on `nbytes` of `mm` from `offset` (page-aligned); call before the pages are touched.
    False where the system has no transparent huge pages."""
    if not (hasattr(mm, "madvise") and hasattr(mmap, "MADV_HUGEPAGE")):
        return False
    try:
        mm.madvise(mmap.MADV_HUGEPAGE, offset, nbytes - nbytes % mmap.PAGESIZE or mmap.PAGESIZE)
    except OSError:
        return False
    return True
