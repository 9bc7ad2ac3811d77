"""The packed path's set-up: tiles built from a weight's parts without a concatenated copy, all of a model's packed
weights in one allocation."""
from __future__ import annotations

import pytest
import torch

from mesh.core.config import ModelConfig
from mesh.core.model.kernels import resolve_linear_backend, use_linear_backend
from mesh.core.model.llama import Linear
from mesh.core.model.loader import load_range
from mesh.core.model.packed import PACK_TILE, pack_rows, packed_linear


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


@pytest.mark.parametrize("n", [64, 100, 9 * PACK_TILE, 15 * PACK_TILE])
def test_any_thread_count_gives_every_row_the_same_bits(n):
    """Threads claim tiles from their own range, then from the others' (csrc/tile_claims.h): with fewer tiles than
    threads, ranges of unequal length, and 1-8 threads, each output is still its one chain, next to a reference."""
    g = torch.Generator().manual_seed(n)
    w, x = torch.randn(n, 96, generator=g), torch.randn(16, 96, generator=g)
    wp, threads = pack_rows([w]), torch.get_num_threads()
    try:
        for rows in (1, 3, 7, 16):
            outs = []
            for count in (1, 2, 3, 5, 8):
                torch.set_num_threads(count)
                outs.append(packed_linear(x[:rows], wp, None, n))
            assert all(torch.equal(outs[0], out) for out in outs[1:]), rows
            torch.testing.assert_close(outs[0], x[:rows].double().mm(w.double().T).float(), rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(threads)


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
