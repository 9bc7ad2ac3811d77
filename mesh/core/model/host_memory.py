"""Fresh host memory for a station: its packed weights in one arena, its KV cache as zero pages the OS maps on use.

Fresh memory costs a page fault per 4 KiB page first touched: on the VMs measured here ~3 us each (30-35 ms for
40 MiB), as the host backs each page.
- Packing (or repacking GGUF blocks) writes every weight once. `WeightArena` is one allocation of a size known up
  front; while the packing fills it from the front, a thread asks the kernel to fault the whole range in (madvise
  MADV_POPULATE_WRITE, Linux 5.14+: one call, no trap per page, 22 ms for 40 MiB), so the faults overlap the
  packing's own work. Where the call is refused (another OS, an older kernel) the pages fault on first write.
- The KV cache must read as zeros where nothing was written (a masked position's value still meets a zero
  probability). `zero_pages` maps them from the OS, which hands out zeroed pages on first touch: a station's
  budget is not written at start (torch.zeros wrote 256 MiB: ~90 ms of every start). `populate_in_background`
  then faults them in from a daemon thread, a few MiB per call, so a sequence that first reaches a block does not
  pay its faults inside the step (serving SmolLM2 over HTTP, rounds on never-touched blocks were ~10% slower:
  each new block is 180 faults, taken in the attention kernel's single-threaded KV store while the other thread
  waits), and the budget is resident shortly after start, as a KV cache preallocated up front would be.
- Both ask for transparent huge pages where the station's spec says so (StationSpec.huge_pages, on by default): the
  range starts on a 2 MiB boundary and is advised MADV_HUGEPAGE, so the kernel backs it with 2 MiB pages where it
  can (one TLB entry for what took 512; where the machine's THP setting is `never` nothing changes). A decode step
  streams every weight once: on the Intel Xeon VM of session 48 a whole bench-preset station decodes 13-38% faster
  at batch 1 and 6-15% at batch 16 (2 threads), and 100 MiB fault in in ~12 ms against ~26 ms in 4 KiB pages
  (bench/out/huge_pages_s48.txt). On the AMD Zen 4 VM of session 39 a huge page took ~2 ms to fault in (a station's
  load ~3x as long) for ~2% faster decode (bench/out/huge_pages_s39.txt): there `huge_pages: false` loads faster.
"""
from __future__ import annotations

import ctypes
import math
import mmap
import sys
import threading

import torch

ALIGN = 64  # every carved tensor starts on a cache line (the kernels' vector loads)
PAGE = 4096
MADV_POPULATE_WRITE = 23  # linux/mman.h: fault the range in, writable, as a write would


def aligned(nbytes: int) -> int:
    """nbytes rounded up to a whole number of ALIGN-byte lines (what `take` uses of the arena)."""
    return -(-nbytes // ALIGN) * ALIGN


def tensor_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """The bytes a contiguous tensor of `shape` and `dtype` holds."""
    return math.prod(shape) * dtype.itemsize


HUGE_PAGE = 2 << 20  # a transparent huge page (x86-64 Linux)


def fresh_bytes(nbytes: int, huge_pages: bool = True) -> torch.Tensor:
    """nbytes (> 0) of fresh memory as a uint8 CPU tensor, its pages mapped zeroed by the OS on first touch; with
    huge_pages (on Linux, from 2 MiB), starting on a 2 MiB boundary and advised MADV_HUGEPAGE."""
    if not hasattr(mmap, "MAP_PRIVATE"):  # no POSIX mmap (Windows): zeros written by torch
        return torch.zeros(nbytes, dtype=torch.uint8)
    huge = huge_pages and sys.platform == "linux" and nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE")
    slack = HUGE_PAGE if huge else 0  # room to move the start to a huge page boundary
    region = mmap.mmap(-1, nbytes + slack, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # the tensor (and any view of it) holds `region` open
    start = -raw.data_ptr() % HUGE_PAGE if huge else 0
    if huge:
        try:
            region.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
        except OSError:  # a kernel built without transparent huge pages: 4 KiB pages, as without the advice
            pass
    return raw[start:start + nbytes]


def zero_pages(shape: tuple[int, ...], dtype: torch.dtype, huge_pages: bool = True) -> torch.Tensor:
    """A contiguous CPU tensor of zeros whose pages the OS maps (zeroed) on first touch, not written here (in huge
    pages where asked and granted: fresh_bytes)."""
    nbytes = tensor_bytes(shape, dtype)
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return fresh_bytes(nbytes, huge_pages).view(dtype).view(shape)


def _populate(address: int, nbytes: int) -> None:
    """Fault [address, address + nbytes) in for writing (Linux); a refused call leaves the pages to fault on use."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = address - address % PAGE
    libc.madvise(start, address + nbytes - start, MADV_POPULATE_WRITE)  # ctypes releases the GIL for the call


POPULATE_CHUNK = 8 << 20  # bytes faulted in per madvise call: the mmap lock is held for one chunk at a time


def populate_in_background(tensors: tuple[torch.Tensor, ...], name: str) -> threading.Thread | None:
    """Fault the pages of these contiguous CPU tensors in (contents unchanged: zero pages stay zeros) from a daemon
    thread, POPULATE_CHUNK bytes per call; returns the thread (None off Linux, where pages fault on first use).

    The thread holds the tensors' addresses, never the tensors: had it held the last reference while the interpreter
    shut down, a tensor over an mmap (fresh_bytes) would be freed on it, and its deleter's wait for the GIL ends a
    daemon thread by an unwind that aborts the process ('terminate called without an active exception'). Memory
    released meanwhile is harmless to advise: an unmapped range is refused, a reused one only faulted in."""
    if sys.platform != "linux":
        return None
    ranges = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]

    def run() -> None:
        for start, nbytes in ranges:
            for offset in range(0, nbytes, POPULATE_CHUNK):
                _populate(start + offset, min(POPULATE_CHUNK, nbytes - offset))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


class WeightArena:
    """Tensors carved one after another out of one allocation of a size known up front (in huge pages where asked and
    granted: fresh_bytes), faulted in from a second thread while they are filled; `close` waits for that thread (call
    it when the packing is done)."""

    def __init__(self, nbytes: int, huge_pages: bool = True) -> None:
        self._bytes = fresh_bytes(nbytes, huge_pages) if nbytes > 0 else torch.empty(0, dtype=torch.uint8)
        self._used = 0
        self._faulting = None
        if sys.platform == "linux" and nbytes >= 64 * PAGE:
            self._faulting = threading.Thread(target=_populate, args=(self._bytes.data_ptr(), nbytes),
                                              name="weight-arena-populate", daemon=True)
            self._faulting.start()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of `shape` and `dtype`, contents undefined (its bytes counted by `aligned`)."""
        nbytes = tensor_bytes(shape, dtype)
        if self._used + aligned(nbytes) > self._bytes.numel():
            raise ValueError(f"weight arena: {nbytes} more bytes do not fit ({self._used} of "
                             f"{self._bytes.numel()} used)")
        out = self._bytes[self._used:self._used + nbytes].view(dtype).view(shape)
        self._used += aligned(nbytes)
        return out

    def close(self) -> None:
        """Wait for the faulting thread (it only touches pages the packing writes anyway)."""
        if self._faulting is not None:
            self._faulting.join()
            self._faulting = None
