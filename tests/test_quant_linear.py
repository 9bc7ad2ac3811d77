"""Quantized-resident GGUF weights on the packed CPU path: the bits of the dequantized float32 packed path."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from mesh.core.compute import on_compute_thread
from mesh.core.config import ModelConfig, StationSpec
from mesh.core.model.gguf_convert import convert_gguf
from mesh.core.model.fused import FIELDS, QUANT_FORMAT
from mesh.core.model.gguf_write import write_gguf
from mesh.core.model.kernels import resolve_linear_backend, use_linear_backend
from mesh.core.model.packed import pack_rows, pad_bias, packed_linear
from mesh.core.model.llama import Linear
from mesh.core.model.loader import load_range
from mesh.core.model.quant_kblocks import FACTORED
from mesh.core.model.quant_linear import (KERNEL_CODES, QuantEmbedding, QuantFormatError, QuantRows, quant_linear,
                                          repack)
from mesh.core.model.synthetic import write_checkpoint
from mesh.core.params import SamplingParams
from mesh.core.wave import WaveEntry
from station.step import Station

pytestmark = pytest.mark.skipif(resolve_linear_backend("auto", torch.device("cpu"), torch.float32) != "packed",
                                reason="the packed native kernels do not build on this machine")
KINDS = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS,
         *FACTORED)
K_KINDS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, *FACTORED)  # super-blocks of 256 weights
# the kinds made as random blocks (the gguf package cannot quantize to them): where a block's float16 scale(s)
# start and how many (IQ1_M's d: the top nibbles of its four last uint16)
RANDOM_BLOCKS = {Q.Q2_K: (80, 2), Q.Q3_K: (108, 1), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208, 1),
                 Q.IQ4_XS: (0, 1), Q.IQ4_NL: (0, 1), **{q: (0, 1) for q in FACTORED}, Q.IQ1_M: (None, 1)}
CFG = ModelConfig(arch="llama", vocab_size=512, hidden_size=96, intermediate_size=160, num_hidden_layers=4,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                  rope_theta=10000.0, max_position_embeddings=1024, tie_word_embeddings=True)


def _k_blocks(w: np.ndarray, qtype: Q, seed: int = 0) -> np.ndarray:
    """Random blocks of a RANDOM_BLOCKS kind for a weight of w's shape: every quant, sub-block scale and minimum
    drawn at random, float16 d (and dmin) small and of either sign. Not w's values: the bits only need to be any
    the format holds."""
    rng = np.random.default_rng(seed + w.shape[0])
    (block, size), (d_at, halves) = GGML_QUANT_SIZES[qtype], RANDOM_BLOCKS[qtype]
    n, supers = w.shape[0], w.shape[1] // block
    b = rng.integers(0, 256, (n, supers, size), dtype=np.uint8)
    d = rng.uniform(2e-4, 2e-3, (n, supers, halves)) * rng.choice([-1.0, 1.0], (n, supers, halves))
    if d_at is None:  # IQ1_M: d's nibble i at the top of its scales' uint16 i
        scales = np.ascontiguousarray(b[..., size - 8:]).view(np.uint16)  # [n, supers, 4]
        bits = d[..., 0].astype(np.float16).view(np.uint16)
        for i in range(4):
            scales[..., i] = (scales[..., i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
        b[..., size - 8:] = scales.view(np.uint8)
        return b.reshape(n, -1)
    b[..., d_at:d_at + 2 * halves] = d.astype(np.float16).view(np.uint8)
    return b.reshape(n, -1)


def _blocks(n: int, k: int, qtype: Q, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """Random weights [n, k] quantized to qtype (K-quants: random blocks, _k_blocks): (the blocks, their float32
    dequantized by the gguf package)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    w[0, :32] = 0.0  # a block of zeros (scale 0) too
    raw = _k_blocks(w, qtype, seed) if qtype in RANDOM_BLOCKS else quantize(w, qtype)
    return raw, torch.from_numpy(np.array(dequantize(raw, qtype), dtype=np.float32))


@pytest.mark.parametrize("qtype", KINDS, ids=lambda q: q.name)
def test_kernel_gives_the_packed_float32_bits_at_every_row_and_thread_count(qtype):
    """The bits of the gguf-dequantized float32 in packed tiles at 1-17 rows, with and without a bias, at one thread
    as at several (K-quants held as groups of 32 with float32 scales)."""
    shapes = ((5, 256), (131, 512), (70, 768)) if qtype in K_KINDS else ((5, 32), (131, 96), (70, 160))
    for n, k in shapes:  # odd N (partial tiles), K of an odd number of blocks
        raw, dense = _blocks(n, k, qtype, seed=n)
        qw, bias = repack([QuantRows("w", qtype, raw, k)]), pad_bias(torch.randn(n))
        x = torch.randn(17, k) * 3
        for t in range(1, 18):
            ref = packed_linear(x[:t], pack_rows([dense]), bias, n)
            assert torch.equal(quant_linear(x[:t], qw, bias, n, qtype), ref), (n, k, t)
            assert torch.equal(quant_linear(x[:t], qw, None, n, qtype), packed_linear(x[:t], pack_rows([dense]), None, n))
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one_thread = quant_linear(x, qw, bias, n, qtype)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one_thread, quant_linear(x, qw, bias, n, qtype))


@pytest.mark.parametrize("qtype", (Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL, *K_KINDS), ids=lambda q: q.name)
def test_parts_repack_side_by_side_in_their_row_order(qtype):
    k = 256 if qtype in K_KINDS else 64
    (a, da), (b, db) = _blocks(70, k, qtype, 1), _blocks(37, k, qtype, 2)
    order = np.random.default_rng(3).permutation(70).astype(np.int64)
    fused = repack([QuantRows("a", qtype, a, k, order), QuantRows("b", qtype, b, k)])
    x = torch.randn(9, k)
    assert torch.equal(quant_linear(x, fused, None, 107, qtype),
                       packed_linear(x, pack_rows([torch.cat([da[torch.from_numpy(order)], db])]), None, 107))


def test_malformed_blocks_are_refused_with_a_clear_error():
    raw, _ = _blocks(8, 64, Q.Q4_1, 0)
    with pytest.raises(QuantFormatError, match=r"w: Q4_1 rows of \[38\] uint8 do not hold 64 weights in blocks of 32"):
        QuantRows("w", Q.Q4_1, raw[:, :38], 64)
    with pytest.raises(QuantFormatError, match="do not hold 48 weights"):
        QuantRows("w", Q.Q4_1, raw, 48)
    with pytest.raises(QuantFormatError, match="Q8_0 rows of"):
        QuantRows("w", Q.Q8_0, raw, 64)  # Q4_1 bytes read as Q8_0: 40 bytes a row is no whole block count
    with pytest.raises(QuantFormatError, match="type Q8_1 is not one the quantized kernel holds"):
        QuantRows("w", Q.Q8_1, raw, 64)
    with pytest.raises(QuantFormatError, match=r"Q4_K rows of \[40\] uint8 do not hold 64 weights in blocks of 256"):
        QuantRows("w", Q.Q4_K, raw, 64)  # a K-quant row holds whole super-blocks of 256
    nan = _k_blocks(np.zeros((2, 256), np.float32), Q.IQ2_XXS)
    nan[1, 0:2] = np.array([0x7E00], np.uint16).view(np.uint8)  # a NaN scale: no exact scale and small integers
    with pytest.raises(QuantFormatError, match=r"w: IQ2_XXS rows: its weights are not one float32 scale times .*NaN"):
        repack([QuantRows("w", Q.IQ2_XXS, nan, 256)])
    with pytest.raises(QuantFormatError, match="differ in type or width"):
        repack([QuantRows("a", Q.Q4_1, raw, 64), QuantRows("b", Q.Q8_0, quantize(np.ones((2, 64), np.float32),
                                                                                    Q.Q8_0), 64)])


@pytest.fixture(scope="module")
def quant_files(tmp_path_factory):
    """{qtype: (gguf file, its dequantized float32 safetensors directory)} of one tied random checkpoint."""
    root = tmp_path_factory.mktemp("quant")
    src = write_checkpoint(root / "tiny", CFG)
    out = {}
    for qtype in (Q.Q8_0, Q.Q4_1):
        path = write_gguf(src, root / f"tiny-{qtype.name}.gguf", qtype)
        out[qtype] = path, convert_gguf(path, root / f"hf-{qtype.name}", progress=False)
    return out


def _logits(station: Station, prompts: list[list[int]], first_seq: int) -> torch.Tensor:
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    entries = tuple(WaveEntry(first_seq + i, 0, len(p), greedy) for i, p in enumerate(prompts))
    out = station.forward(entries, token_ids=torch.tensor([t for p in prompts for t in p]), want_logits=True)
    return out.logits


@pytest.mark.parametrize("qtype", (Q.Q8_0, Q.Q4_1), ids=lambda q: q.name)
def test_station_keeps_gguf_weights_quantized_with_the_dequantized_bits(quant_files, qtype):
    path, hf_dir = quant_files[qtype]
    quant, dense = Station(path, StationSpec(layers=(0, 4))), Station(hf_dir, StationSpec(layers=(0, 4)))
    assert quant.linear_backend == dense.linear_backend == "packed"
    layouts = {m.weight_layout for m in quant.model.modules() if isinstance(m, Linear) and m.kernel is not None}
    assert layouts == {qtype.name.lower()}  # every matrix, the tied head too, held as blocks
    assert isinstance(quant.model.model.embed_tokens, QuantEmbedding)
    assert quant.load_report.weight_bytes < dense.load_report.weight_bytes / 3
    prompts = [[1, 17, 300, 45, 99, 7, 250], [5, 9], [400, 3, 77]]
    assert torch.equal(_logits(quant, prompts, 0), _logits(dense, prompts, 0))  # batched prefill, bit for bit
    alone = _logits(quant, prompts[1:2], 10)
    assert torch.equal(alone, _logits(dense, prompts[1:2], 10))
    assert quant.fused is not None  # the blocks run in the one native call per wave, as packed tiles do
    at = FIELDS.index("qkv_format")
    formats = set(quant.fused.weights[:, at:at + 4].flatten().tolist())
    assert formats == {QUANT_FORMAT + KERNEL_CODES[qtype]}
    fused = _logits(quant, prompts, 20)
    quant.fused = None  # the per-op path: one native call per linear
    assert torch.equal(_logits(quant, prompts, 30), fused)


def test_a_layer_of_blocks_and_float_tiles_runs_fused_with_the_dequantized_bits(tmp_path):
    """A file mixing types within a layer (Q4_1, o_proj float16, down_proj float32, as quantizers mix them): the
    station runs every layer in one native call, each linear in its own format, with the bits of the dequantized
    checkpoint and of its own per-op path."""
    src = write_checkpoint(tmp_path / "tiny", CFG)
    path = write_gguf(src, tmp_path / "mixed.gguf", Q.Q4_1, qtype_of={"o_proj": Q.F16, "down_proj": Q.F32})
    quant = Station(path, StationSpec(layers=(0, 4)))
    dense = Station(convert_gguf(path, tmp_path / "hf", progress=False), StationSpec(layers=(0, 4)))
    assert quant.fused is not None
    at = FIELDS.index("qkv_format")
    formats = quant.fused.weights[:, at:at + 4]  # [layers, (qkv, o, gate_up, down)]
    q4_1 = QUANT_FORMAT + KERNEL_CODES[Q.Q4_1]
    assert set(formats[:, 0].tolist()) == set(formats[:, 2].tolist()) == {q4_1}
    assert set(formats[:, 1].tolist()) | set(formats[:, 3].tolist()) <= {0, 1, 2}  # packed tiles
    prompts = [[1, 17, 300, 45, 99, 7, 250], [5, 9], [400, 3, 77]]
    want = _logits(dense, prompts, 0)
    assert torch.equal(_logits(quant, prompts, 0), want)
    quant.fused = None
    assert torch.equal(_logits(quant, prompts, 10), want)


def test_a_k_quant_file_runs_its_blocks_fused_with_the_dequantized_bits(tmp_path):
    """A file of Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS matrices (as K-quant files mix them: v in Q6_K beside q
    in Q4_K, so q, k and v cannot share one weight) beside a Q8_0 embedding: the station keeps every matrix as
    blocks, runs each layer in one native call (q, k and v as three linears there), and gives the bits of the
    dequantized checkpoint."""
    cfg = ModelConfig(arch="llama", vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
                      rope_theta=10000.0, max_position_embeddings=1024, tie_word_embeddings=True)
    src = write_checkpoint(tmp_path / "k", cfg)
    kinds = {"q_proj": Q.Q4_K, "k_proj": Q.IQ4_XS, "v_proj": Q.Q6_K, "o_proj": Q.Q3_K, "gate_proj": Q.Q2_K,
             "up_proj": Q.Q2_K, "down_proj": Q.Q5_K}
    path = write_gguf(src, tmp_path / "k.gguf", Q.Q8_0, qtype_of=kinds,
                      quantizer=lambda w, qt: _k_blocks(w, qt) if qt in kinds.values() else quantize(w, qt))
    quant = Station(path, StationSpec(layers=(0, 2)))
    dense = Station(convert_gguf(path, tmp_path / "hf", progress=False), StationSpec(layers=(0, 2)))
    layouts = {m.weight_layout for m in quant.model.modules() if isinstance(m, Linear) and m.kernel is not None}
    assert layouts == {"q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs", "q8_0"}  # the tied head Q8_0
    assert quant.fused is not None
    table = dict(zip(FIELDS, quant.fused.weights.T.tolist()))  # field -> its value in each layer
    code = {q: QUANT_FORMAT + KERNEL_CODES[q] for q in K_KINDS}
    assert table["qkv_weight"] == [0, 0] and all(a > 0 for f in ("q_weight", "k_weight", "v_weight") for a in table[f])
    assert [table[f][0] for f in ("q_format", "k_format", "v_format", "o_format", "gate_up_format", "down_format")] \
        == [code[Q.Q4_K], code[Q.IQ4_XS], code[Q.Q6_K], code[Q.Q3_K], code[Q.Q2_K], code[Q.Q5_K]]
    prompts = [[1, 17, 300, 45, 99, 7, 250], [5, 9], [400, 3, 77]]
    want = _logits(dense, prompts, 0)
    assert torch.equal(_logits(quant, prompts, 0), want)
    quant.fused = None
    assert torch.equal(_logits(quant, prompts, 10), want)
    decode = [WaveEntry(30 + i, 0, 1, SamplingParams(max_tokens=4, temperature=0.0)) for i in range(2)]
    for station in (quant, dense):  # one-row waves: the few-row kernels
        out = station.forward(tuple(decode), token_ids=torch.tensor([3, 4]), want_logits=True)
        station.release([30, 31])
        if station is quant:
            got = out.logits
    assert torch.equal(got, out.logits)


def test_other_dtypes_and_unasked_loads_dequantize_as_before(quant_files):
    path, _ = quant_files[Q.Q4_1]
    for dtype, keep in (("float32", False), ("bfloat16", True)):
        model, _ = on_compute_thread(load_range, path, CFG, 0, 4, dtype, "cpu", keep)
        assert isinstance(model.model.embed_tokens, torch.nn.Embedding)
        assert all(m.quant_rows is None and m.weight.device.type == "cpu"
                   for m in model.modules() if isinstance(m, Linear))
    kept, _ = on_compute_thread(load_range, path, CFG, 0, 4, "float32", "cpu", True)
    with pytest.raises(ValueError, match="aten cannot run weights kept quantized"):
        use_linear_backend(kept, "aten", torch.device("cpu"), torch.float32)


def test_parts_of_mixed_kinds_run_unfused_with_the_same_bits(quant_files):
    path, hf_dir = quant_files[Q.Q4_1]
    kept, _ = on_compute_thread(load_range, path, CFG, 0, 4, "float32", "cpu", True)
    dense, _ = on_compute_thread(load_range, hf_dir, CFG, 0, 4)
    attn, dense_attn = kept.model.layers["1"].self_attn, dense.model.layers["1"].self_attn
    attn.v_proj.weight, attn.v_proj.quant_rows = dense_attn.v_proj.weight, None  # v dense, q and k still blocks
    for model in (kept, dense):
        use_linear_backend(model, "packed", torch.device("cpu"), torch.float32)
    assert attn.qkv_proj is None and kept.model.layers["0"].self_attn.qkv_proj is not None
    assert (attn.q_proj.weight_layout, attn.k_proj.weight_layout, attn.v_proj.weight_layout) == ("q4_1", "q4_1", "packed")
    x = torch.randn(5, CFG.hidden_size)
    names = ("q_proj", "k_proj", "v_proj")
    want = dense_attn.qkv_proj(x).split([getattr(dense_attn, n).out_features for n in names], dim=1)
    for name, w in zip(names, want):
        assert torch.equal(getattr(attn, name)(x), w), name


@pytest.mark.parametrize("v_type", (Q.Q4_0, Q.Q8_0), ids=("qkv-fused", "v-apart"))
def test_qwen2_biases_and_q4_0_keep_the_dequantized_bits(model_dirs, tmp_path, v_type):
    """q/k/v biases with the blocks, fused into one weight, or (v in another type) as three linears in the fused
    call, each with its own bias."""
    path = write_gguf(model_dirs["qwen2"], tmp_path / "qwen2-q4_0.gguf", Q.Q4_0,  # q/k/v biases, tied head
                      qtype_of={"v_proj": v_type})
    hf_dir = convert_gguf(path, tmp_path / "hf", progress=False)
    layers = ModelConfig.from_dir(path).num_hidden_layers
    quant, dense = (Station(p, StationSpec(layers=(0, layers))) for p in (path, hf_dir))
    kept = [m for m in quant.model.modules() if isinstance(m, Linear) and m.kernel is not None]
    assert {m.weight_layout for m in kept} == {"q4_0", v_type.name.lower()} and any(m.bias is not None for m in kept)
    table = dict(zip(FIELDS, quant.fused.weights.T.tolist()))
    assert all(b > 0 for b in table["v_bias" if v_type != Q.Q4_0 else "qkv_bias"])
    prompts = [[1, 5, 9, 33, 2], [7, 8]]
    want = _logits(dense, prompts, 0)
    assert torch.equal(_logits(quant, prompts, 0), want)
    quant.fused = None
    assert torch.equal(_logits(quant, prompts, 10), want)
