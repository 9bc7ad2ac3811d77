"""Keep large freed blocks in the process for reuse, so a step's temporaries never page-fault.

glibc's malloc serves a block above its mmap threshold (128 KiB at start, raised
as such blocks are freed) with a fresh mmap, and gives the top of a heap back to
the kernel above its trim threshold. A step's large temporaries (a prefill wave's
[T, intermediate] activations, a long decode's gathered keys) are then new pages
every time: the first touch of each 4 KiB page is a page fault, and a 512-token
prefill of the bench preset spent ~17% of its time in them (234 -> 195 ms with
the thresholds raised; decode waves unchanged). Raising both thresholds keeps
that memory in the heap, where the next wave's temporaries reuse it: the
process holds on to its peak working set, as a serving engine that preallocates
would. Linux with glibc only; elsewhere a no-op.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's ceiling for this setting on 64-bit
TRIM_THRESHOLD_BYTES = 2**31 - 1  # the largest mallopt takes (an int): a heap's top is kept up to 2 GiB


@cache
def keep_large_blocks() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); True when both took."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    trim = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    mmap = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    return bool(trim and mmap)
