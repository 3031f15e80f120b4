"""Host allocator tuning: large buffers go straight to mmap and back to the OS when freed.

glibc raises its mmap threshold each time a large mmapped block is freed, so after a few sleep
and wake cycles, weight-sized buffers come from the heap and arenas instead, where fragmentation
keeps freed copies resident: the worker's RSS then grows by a weight copy now and then. A fixed
threshold (which also turns the dynamic adjustment off) keeps RSS flat over any number of cycles.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
DEFAULT_THRESHOLD = 1024 * 1024


def fix_mmap_threshold(nbytes: int = DEFAULT_THRESHOLD) -> bool:
    """Set glibc's mmap threshold to ``nbytes``; False when not glibc or set by the environment."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        done = bool(libc.mallopt(M_MMAP_THRESHOLD, nbytes))
    except (OSError, AttributeError):
        return False
    if done:
        log.info("host allocator: blocks of %d bytes and more are mmapped", nbytes)
    return done
