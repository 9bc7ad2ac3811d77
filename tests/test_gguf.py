"""GGUF checkpoints: the greedy tokens of transformers on the same file, per-station reads, clear refusals."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quant_shape_to_byte_shape

from mesh.core.config import ConfigError, ModelConfig, StationSpec
from mesh.core.model.gguf_file import GGUFCheckpoint, GGUFError, unpermute_rows
from mesh.core.model.gguf_write import permute_rows, write_gguf
from mesh.core.model.loader import load_range
from mesh.core.model.synthetic import write_checkpoint
from mesh.core.model.tokenizer_files import chat_template, load_tokenizer
from mesh.core.params import SamplingParams
from station.generate import generate_one
from station.step import Station

PROMPT = [1, 17, 300, 45, 99, 7, 250, 11, 64, 3]
STEPS = 24
# plain RoPE (llama.cpp keeps llama3 scaling in a tensor transformers does not read), GQA, untied head;
# every matrix row a multiple of 32 so Q8_0 blocks fit
CFG = ModelConfig(arch="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                  rope_theta=10000.0, max_position_embeddings=1024)
TYPES = {"f32": Q.F32, "f16": Q.F16, "q8_0": Q.Q8_0, "q4_1": Q.Q4_1}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A small random HF checkpoint (safetensors) the GGUF files are written from."""
    return write_checkpoint(tmp_path_factory.mktemp("gguf-src") / "tiny", CFG)


@pytest.fixture(scope="module")
def gguf_files(hf_dir, tmp_path_factory):
    """{kind: path} of the checkpoint written as GGUF in float32, float16 and Q8_0."""
    root = tmp_path_factory.mktemp("gguf")
    return {kind: write_gguf(hf_dir, root / f"tiny-{kind}.gguf", qtype) for kind, qtype in TYPES.items()}


def _layer_of(key):
    parts = key.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] else None


@pytest.mark.parametrize("kind", list(TYPES))
def test_greedy_tokens_match_transformers_on_one_and_three_stations(gguf_files, kind):
    transformers = pytest.importorskip("transformers")
    path = gguf_files[kind]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=STEPS, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    greedy = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    one = Station(path, StationSpec(layers=(0, 6)))
    ours, _ = generate_one(one, PROMPT, greedy)
    chain = [Station(path, StationSpec(layers=r)) for r in ((0, 2), (2, 5), (5, 6))]
    chained, _ = generate_one(chain, PROMPT, greedy)
    assert ours == ref and chained == ref
    assert len(set(ours)) > 4, f"greedy output collapsed: {ours}"
    for st, want in zip(chain, ((0, 1), (2, 3, 4), (5,))):  # each station read only its own tensors
        layers = {_layer_of(k) for k in st.load_report.keys_read} - {None}
        assert layers == set(want)
    keys = [st.load_report.keys_read for st in chain]
    assert "model.embed_tokens.weight" in keys[0] and "lm_head.weight" not in keys[0]
    assert not any(_layer_of(k) is None for k in keys[1])
    assert "lm_head.weight" in keys[2] and "model.norm.weight" in keys[2] and "model.embed_tokens.weight" not in keys[2]


def test_dequantized_weights_are_the_checkpoint_in_hf_layout(hf_dir, gguf_files):
    from safetensors.torch import load_file

    state = load_file(hf_dir / "model.safetensors")
    model, report = load_range(gguf_files["f32"], CFG, 2, 4)
    assert report.keys_read and all(_layer_of(k) in (2, 3) for k in report.keys_read)
    for name, p in model.state_dict().items():
        assert torch.equal(p, state[name]), name  # q/k rows back in HF order, bit for bit
    q8, _ = load_range(gguf_files["q8_0"], CFG, 2, 4, dtype="bfloat16")
    w = q8.state_dict()["model.layers.2.self_attn.q_proj.weight"]
    assert w.dtype == torch.bfloat16 and (w.float() - state["model.layers.2.self_attn.q_proj.weight"]).abs().max() < 0.02
    x = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    assert np.array_equal(unpermute_rows(permute_rows(x, 8), 8), x) and not np.array_equal(permute_rows(x, 8), x)


def test_tokenizer_and_chat_template_come_from_the_metadata(hf_dir, gguf_files):
    ours, ref = load_tokenizer(gguf_files["q8_0"]), load_tokenizer(hf_dir)
    for text in ("Hello world", "The river ran slowly, 42 times!", "<|im_start|>user\nhi<|im_end|>\n", "héllo ☃"):
        assert ours.encode(text).ids == ref.encode(text).ids, text
    ids = ref.encode("a short sentence").ids
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert chat_template(gguf_files["q8_0"]) == chat_template(hf_dir) != ""
    cfg = ModelConfig.from_dir(gguf_files["f16"])
    assert cfg == CFG  # shape, eps, theta, bos/eos and the untied head, read back from the metadata


def test_tied_head_reads_the_embedding(tmp_path):
    from dataclasses import replace

    src = write_checkpoint(tmp_path / "tied", replace(CFG, tie_word_embeddings=True))
    path = write_gguf(src, tmp_path / "tied.gguf", Q.F16)
    cfg = ModelConfig.from_dir(path)
    assert cfg.tie_word_embeddings
    _, rep = load_range(path, cfg, 5, 6)
    assert rep.keys_read.count("model.embed_tokens.weight") == 1 and "lm_head.weight" not in rep.keys_read


def test_hf_directory_template_file_and_generation_config_eos(hf_dir, tmp_path):
    d = shutil.copytree(hf_dir, tmp_path / "m")
    (d / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert chat_template(d) == "{{ messages[0]['content'] }}"  # beside the tokenizer wins over tokenizer_config
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4]}))
    assert ModelConfig.from_dir(d).eos_token_ids == (2, 4)


# ---- refusals: one clear error, nothing started -------------------------------------------------

def _unsupported_type(src, path):
    """The Q8_0 file with one tensor's type rewritten to Q8_1 (same shape, its byte size)."""
    import gguf

    reader = GGUFCheckpoint(src).reader
    writer = gguf.GGUFWriter(path, "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.name == "blk.3.ffn_up.weight":
            shape = tuple(int(x) for x in reversed(t.shape))
            writer.add_tensor(t.name, np.zeros(quant_shape_to_byte_shape(shape, Q.Q8_1), np.uint8), raw_dtype=Q.Q8_1)
        else:
            writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def bad_files(hf_dir, gguf_files, tmp_path_factory):
    """{case: (path, what the error must say)}."""
    root = tmp_path_factory.mktemp("bad")
    cut = root / "cut.gguf"
    data = gguf_files["f16"].read_bytes()
    cut.write_bytes(data[:int(len(data) * 0.6)])
    arch = write_gguf(hf_dir, root / "gpt2.gguf", Q.F16, arch="gpt2")
    qtype = _unsupported_type(gguf_files["q8_0"], root / "q81.gguf")
    return {"truncated": (cut, r"cut\.gguf: .*truncated"),
            "architecture": (arch, r"gpt2\.gguf: general\.architecture: unsupported architecture 'gpt2'"),
            "tensor type": (qtype, r"q81\.gguf: tensor blk\.3\.ffn_up\.weight: unsupported tensor type Q8_1")}


@pytest.mark.parametrize("case", ["truncated", "architecture", "tensor type"])
def test_bad_files_are_refused_before_anything_starts(bad_files, case, tmp_path, capsys):
    from mesh.control.cli import main

    path, pattern = bad_files[case]
    with pytest.raises(GGUFError, match=pattern):
        GGUFCheckpoint(path)
    with pytest.raises(ConfigError, match=pattern):
        Station(path, StationSpec(layers=(0, 6)))
    yaml_path = tmp_path / "mesh.yaml"
    yaml_path.write_text(f"model: {{path: {path}}}\nstations: {{count: 2}}\n")
    assert main(["up", str(yaml_path), "--port", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and pytest.importorskip("re").search(pattern, err[0]), err
    ray = pytest.importorskip("ray")
    assert not ray.is_initialized()  # nothing started
