"""The packed station runs its whole layer range in one native call (mesh.core.model.fused) and gets the
bits the per-op path gets, for every architecture and with float32, bfloat16 or float16 tiles; a model that is not
all on the packed kernels keeps the per-op path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mesh.core.config import StationSpec
from mesh.core.model.fused import fuse_layers
from mesh.core.model.kernels import native_silu_mul, resolve_linear_backend
from mesh.core.params import SamplingParams
from mesh.core.wave import WaveEntry
from station.step import Station

GREEDY = SamplingParams(max_tokens=64, temperature=0.0)

needs_packed = pytest.mark.skipif(resolve_linear_backend("auto", torch.device("cpu"), torch.float32) != "packed",
                                  reason="the packed native kernels do not run here")


def _waves(station: Station) -> list[torch.Tensor]:
    """Two prompts (one in two chunks, joined by the other mid-way), then 6 decode waves: every wave's logits."""
    vocab = station.config.vocab_size
    a, b = (torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (23, 40))
    waves = [((WaveEntry(1, 0, 23, GREEDY),), a),
             ((WaveEntry(1, 23, 1, GREEDY), WaveEntry(2, 0, 25)), a[-1:] + b[:25]),
             ((WaveEntry(2, 25, 15, GREEDY),), b[25:])]
    logits, last = [], {1: a[-1], 2: b[-1]}
    for entries, ids in waves:
        out = station.forward(entries, token_ids=torch.tensor(ids), want_logits=True)
        logits.append(out.logits.clone())
        last.update((e.seq_id, s.token_id) for e, s in zip(entries, out.samples) if s is not None)
    for step in range(6):
        entries = (WaveEntry(1, 24 + step, 1, GREEDY), WaveEntry(2, 40 + step, 1, GREEDY))
        out = station.forward(entries, token_ids=torch.tensor([last[1], last[2]]), want_logits=True)
        logits.append(out.logits.clone())
        last = {1: out.samples[0].token_id, 2: out.samples[1].token_id}
    station.release([1, 2])
    return logits


@needs_packed
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_one_call_per_range_gives_the_bits_of_the_per_op_path(model_dirs, arch):
    """Prompt chunks, mixed and decode waves: the fused station's logits equal the per-op station's bit for bit
    (llama: GQA and llama3 RoPE; mistral: sliding window; qwen2: q/k/v biases)."""
    fused = Station(model_dirs[arch], StationSpec(layers=(0, 6)))
    per_op = Station(model_dirs[arch], StationSpec(layers=(0, 6)))
    assert fused.fused is not None
    per_op.fused = None
    for i, (x, y) in enumerate(zip(_waves(fused), _waves(per_op))):
        assert torch.equal(x, y), f"wave {i}: the fused layers differ from the per-op path"


@needs_packed
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_narrow_tiles_give_the_bits_of_float32_tiles_fused_and_per_op(tiny_llama_bf16, tmp_path, monkeypatch, dtype):
    """A bfloat16 (float16) checkpoint's station holds bfloat16 (float16) tiles; its logits, fused and per-op, equal
    those of the same station made to hold the same values in float32 tiles, bit for bit."""
    from mesh.core.model.synthetic import preset_config, write_checkpoint

    path = tiny_llama_bf16 if dtype == "bfloat16" else write_checkpoint(tmp_path / "f16", preset_config("tiny"),
                                                                         dtype=dtype)
    held = Station(path, StationSpec(layers=(0, 6)))
    assert held.fused is not None and held.model.lm_head.weight.dtype == getattr(torch, dtype)
    with monkeypatch.context() as m:
        m.setattr("mesh.core.model.packed.narrowest_exact", lambda parts: torch.float32)
        widened = Station(path, StationSpec(layers=(0, 6)))
    assert widened.fused is not None and widened.model.lm_head.weight.dtype == torch.float32
    expected = _waves(widened)
    for i, (x, y) in enumerate(zip(_waves(held), expected)):
        assert torch.equal(x, y), f"wave {i}: {dtype} tiles differ from float32 tiles (fused)"
    held.fused = None
    for i, (x, y) in enumerate(zip(_waves(held), expected)):
        assert torch.equal(x, y), f"wave {i}: {dtype} tiles differ from float32 tiles (per op)"


@needs_packed
def test_a_middle_station_runs_fused_on_hidden_rows(tiny_llama):
    """A station without the embedding or head takes hidden rows through the fused call, leaving its input as
    it was, and gives the per-op path's bits."""
    mid = Station(tiny_llama, StationSpec(layers=(2, 4)))
    assert mid.fused is not None
    hidden = torch.randn(7, mid.config.hidden_size, generator=torch.Generator().manual_seed(3))
    kept = hidden.clone()
    fused_out = mid.forward((WaveEntry(5, 0, 7),), hidden=hidden).hidden
    assert torch.equal(hidden, kept)
    mid.release([5])
    mid.fused = None
    assert torch.equal(fused_out, mid.forward((WaveEntry(5, 0, 7),), hidden=hidden).hidden)


@needs_packed
@pytest.mark.parametrize("backend", ["aten", "onednn"])
def test_other_backends_keep_the_per_op_path(tiny_llama, backend):
    """Only a station whose every layer runs the packed kernels is fused."""
    try:
        st = Station(tiny_llama, StationSpec(layers=(0, 6), linear_backend=backend))
    except ValueError:
        pytest.skip(f"{backend} does not run here")
    assert st.fused is None


@needs_packed
def test_a_layer_off_the_packed_kernels_keeps_the_model_per_op(tiny_llama):
    """One Linear with another kernel (say, a quantized weight) and the whole model stays on the per-op path."""
    st = Station(tiny_llama, StationSpec(layers=(0, 6)))
    layer = next(iter(st.model.model.layers.values()))
    layer.mlp.down_proj.kernel = lambda x, w, b: x @ w.T
    assert fuse_layers(st.model) is None


@needs_packed
def test_native_silu_mul_matches_torch(tiny_llama):
    """silu(gate) * up from the native kernel is within float32 rounding of torch's, over a wide input range."""
    gate_up = torch.linspace(-120, 120, 7 * 2 * 96).view(7, 2 * 96)  # [T, 2I]
    gate, up = gate_up.chunk(2, dim=1)
    assert torch.allclose(native_silu_mul(gate_up), F.silu(gate) * up, rtol=1e-6, atol=1e-30)


@needs_packed
def test_native_silu_mul_gives_a_value_the_same_bits_in_the_vector_loop_and_the_tail():
    """The kernel takes 8 values at a time (exp8_f32) and the last I % 8 one by one (exp_f32): both must give the
    same bits, or a value's result would depend on where its row's width puts it. Values at positions 0-7 of a
    13-wide row (vector loop) are compared with the same values at positions 8-12 and alone (the tail)."""
    g = torch.Generator().manual_seed(5)
    values = torch.cat([torch.randn(64, generator=g) * 30, torch.tensor([0.0, -0.0, 88.5, -87.5, -100.0, 1e-40,
                                                                          float("inf"), -float("inf")])])
    ups = torch.randn(values.numel(), generator=g)
    for start in range(0, values.numel(), 8):
        gate, up = values[start:start + 8], ups[start:start + 8]
        wide = native_silu_mul(torch.cat([gate, gate[:5], up, up[:5]])[None])[0]  # [13]: 8 vector, 5 tail
        tail = torch.stack([native_silu_mul(torch.stack([x, u])[None])[0, 0] for x, u in zip(gate, up)])
        assert torch.equal(wide[:8].view(torch.int32), tail.view(torch.int32))
        assert torch.equal(wide[8:].view(torch.int32), tail[:5].view(torch.int32))


@pytest.mark.parametrize("head_dim, base", [(64, 10000.0), (96, 100000.0), (128, 500000.0)])
def test_the_rope_table_gives_the_bits_of_the_tables_made_per_wave(head_dim, base):
    """The fused layers' cos / sin rows gathered from one table (grown as waves reach further) are rope_cos_sin's
    for the wave's own positions, bit for bit: runs, single rows, scattered positions, before and after growing."""
    from mesh.core.model.llama import RopeTable, rope_cos_sin
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    table, gen = RopeTable(inv_freq, max_positions=4096), torch.Generator().manual_seed(3)
    waves = [torch.arange(0, 23), torch.tensor([23]), torch.arange(300, 316), torch.tensor([4095]),
             torch.randint(0, 4096, (37,), generator=gen), torch.arange(1000, 1064), torch.tensor([0, 4095, 17])]
    for i, positions in enumerate(waves):  # every other wave's furthest position told by the caller
        cos, sin = table.rows(positions, int(positions.max()) if i % 2 else None)
        want_cos, want_sin = rope_cos_sin(inv_freq, positions, torch.float32)
        assert cos.shape == want_cos.shape == (len(positions), head_dim)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin), positions[:4]
