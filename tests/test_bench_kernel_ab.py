"""bench/kernel_ab.py: one station's decode waves on two builds of the native kernels, alternated (a smoke run)."""
from __future__ import annotations

import pytest
import torch

import mesh.core.model.kernels as kernels
import mesh.core.model.native as native
import mesh.core.model.quant_linear as quant_linear
from mesh.core.config import StationSpec
from mesh.core.model.kernels import resolve_linear_backend
from station.step import Station

needs_packed = pytest.mark.skipif(resolve_linear_backend("auto", torch.device("cpu"), torch.float32) != "packed",
                                  reason="the packed native kernels do not run here")


@needs_packed
def test_both_builds_are_timed_draw_the_same_tokens_and_are_unhooked_after(bench_script, tiny_llama):
    """--quick on the tiny llama (base = HEAD): two pairs of timed rounds at batch 1, both builds drew the same
    greedy tokens, and the kernels' library lookups are the station's own again afterwards."""
    ab = bench_script("kernel_ab")
    fig = ab.main(["--quick", "--model", str(tiny_llama)])["batches"][1]
    assert fig["pairs"] == 2 and all(len(fig["samples"][k]) == 2 for k in ("base", "tree"))
    assert all(ms > 0 for k in ("base", "tree") for ms in fig["samples"][k])
    assert fig["same_tokens"] is True
    assert kernels.load_native is native.load_native and quant_linear.load_native is native.load_native


@needs_packed
def test_using_points_every_decode_caller_at_the_given_library(bench_script, tiny_llama):
    """Inside `using`, the fused layers and the head's norm and linear look up the given library; after, the
    process's own."""
    ab = bench_script("kernel_ab")
    station = Station(tiny_llama, StationSpec(layers=(0, 6)))
    own, other = station.fused.lib, object()
    with ab.using(station, other):
        assert station.fused.lib is other
        assert kernels.load_native()[0] is other and quant_linear.load_native()[0] is other
    assert station.fused.lib is own and kernels.load_native()[0] is native.load_native()[0]
