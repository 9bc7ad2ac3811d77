"""Fresh host memory: the weight arena carves disjoint aligned tensors, and a CPU station's KV budget reads as zeros,
is not written at start and is faulted in from a background thread; both ask for transparent huge pages where the
spec says so."""
from __future__ import annotations

import resource
import sys
import weakref

import pytest
import torch

from mesh.core.config import ModelConfig, StationSpec
from mesh.core.model.host_memory import ALIGN, HUGE_PAGE, WeightArena, fresh_bytes, populate_in_background, zero_pages
from station.kv import KVPool


def test_arena_carves_disjoint_aligned_tensors_and_refuses_overflow():
    arena = WeightArena(1 << 20)
    a, b = arena.take((100, 3), torch.float32), arena.take((1000,), torch.uint8)
    assert a.shape == (100, 3) and b.shape == (1000,) and a.is_contiguous()
    assert a.data_ptr() % ALIGN == 0 and b.data_ptr() % ALIGN == 0
    assert b.data_ptr() >= a.data_ptr() + a.numel() * 4
    a.fill_(1.0), b.fill_(7)
    assert bool((a == 1.0).all()) and bool((b == 7).all())
    with pytest.raises(ValueError, match="do not fit"):
        arena.take((1 << 20,), torch.uint8)
    arena.close()
    arena.close()  # a second close is harmless


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/statm")
def test_a_cpu_kv_budget_reads_zeros_is_not_written_at_start_and_comes_in_beside_the_waves(tiny_llama):
    """The pool's constructor writes nothing (a 256 MiB budget is not resident when it returns: zero pages the OS
    maps); a daemon thread then faults the whole budget in, and it still reads as zeros and takes writes."""
    cfg = ModelConfig.from_dir(tiny_llama)
    before, faults = _resident_bytes(), resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    pool = KVPool(cfg, StationSpec(layers=(0, cfg.num_hidden_layers), kv_bytes=256 << 20))
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults  # this thread's, not the populate's
    budget = pool.k.numel() * pool.k.element_size() + pool.v.numel() * pool.v.element_size()
    assert budget >= 255 << 20
    assert faults < budget // 4096 // 20, f"the constructor faulted {faults} pages of a {budget >> 20} MiB budget"
    assert pool.populating is not None and pool.populating.daemon
    pool.populating.join(60)
    assert not pool.populating.is_alive()
    populated = _resident_bytes() - before
    assert populated >= budget * 0.95, f"{populated >> 20} of {budget >> 20} MiB resident after the populate thread"
    assert not pool.k.any() and not pool.v.any()  # reads as zeros
    pool.k[0, 0] = 1.5
    assert pool.k[0, 0].eq(1.5).all() and not pool.k[0, 1].any()


@pytest.mark.skipif(sys.platform != "linux", reason="the populate thread runs on Linux only")
def test_the_populate_thread_holds_no_reference_to_its_tensors():
    """Dropping the tensors frees them while their pages are still being faulted in: a daemon thread left holding the
    last reference at interpreter exit freed a tensor over an mmap there and aborted the process (CI, session 54)."""
    region = fresh_bytes(512 << 20)
    gone = weakref.ref(region)
    thread = populate_in_background((region,), "populate-test")
    assert thread is not None and thread.daemon
    del region
    assert gone() is None, "the populate thread keeps the tensor alive"
    thread.join(60)
    assert not thread.is_alive()  # advising the released range is refused, not fatal


def test_zero_pages_are_zeros_of_the_shape_and_dtype():
    t = zero_pages((3, 5, 7), torch.float32)
    assert t.shape == (3, 5, 7) and t.dtype == torch.float32 and t.is_contiguous() and not t.any()
    assert zero_pages((0, 4), torch.bfloat16).shape == (0, 4)


def _thp_mode() -> str | None:
    """The machine's transparent huge page setting (always / madvise / never), None where it has none."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def _thp_eligible(address: int) -> bool:
    """Whether the kernel may back the mapping holding `address` with huge pages (/proc/self/smaps' THPeligible)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "THPeligible:":
                return line.split()[1] == "1"
    raise AssertionError(f"no mapping with THPeligible holds {address:#x}")


@pytest.mark.skipif(sys.platform != "linux" or _thp_mode() not in ("always", "madvise"),
                    reason="needs Linux with transparent huge pages on (always or madvise)")
def test_the_arena_and_the_kv_cache_ask_for_huge_pages_unless_the_spec_says_not(tiny_llama):
    """With huge_pages (the default) the arena and a KV budget start on a 2 MiB boundary in a mapping the kernel may
    back with huge pages; without it, 4 KiB pages where the machine's setting leaves it to the advice (madvise);
    either way the memory reads and writes as before."""
    arena = WeightArena(8 << 20)
    w = arena.take((1 << 20,), torch.float32)
    assert w.data_ptr() % HUGE_PAGE == 0 and _thp_eligible(w.data_ptr())
    w.fill_(2.0)
    assert bool((w == 2.0).all())
    arena.close()
    cfg = ModelConfig.from_dir(tiny_llama)
    pool = KVPool(cfg, StationSpec(layers=(0, cfg.num_hidden_layers), kv_bytes=16 << 20))
    assert pool.k.data_ptr() % HUGE_PAGE == 0 and _thp_eligible(pool.k.data_ptr()) and not pool.k.any()
    plain_pool = KVPool(cfg, StationSpec(layers=(0, cfg.num_hidden_layers), kv_bytes=16 << 20, huge_pages=False))
    plain_arena = WeightArena(8 << 20, huge_pages=False)
    if _thp_mode() == "madvise":
        assert not _thp_eligible(plain_pool.k.data_ptr())
        assert not _thp_eligible(plain_arena.take((16,), torch.uint8).data_ptr())
    plain_arena.close()
    for each in (pool, plain_pool):  # their populate threads done before the test's memory goes
        each.populating.join(60)
    assert fresh_bytes(HUGE_PAGE - 1).numel() == HUGE_PAGE - 1  # under one huge page: no advice, the size asked
