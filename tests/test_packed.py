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
