"""Keep large freed blocks in the process for reuse, so a step's temporaries do not page-fault.

glibc's malloc serves a block above its mmap threshold (128 KiB at start, raised
as such blocks are freed, up to 32 MiB) with a fresh mmap, and gives the top of a
heap back to the kernel above its trim threshold. A step's large temporaries (a
prefill wave's [T, intermediate] activations, a long decode's gathered keys) can
then be new pages, each first touch a page fault: waves of changing size on a
worker thread fault thousands of pages a round (tests/test_allocator.py). When
the wave sizes settle, glibc's own adjustment catches up, and in steady serving
the difference is within noise (bench/out/ab_session3.txt).
A worker thread's allocations come from a per-thread arena, whose extra heaps
(64 MiB each) are unmapped whole once emptied, whatever the trim threshold: on
some CPUs (seen on an Intel Xeon, not on the AMD EPYC of earlier runs) a wave's
8 MiB temporary landed in such a heap and was faulted in afresh every round.
A top pad of one heap's size keeps an emptied heap mapped too.
The wire has the same pattern: each MiB of hidden rows a hop encodes, sends, receives and parses passes
through several fresh buffers, and a process left to glibc faulted ~2,000 pages per 1 MiB hop (6-12 ms of a
hop on the VMs measured); so a station's gRPC server and every StationClient set this too, not only the compute
thread (tests/test_allocator.py).
Raising the thresholds and the pad keeps that memory in the process, where the
next wave's temporaries reuse it: the process holds on to its peak working set,
as a serving engine that preallocates would (the pad is address space, touched
only when used). Linux with glibc only; elsewhere a no-op.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers (malloc.h)
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's ceiling for this setting on 64-bit
TRIM_THRESHOLD_BYTES = 2**31 - 1  # the largest mallopt takes (an int): a heap's top is kept up to 2 GiB
TOP_PAD_BYTES = 64 * 2**20  # a per-thread arena's heap size on 64-bit: an emptied heap stays mapped


@cache
def keep_large_blocks() -> bool:
    """Raise glibc's mmap and trim thresholds and its top pad for this process (once); True when all took."""
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
    pad = mallopt(M_TOP_PAD, TOP_PAD_BYTES)
    return bool(trim and mmap and pad)
