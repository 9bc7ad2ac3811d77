"""The packed path's set-up: tiles built from a weight's parts without a concatenated copy, all of a model's packed
weights in one allocation; weights bfloat16 or float16 holds exactly packed so, with the float32 tiles' bits."""
from __future__ import annotations

import pytest
import torch

from mesh.core.config import ModelConfig, StationSpec
from mesh.core.model.kernels import resolve_linear_backend, use_linear_backend
from mesh.core.model.llama import Linear
from mesh.core.model.loader import load_range
from mesh.core.model.packed import PACK_TILE, pack_rows, packed_linear, pad_bias
from mesh.core.model.synthetic import preset_config, write_checkpoint
from mesh.core.params import SamplingParams
from mesh.core.wave import WaveEntry
from station.step import Station

needs_packed = pytest.mark.skipif(resolve_linear_backend("auto", torch.device("cpu"), torch.float32) != "packed",
                                  reason="the packed native kernels do not run here")


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


def _bfloat16_valued(*shape: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """float32 values that `dtype` holds exactly (a checkpoint stored in it, read as float32)."""
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.1).to(dtype).float()


@pytest.mark.parametrize("sizes", [(70,), (64, 128), (5, 3)])
def test_bfloat16_tiles_interleave_each_lines_32_columns(sizes):
    """A bfloat16 tile's k row is two 64-byte lines of 32 columns; in each, position 2i holds column i and 2i + 1
    column 16 + i (the kernel widens a 32-bit lane's halves into two vectors)."""
    parts = [_bfloat16_valued(n, 40, seed=n) for n in sizes]
    natural = _tiles_by_index(torch.cat(parts))
    expected = torch.empty_like(natural)
    for line in range(PACK_TILE // 32):
        for i in range(16):
            expected[:, :, line * 32 + 2 * i] = natural[:, :, line * 32 + i]
            expected[:, :, line * 32 + 2 * i + 1] = natural[:, :, line * 32 + 16 + i]
    packed = pack_rows(parts, dtype=torch.bfloat16)
    assert packed.dtype == torch.bfloat16 and torch.equal(packed.float(), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_narrow_tiles_take_only_values_their_type_holds(dtype):
    """Rounding a weight silently would change the model: pack_rows refuses, naming why; packing picks bfloat16,
    else float16, else float32, by what every value of the weight is."""
    from mesh.core.model.packed import narrowest_exact

    w = _bfloat16_valued(64, 32, seed=1, dtype=dtype)
    assert narrowest_exact([w]) == dtype
    w[3, 5] += 1e-3  # no longer a value of either narrow type
    with pytest.raises(ValueError, match=f"{dtype} holds exactly"):
        pack_rows([w], dtype=dtype)
    assert narrowest_exact([w]) == torch.float32
    assert narrowest_exact([torch.tensor([[1.5, float("nan")]])]) == torch.bfloat16  # NaN's bits are kept
    assert narrowest_exact([torch.tensor([[1.0 + 2 ** -10, 65504.0]])]) == torch.float16
    # a file's narrow matrix (the loader keeps it so): its own type without a look, the other type by its values
    assert narrowest_exact([w.to(torch.bfloat16)]) == torch.bfloat16
    assert narrowest_exact([torch.tensor([[1.0 + 2 ** -10]]).half()]) == torch.float16  # bfloat16 cannot hold it
    assert narrowest_exact([torch.tensor([[1.0, 0.5]]).half()]) == torch.bfloat16  # float16 values bfloat16 holds
    # parts of both types (a mixed file's fused q/k/v): the type that holds every part's values, else float32
    bf16_tiny, bf16_plain = torch.tensor([[1.0, 2.0 ** -30]]).bfloat16(), torch.tensor([[1.0, 0.25]]).bfloat16()
    f16_plain, f16_fine = torch.tensor([[0.5]]).half(), torch.tensor([[1 + 2 ** -10]]).half()
    assert narrowest_exact([bf16_tiny, f16_plain]) == torch.bfloat16
    assert narrowest_exact([bf16_plain, f16_fine]) == torch.float16
    assert narrowest_exact([bf16_tiny[:, 1:], f16_fine]) == torch.float32


@needs_packed
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(80, 96), (200, 2048), (130, 70), (9 * PACK_TILE, 64)])
def test_narrow_tiles_give_every_row_the_bits_of_float32_tiles(n, k, dtype):
    """Same values, half the bytes: at every row count (each register tile shape, the spread and the few-row
    requests), one thread or two, with a bias, bfloat16 and float16 tiles' outputs equal the float32 tiles' bit for
    bit."""
    w, b = _bfloat16_valued(n, k, seed=n + k, dtype=dtype), torch.randn(n, generator=torch.Generator().manual_seed(k))
    x = torch.randn(100, k, generator=torch.Generator().manual_seed(n))
    f32, bf16, threads = pack_rows([w]), pack_rows([w], dtype=dtype), torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (*range(1, 18), 24, 32, 40, 41, 64, 100):
                expected = packed_linear(x[:rows], f32, pad_bias(b), n)
                assert torch.equal(packed_linear(x[:rows], bf16, pad_bias(b), n), expected), (count, rows)
            torch.testing.assert_close(expected, x.double().mm(w.double().T).add(b.double()).float(),
                                       rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(threads)


@needs_packed
def test_a_narrow_checkpoint_is_held_in_tiles_of_its_type_in_half_the_bytes(tiny_llama, tiny_llama_bf16, tmp_path):
    """A bfloat16 or float16 checkpoint's every linear is held in tiles of that type (half the float32 checkpoint's
    packed bytes), while float32 values neither holds stay float32."""
    tiny_f16 = write_checkpoint(tmp_path / "tiny-f16", preset_config("tiny"), dtype="float16")
    held = {}
    for name, path in (("float32", tiny_llama), ("bfloat16", tiny_llama_bf16), ("float16", tiny_f16)):
        station = Station(path, StationSpec(layers=(0, 6)))
        weights = [m.weight for m in station.model.modules() if isinstance(m, Linear) and m.weight_layout == "packed"]
        assert weights and {w.dtype for w in weights} == {getattr(torch, name)}, name
        held[name] = sum(w.numel() * w.element_size() for w in weights)
    assert held["bfloat16"] * 2 == held["float16"] * 2 == held["float32"]


@needs_packed
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_narrow_checkpoints_matrices_skip_the_float32_cast_with_the_same_tiles_and_logits(tmp_path, monkeypatch,
                                                                                          dtype, arch):
    """For the packed backend the loader keeps a bfloat16 (float16) file's linear matrices in their type, so that
    they are packed as they are (no float32 copy, no look at every value); the embedding, the norms, the biases and a
    head tied to the embedding are cast to float32 as before. The station holds the tiles, hence gives the logits,
    of a load that casts everything to float32 first, bit for bit."""
    from mesh.core.model import loader

    cfg = preset_config("tiny", arch)
    path = write_checkpoint(tmp_path / f"tiny-{arch}", cfg, dtype=dtype)
    narrow = getattr(torch, dtype)
    model, _ = load_range(path, cfg, 0, cfg.num_hidden_layers, for_packed=True)
    linear_weights = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, Linear)}
    for name, p in model.named_parameters():
        tied = name == "lm_head.weight" and cfg.tie_word_embeddings
        assert p.dtype == (narrow if name in linear_weights and not tied else torch.float32), name
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # one float32 tensor
    plain, _ = load_range(path, cfg, 0, cfg.num_hidden_layers)  # another backend's load: everything float32
    assert {p.dtype for p in plain.parameters()} == {torch.float32}

    ids = torch.tensor([1, 17, 300, 45, 99, 7])
    wave = (WaveEntry(0, 0, len(ids), SamplingParams(max_tokens=4)),)
    held, logits = [], []
    for cast_first in (False, True):
        if cast_first:
            monkeypatch.setattr(loader, "NARROW_DTYPES", ())  # the load before: float32 first, narrowed when packed
        station = Station(path, StationSpec(layers=(0, cfg.num_hidden_layers)))
        held.append([m.weight for m in station.model.modules()
                     if isinstance(m, Linear) and m.weight_layout == "packed"])
        logits.append(station.forward(wave, token_ids=ids, want_logits=True).logits)
    assert len(held[0]) == len(held[1]) and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(*held))
    assert {w.dtype for w in held[0]} == {narrow}
    assert torch.equal(logits[0], logits[1])


def test_a_synthetic_checkpoint_is_written_in_the_dtype_asked_for(tiny_llama_bf16, tmp_path):
    """`mesh init-model --dtype bfloat16` stores bfloat16 tensors and says so in config.json; an unknown dtype is
    refused by name before anything is written."""
    import json

    from safetensors import safe_open

    with safe_open(tiny_llama_bf16 / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((tiny_llama_bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="dtype: unknown 'float64'"):
        write_checkpoint(tmp_path / "x", preset_config("tiny"), dtype="float64")
    assert not (tmp_path / "x").exists()


@needs_packed
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_narrow_gguf_of_a_narrow_checkpoint_gives_its_station_the_same_tiles_and_logits(tmp_path, dtype):
    """A bfloat16 (float16) checkpoint written as a BF16 (F16) GGUF (what llama.cpp runs in `mesh bench vs_llamacpp
    --model bench-bf16`) loads into tiles of that type holding the same values, its matrices kept in the file's type
    (q/k rows put back in Hugging Face's order): the same logits bit for bit. (Plain RoPE: a GGUF carries no llama3
    scaling.)"""
    from gguf import GGMLQuantizationType

    from mesh.core.model.gguf_write import write_gguf

    qtype = GGMLQuantizationType.BF16 if dtype == "bfloat16" else GGMLQuantizationType.F16

    cfg = ModelConfig(arch="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                      rope_theta=10000.0, max_position_embeddings=256)
    hf_dir = write_checkpoint(tmp_path / "tiny", cfg, dtype=dtype)
    gguf = write_gguf(hf_dir, tmp_path / "tiny.gguf", qtype)
    model, _ = load_range(gguf, cfg, 0, cfg.num_hidden_layers, for_packed=True)  # the file's F16 / BF16 kept so
    linear_weights = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, Linear)}
    assert {n: p.dtype for n, p in model.named_parameters() if n in linear_weights} == {
        n: getattr(torch, dtype) for n in linear_weights}
    assert model.model.embed_tokens.weight.dtype == torch.float32
    ids = torch.tensor([1, 17, 300, 45, 99, 7])
    logits = []
    for source in (hf_dir, gguf):
        station = Station(source, StationSpec(layers=(0, 4)))
        assert station.model.lm_head.weight.dtype == getattr(torch, dtype)
        out = station.forward((WaveEntry(0, 0, len(ids), SamplingParams(max_tokens=4)),), token_ids=ids,
                              want_logits=True)
        logits.append(out.logits)
    assert torch.equal(logits[0], logits[1])
