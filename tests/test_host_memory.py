"""Fresh host memory: the weight arena carves disjoint aligned tensors, and a CPU station's KV budget reads as zeros
without being written at start."""
from __future__ import annotations

import sys

import pytest
import torch

from mesh.core.config import ModelConfig, StationSpec
from mesh.core.model.host_memory import ALIGN, WeightArena, zero_pages
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
def test_a_cpu_kv_budget_reads_zeros_and_is_not_written_at_start(tiny_llama):
    cfg = ModelConfig.from_dir(tiny_llama)
    before = _resident_bytes()
    pool = KVPool(cfg, StationSpec(layers=(0, cfg.num_hidden_layers), kv_bytes=1 << 30))
    grown = _resident_bytes() - before
    assert pool.k.numel() * pool.k.element_size() >= 1 << 29  # half the budget each for K and V
    assert grown < 64 << 20, f"a 1 GiB KV budget made {grown >> 20} MiB resident at start"
    assert not pool.k[:, :2].any() and not pool.v[:, -2:].any()  # reads as zeros
    pool.k[0, 0] = 1.5
    assert pool.k[0, 0].eq(1.5).all() and not pool.k[0, 1].any()


def test_zero_pages_are_zeros_of_the_shape_and_dtype():
    t = zero_pages((3, 5, 7), torch.float32)
    assert t.shape == (3, 5, 7) and t.dtype == torch.float32 and t.is_contiguous() and not t.any()
    assert zero_pages((0, 4), torch.bfloat16).shape == (0, 4)
