"""The packed path's set-up: tiles built from a weight's parts without a concatenated copy, all of a model's packed
weights in one allocation."""
from __future__ import annotations

import pytest
import torch

from mesh.core.config import ModelConfig
from mesh.core.model.kernels import resolve_linear_backend, use_linear_backend
from mesh.core.model.llama import Linear
from mesh.core.model.loader import load_range
from mesh.core.model.packed import PACK_TILE, pack_rows
from mesh.core.model.weight_arena import ALIGN, WeightArena


def _tiles_by_index(w: torch.Tensor) -> torch.Tensor:
    """The packed layout from its definition: out[t, k, c] = w[64 t + c, k], zero past the last row."""
    n, k = w.shape
    out = torch.zeros(-(-n // PACK_TILE), k, PACK_TILE)
    for r in range(n):
        out[r // PACK_TILE, :, r % PACK_TILE] = w[r]
    return out


@pytest.mark.parametrize("sizes", [(576,), (70,), (64, 128), (70, 10, 100), (5, 3), (63, 1, 64)])
def test_parts_pack_into_the_tiles_of_their_rows_one_after_another(sizes):
    g = torch.Generator().manual_seed(len(sizes))
    parts = [torch.randn(n, 40, generator=g) for n in sizes]
    expected = _tiles_by_index(torch.cat(parts))
    assert torch.equal(pack_rows(parts), expected)
    into = torch.full(expected.shape, float("nan"))  # whatever the memory held: every value is written
    assert pack_rows(parts, into) is into and torch.equal(into, expected)


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


def test_a_packed_station_holds_its_linear_weights_in_one_allocation(tiny_llama):
    cfg = ModelConfig.from_dir(tiny_llama)
    if resolve_linear_backend("auto", torch.device("cpu"), torch.float32) != "packed":
        pytest.skip("the packed kernels do not build here")
    model, _ = load_range(tiny_llama, cfg, 0, cfg.num_hidden_layers)
    use_linear_backend(model, "packed", torch.device("cpu"), torch.float32)
    packed = [m.weight for m in model.modules() if isinstance(m, Linear) and m.weight.device.type != "meta"]
    assert packed and all(m.weight_layout == "packed" for m in model.modules()
                          if isinstance(m, Linear) and m.weight.device.type != "meta")
    assert len({w.untyped_storage().data_ptr() for w in packed}) == 1
