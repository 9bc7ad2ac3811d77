"""The tokenizer a GGUF file carries in its `tokenizer.ggml.*` metadata, as a `tokenizers.Tokenizer`.

GPT-2 style byte-level BPE (`tokenizer.ggml.model` = gpt2: SmolLM, Llama 3, Qwen2 and most current
models) is rebuilt from the token list and merges; the pre-tokenizer follows `tokenizer.ggml.pre`,
the split rule llama.cpp names there. Control tokens become special added tokens (matched whole in
text, skipped when decoding with skip_special_tokens); BOS is prepended only when the file says so.
SentencePiece files (`llama`) are refused by `check_tokenizer`, which runs before anything loads.
"""
from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from mesh.core.model.gguf_file import GGUFCheckpoint, GGUFError

TOKENIZER_MODELS = ("gpt2",)
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values of tokens matched whole in text
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def check_tokenizer(ckpt: GGUFCheckpoint) -> None:
    """Refuse a file whose tokenizer cannot be rebuilt (missing, or not byte-level BPE), naming the key."""
    kind = ckpt.meta("tokenizer.ggml.model")
    if kind not in TOKENIZER_MODELS:
        raise GGUFError(f"{ckpt.path}: tokenizer.ggml.model: unsupported tokenizer {kind!r}; "
                        f"supported: {', '.join(TOKENIZER_MODELS)} (byte-level BPE)")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        if not ckpt.meta(key):
            raise GGUFError(f"{ckpt.path}: {key}: missing")


def _pre_tokenizer(pre: str | None):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("llama-bpe", "llama3", "smaug-bpe", "dbrx"):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"), byte_level])
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"), byte_level])
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # GPT-2's split with every digit on its own
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    return gpt2  # gpt2, default and anything unnamed: GPT-2's own split


def tokenizer_from_gguf(ckpt: GGUFCheckpoint) -> Tokenizer:
    """The file's byte-level BPE tokenizer, with its control tokens and (if the file asks) a leading BOS."""
    check_tokenizer(ckpt)
    tokens: list[str] = ckpt.meta("tokenizer.ggml.tokens")
    types: list[int] = ckpt.meta("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in ckpt.meta("tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                               ignore_merges=ckpt.meta("tokenizer.ggml.pre") in ("llama-bpe", "llama3")))
    tok.pre_tokenizer = _pre_tokenizer(ckpt.meta("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types)
                            if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types)
                    if k == USER_DEFINED])
    bos = ckpt.meta("tokenizer.ggml.bos_token_id")
    if ckpt.meta("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]}:0 $A:0", pair=f"{tokens[bos]}:0 $A:0 {tokens[bos]}:1 $B:1",
            special_tokens=[(tokens[bos], bos)])
    return tok


def chat_template(ckpt: GGUFCheckpoint) -> str:
    """The file's `tokenizer.chat_template` ('' when it has none)."""
    return ckpt.meta("tokenizer.chat_template") or ""


def tokenizer_config(ckpt: GGUFCheckpoint) -> dict[str, Any]:
    """A Hugging Face tokenizer_config.json for the file's tokenizer (special tokens, BOS rule, template)."""
    tokens: list[str] = ckpt.meta("tokenizer.ggml.tokens")

    def text(key: str) -> str | None:
        i = ckpt.meta(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": text("bos_token_id"),
            "eos_token": text("eos_token_id"), "pad_token": text("padding_token_id"),
            "unk_token": text("unknown_token_id"),
            "add_bos_token": bool(ckpt.meta("tokenizer.ggml.add_bos_token", False)), "add_eos_token": False,
            "clean_up_tokenization_spaces": False, "chat_template": chat_template(ckpt),
            "model_max_length": int(ckpt.hf_config()["max_position_embeddings"])}
