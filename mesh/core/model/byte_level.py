"""The byte-level BPE alphabet (GPT-2's): each of the 256 bytes spelled as one printable character.

Byte-level tokenizers (GPT-2, Llama 3, Qwen2, this project's synthetic one) spell a token's bytes in
these characters (`Ġ` is the space byte). The tokenizer writer builds its base vocabulary from them;
the OpenAI surface reads them back to recover a token's raw bytes for logprobs. No torch here.
"""
from __future__ import annotations

from functools import lru_cache

# bytes that stand for themselves: printable ASCII and printable Latin-1 (no space, no soft hyphen)
_SELF_SPELLED = frozenset((*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)))


@lru_cache(maxsize=1)
def byte_chars() -> tuple[str, ...]:
    """Byte b -> its character: chr(b) when it stands for itself, else chr(256 + k) for the k-th other byte."""
    others = [b for b in range(256) if b not in _SELF_SPELLED]
    shifted = {b: chr(256 + k) for k, b in enumerate(others)}
    return tuple(chr(b) if b in _SELF_SPELLED else shifted[b] for b in range(256))


@lru_cache(maxsize=1)
def char_bytes() -> dict[str, int]:
    """Character -> byte: the inverse of `byte_chars` (treat as read-only: it is shared)."""
    return {ch: b for b, ch in enumerate(byte_chars())}
