"""The loader reads only a station's own tensors, and refuses bad checkpoints by name."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from mesh.core.config import ConfigError, ModelConfig, StationSpec
from mesh.core.model.loader import CheckpointError, load_range
from station.step import Station


def _layer_of(key):
    parts = key.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] else None


@pytest.mark.parametrize("fixture", ["tiny_llama", "sharded_llama"])
def test_station_reads_only_its_range(request, fixture):
    model_dir = request.getfixturevalue(fixture)
    cfg = ModelConfig.from_dir(model_dir)
    _, mid = load_range(model_dir, cfg, 2, 4)
    assert mid.keys_read and all(_layer_of(k) in (2, 3) for k in mid.keys_read)
    _, head = load_range(model_dir, cfg, 3, 6)
    assert "lm_head.weight" in head.keys_read and "model.norm.weight" in head.keys_read
    assert "model.embed_tokens.weight" not in head.keys_read
    _, tail = load_range(model_dir, cfg, 0, 2)
    assert "model.embed_tokens.weight" in tail.keys_read and "lm_head.weight" not in tail.keys_read


def test_half_station_holds_about_half_the_layer_weights(tiny_llama):
    cfg = ModelConfig.from_dir(tiny_llama)
    as_loaded = {"linear_backend": "aten"}  # the weights as read (packed kernels re-lay and pad them afterwards)
    full = Station(tiny_llama, StationSpec(layers=(0, 6), **as_loaded))
    lower = Station(tiny_llama, StationSpec(layers=(0, 3), **as_loaded))
    upper = Station(tiny_llama, StationSpec(layers=(3, 6), **as_loaded))
    resident = lambda st: sum(p.numel() * p.element_size() for p in st.model.parameters())  # noqa: E731
    assert resident(lower) + resident(upper) == resident(full)
    embed = cfg.vocab_size * cfg.hidden_size * 4
    layers_half = (resident(full) - 2 * embed) / 2
    assert resident(lower) == pytest.approx(layers_half + embed, rel=0.01)
    assert lower.load_report.weight_bytes == resident(lower)


def test_tied_head_reads_the_embedding(model_dirs):
    cfg = ModelConfig.from_dir(model_dirs["qwen2"])
    _, rep = load_range(model_dirs["qwen2"], cfg, 5, 6)
    assert rep.keys_read.count("model.embed_tokens.weight") == 1 and "lm_head.weight" not in rep.keys_read


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture_is_named(tiny_llama, tmp_path):
    d = _copy(tiny_llama, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unsupported architecture 'gpt2'"):
        Station(d, StationSpec(layers=(0, 6)))


def test_missing_and_misshaped_tensors_are_named(tiny_llama, tmp_path):
    d = _copy(tiny_llama, tmp_path / "m")
    state = load_file(d / "model.safetensors")
    missing = dict(state)
    del missing["model.layers.4.mlp.up_proj.weight"]
    save_file(missing, d / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.layers.4.mlp.up_proj.weight"):
        Station(d, StationSpec(layers=(3, 6)))
    Station(d, StationSpec(layers=(0, 3)))  # a station not needing it loads fine
    bad = dict(state)
    bad["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(5, 5)
    save_file(bad, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"k_proj.weight has shape \[5, 5\], expected \[32, 64\]"):
        Station(d, StationSpec(layers=(0, 2)))


def test_missing_checkpoint_and_range_errors(tiny_llama, tmp_path):
    (tmp_path / "config.json").write_text((tiny_llama / "config.json").read_text())
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        Station(tmp_path, StationSpec(layers=(0, 6)))
    with pytest.raises(ConfigError, match="exceeds the model's 6 layers"):
        Station(tiny_llama, StationSpec(layers=(2, 9)))
    with pytest.raises(ConfigError, match="no config.json"):
        Station(tmp_path / "nowhere", StationSpec(layers=(0, 1)))


def test_building_the_embedding_does_not_import_the_compiler(tiny_llama):
    """nn.Embedding's random initialization on meta imports torch._dynamo (seconds of a fresh station's start)."""
    code = ("import sys, torch\n"
            "from mesh.core.config import ModelConfig\n"
            "from mesh.core.model.llama import LlamaRange\n"
            f"cfg = ModelConfig.from_dir({str(tiny_llama)!r})\n"
            "with torch.device('meta'):\n"
            "    LlamaRange(cfg, 0, cfg.num_hidden_layers)\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
