"""Tests for mesh.core.model.tokenizer_gen: the deterministic synthetic HF tokenizer."""
from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer

from mesh.core.model import tokenizer_gen as tg
from mesh.core.model.byte_level import byte_chars
from mesh.core.model.tokenizer_gen import build_tokenizer, write_tokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog 1234567890.",
    "  leading and trailing spaces, tabs\tand\nnew lines\r\n  ",
    "Crème brûlée, naïve façade, Ærøskøbing, São Paulo, Straße, ñandú",
    "emoji: 👋🏽 🚀🔥 👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵 — done",
    "中文字符 日本語のテキスト 한국어 Ελληνικά русский עברית العربية",
    "code: def f(x):\n    return {'a': [x ** 2, x // 3]}  # comment",
    "",
]


@pytest.fixture(scope="module")
def tok_512() -> Tokenizer:
    return build_tokenizer(512)


@pytest.fixture(scope="module")
def tok_4096() -> Tokenizer:
    return build_tokenizer(4096)


@pytest.fixture(scope="module")
def tok_32000() -> Tokenizer:
    return build_tokenizer(32000)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok4096")
    write_tokenizer(d, 4096, "llama")
    return d


@pytest.fixture(scope="module")
def hf_tok(hf_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(hf_dir))


def _check_vocab(tok: Tokenizer, n: int) -> None:
    assert tok.get_vocab_size(with_added_tokens=True) == n
    assert tok.get_vocab_size(with_added_tokens=False) == n
    vocab = tok.get_vocab(with_added_tokens=True)
    assert len(vocab) == n
    assert sorted(vocab.values()) == list(range(n))
    for i, t in enumerate(tg.SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i
    # every merge is valid: both parts and the result are in the vocab
    model = json.loads(tok.to_str())["model"]
    assert model["type"] == "BPE"
    assert len(model["merges"]) >= n - tg.MIN_VOCAB_SIZE
    for a, b in model["merges"]:
        assert a in vocab and b in vocab and a + b in vocab


@pytest.mark.parametrize("fixture,n", [("tok_512", 512), ("tok_4096", 4096)])
def test_exact_vocab_size(request, fixture, n):
    _check_vocab(request.getfixturevalue(fixture), n)


def test_exact_vocab_size_32000_and_all_ids_decode(tok_32000):
    _check_vocab(tok_32000, 32000)
    for i in range(32000):
        assert tok_32000.id_to_token(i) is not None
        assert isinstance(tok_32000.decode([i], skip_special_tokens=False), str)
    assert tok_32000.id_to_token(32000) is None


def test_all_ids_decode_512(tok_512):
    out = tok_512.decode_batch([[i] for i in range(512)], skip_special_tokens=False)
    assert len(out) == 512 and all(isinstance(s, str) for s in out)
    # specials decode to themselves; single bytes decode to their byte (or U+FFFD)
    assert out[:5] == list(tg.SPECIAL_TOKENS)
    assert out[5 + ord("a")] == "a" and out[5 + ord(" ")] == " "


def test_minimum_vocab_size_has_no_merges():
    tok = build_tokenizer(tg.MIN_VOCAB_SIZE)
    _check_vocab(tok, tg.MIN_VOCAB_SIZE)
    assert json.loads(tok.to_str())["model"]["merges"] == []
    assert tok.decode(tok.encode("héllo 👋").ids, skip_special_tokens=True) == "héllo 👋"


@pytest.mark.parametrize("bad", [0, 100, tg.MIN_VOCAB_SIZE - 1, 4096.0, "4096"])
def test_rejects_bad_vocab_size(bad):
    with pytest.raises(ValueError):
        build_tokenizer(bad)


def test_deterministic(tok_4096, hf_dir):
    """Two builds of one size agree (`hf_dir` wrote its own); test_write_is_byte_identical makes a third."""
    assert (hf_dir / "tokenizer.json").read_text(encoding="utf-8") == tok_4096.to_str(pretty=True)
    assert Tokenizer.from_file(str(hf_dir / "tokenizer.json")).to_str() == tok_4096.to_str()


def test_write_is_byte_identical(tmp_path, hf_dir):
    tg.tokenizer_json.cache_clear()  # a build of its own, not the text `hf_dir` wrote
    write_tokenizer(tmp_path / "again", 4096, "qwen2")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (hf_dir / name).read_bytes()


def test_fallback_merges_fill_vocab_when_corpus_runs_out():
    vocab = {t: i for i, t in enumerate(tg.SPECIAL_TOKENS)}
    for ch in byte_chars():
        vocab[ch] = len(vocab)
    merges = tg._learn_merges([("abc", 3), ("ab", 2)], vocab, 400)
    assert merges[:2] == [("a", "b"), ("ab", "c")]
    assert len(vocab) == 400 and sorted(vocab.values()) == list(range(400))
    for a, b in merges:
        assert a in vocab and b in vocab and a + b in vocab


def test_tie_break_is_lexicographic():
    vocab = {t: i for i, t in enumerate(tg.SPECIAL_TOKENS)}
    for ch in byte_chars():
        vocab[ch] = len(vocab)
    merges = tg._learn_merges([("yz", 5), ("cd", 5), ("ab", 5), ("xx", 1)], vocab,
                              tg.MIN_VOCAB_SIZE + 4)
    assert merges == [("a", "b"), ("c", "d"), ("y", "z"), ("x", "x")]


def _merges_recounted(word_counts, n_merges):
    """Greedy BPE the plain way: every pair counted again before each merge, the best (count, then the smallest
    pair) merged left to right in every word."""
    words = [(list(w), c) for w, c in word_counts]
    merges = []
    for _ in range(n_merges):
        counts = {}
        for syms, c in words:
            for p in zip(syms, syms[1:]):
                counts[p] = counts.get(p, 0) + c
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        merges.append(best)
        for k, (syms, c) in enumerate(words):
            out, j = [], 0
            while j < len(syms):
                if syms[j:j + 2] == list(best):
                    out.append(best[0] + best[1])
                    j += 2
                else:
                    out.append(syms[j])
                    j += 1
            words[k] = (out, c)
    return merges


def test_incremental_counts_merge_as_a_full_recount_does():
    """Runs of one letter (a pair of a symbol with itself overlaps its neighbours), repeats of two, and a token
    reached by two merge orders: the incremental pair counts pick the merges a full recount before each merge picks."""
    rng = random.Random(5)
    words = ["aaaa", "aaa", "abab", "ababab", "baaab", "abcabc", "bcbcb", "cccc", "abc", "ca"]
    words += ["".join(rng.choice("abc") for _ in range(rng.randint(2, 9))) for _ in range(60)]
    word_counts = list({w: 1 + rng.randrange(7) for w in words}.items())
    vocab = {t: i for i, t in enumerate(tg.SPECIAL_TOKENS)}
    for ch in byte_chars():
        vocab[ch] = len(vocab)
    expected = _merges_recounted(word_counts, 40)
    assert len(expected) == 40  # the corpus had pairs left for all of them: no filler below
    assert tg._learn_merges(word_counts, dict(vocab), len(vocab) + 40)[:40] == expected


@pytest.mark.parametrize("fixture", ["tok_512", "tok_4096", "tok_32000"])
@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_tokenizers(request, fixture, text):
    tok = request.getfixturevalue(fixture)
    n = tok.get_vocab_size()
    enc = tok.encode(text)
    assert enc.ids[0] == 1 and enc.ids.count(1) == 1  # bos exactly once
    assert all(0 <= i < n for i in enc.ids)
    assert tok.decode(enc.ids, skip_special_tokens=True) == text
    assert tok.decode(enc.ids[1:], skip_special_tokens=False) == text
    assert tok.encode(text, add_special_tokens=False).ids == enc.ids[1:]


def test_merges_compress_english(tok_32000, tok_512):
    text = TEXTS[0]
    n_bytes = len(text.encode())
    assert len(tok_32000.encode(text, add_special_tokens=False).ids) < 0.6 * n_bytes
    assert len(tok_32000.encode(text).ids) <= len(tok_512.encode(text).ids)


def test_special_tokens_are_atomic(tok_4096):
    ids = tok_4096.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False).ids
    assert ids[0] == 3 and ids[-1] == 4
    assert tok_4096.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_written_files(hf_dir):
    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    assert tok.get_vocab_size() == 4096
    assert tok.encode("hi").ids[0] == 1
    cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == "<s>" and cfg["eos_token"] == "</s>" and cfg["pad_token"] == "<pad>"
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert isinstance(cfg["model_max_length"], int) and cfg["model_max_length"] > 0
    assert "<|im_start|>" in cfg["chat_template"] and "add_generation_prompt" in cfg["chat_template"]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_write_accepts_archs(tmp_path, monkeypatch, tok_512, arch):
    monkeypatch.setattr(tg, "build_tokenizer", lambda n: tok_512)  # skip the rebuild
    write_tokenizer(tmp_path / arch, 512, arch)
    assert (tmp_path / arch / "tokenizer.json").is_file()
    assert (tmp_path / arch / "tokenizer_config.json").is_file()


def test_write_rejects_unknown_arch(tmp_path):
    with pytest.raises(ValueError):
        write_tokenizer(tmp_path, 512, "gpt2")


def test_autotokenizer_bos_once_and_round_trip(hf_tok):
    assert len(hf_tok) == 4096
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (1, 2, 0)
    ids = hf_tok("hi").input_ids
    assert ids[0] == 1 and ids.count(1) == 1 and ids[1] != 1
    for text in TEXTS:
        ids = hf_tok(text).input_ids
        assert ids[0] == 1 and ids.count(1) == 1
        assert all(0 <= i < 4096 for i in ids)
        assert hf_tok.decode(ids, skip_special_tokens=True) == text
    assert hf_tok("hi", add_special_tokens=False).input_ids[0] != 1


def test_autotokenizer_matches_tokenizers(hf_tok, hf_dir):
    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    for text in TEXTS:
        assert hf_tok(text).input_ids == tok.encode(text).ids


def test_autotokenizer_decodes_every_id(hf_tok):
    out = hf_tok.batch_decode([[i] for i in range(4096)])
    assert len(out) == 4096 and all(isinstance(s, str) for s in out)


def test_chat_template(hf_tok):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Again, with émoji 👋"},
    ]
    text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str)
    for m in messages:
        assert f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    no_gen = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_gen == text[: -len("<|im_start|>assistant\n")]
    ids = hf_tok(text, add_special_tokens=False).input_ids
    assert ids.count(3) == 5 and ids.count(4) == 4
    assert hf_tok.decode(ids) == text


def test_byte_alphabet_is_the_byte_level_one():
    """One table serves the writer and the API's logprob bytes: it is the `tokenizers` ByteLevel alphabet."""
    from tokenizers import pre_tokenizers

    from mesh.core.model.byte_level import char_bytes

    chars = byte_chars()
    assert len(set(chars)) == 256 and set(chars) == set(pre_tokenizers.ByteLevel.alphabet())
    assert chars[ord("A")] == "A" and chars[ord(" ")] == "Ġ" and chars[ord("\n")] == "Ċ"
    assert [char_bytes()[c] for c in chars] == list(range(256))
    for text in ("héllo wörld", " \t\n", "日本"):  # the pre-tokenizer spells every byte by this table
        pieces = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(text)
        assert bytes(char_bytes()[c] for p, _ in pieces for c in p) == text.encode()
