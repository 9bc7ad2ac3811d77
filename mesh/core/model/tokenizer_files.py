"""A checkpoint's tokenizer and chat template, from a Hugging Face directory or a GGUF file.

A directory keeps its tokenizer in tokenizer.json and its chat template in `chat_template.jinja`
(transformers >= 4.50 saves it there) or, in older checkpoints, under `chat_template` in
tokenizer_config.json (a string, or a list of named templates: the one named "default"). A GGUF file
keeps both in its metadata (mesh.core.model.gguf_tokenizer). No torch here.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from mesh.core.model.gguf_file import GGUFCheckpoint, is_gguf
from mesh.core.model.gguf_tokenizer import chat_template as gguf_chat_template
from mesh.core.model.gguf_tokenizer import tokenizer_from_gguf


class TokenizerFileError(ValueError):
    """A checkpoint's tokenizer or chat template file is missing or unreadable."""


def load_tokenizer(model_path: str | Path) -> Tokenizer:
    """The checkpoint's tokenizer: tokenizer.json of a directory, or the metadata of a .gguf file."""
    p = Path(model_path)
    if is_gguf(p):
        return tokenizer_from_gguf(GGUFCheckpoint(p))
    f = p / "tokenizer.json"
    if not f.is_file():
        raise TokenizerFileError(f"{p}: no tokenizer.json")
    return Tokenizer.from_file(str(f))


def chat_template(model_path: str | Path) -> str:
    """The checkpoint's chat template ('' when it has none)."""
    p = Path(model_path)
    if is_gguf(p):
        return gguf_chat_template(GGUFCheckpoint(p))
    jinja = p / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    cfg = p / "tokenizer_config.json"
    if not cfg.is_file():
        return ""
    try:
        template = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template")
    except (json.JSONDecodeError, AttributeError) as e:
        raise TokenizerFileError(f"{cfg}: not a JSON object: {e}") from None
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else ""
