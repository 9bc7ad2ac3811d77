"""Incremental detokenization gives what decoding the whole output gives: the same text, the same stop.

Checked on the project's byte-level BPE tokenizer and on a SentencePiece-style one (Metaspace decoder,
byte fallback), the two families Llama-style checkpoints ship, with random token sequences that split
multi-byte characters and include special tokens."""
from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models

from mesh.core.model.tokenizer_gen import build_tokenizer
from orchestrator.stream import TextTracker


def _metaspace_tokenizer() -> Tokenizer:
    """A small SentencePiece-style vocabulary: ▁-prefixed words, pieces, <0xNN> byte tokens."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁the", "▁cat", "▁sat", "▁on", "▁mat", "▁é", "s", "ing", "▁", "ed", "▁naïve", "▁日本", "語", "!"]
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], byte_fallback=True,
                               unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return tok


TOKENIZERS = {"byte-level": lambda: build_tokenizer(512), "metaspace": _metaspace_tokenizer}


def _track(tok: Tokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[str, int | None]:
    """The text handed out, and how many tokens were taken when a stop string matched (None: none did)."""
    tracker = TextTracker(tok, stop)
    out = []
    for n, i in enumerate(ids, 1):
        delta, stopped = tracker.add(i)
        out.append(delta)
        if stopped:
            return "".join(out), n
    return "".join(out) + tracker.flush(), None


def _reference(tok: Tokenizer, ids: list[int], stop: tuple[str, ...]) -> tuple[str, int | None]:
    """The specification: decode the whole output after every token, hand out what is new up to its
    last whole character (less what could still start a stop string), stop at the first stop string."""
    hold, sent, out = max((len(s) for s in stop), default=1) - 1, 0, []
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n], skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in stop) if i >= 0]
        if hits:
            out.append(text[sent:min(hits)])
            return "".join(out), n
        safe = len(text.rstrip("\ufffd")) - hold
        if safe > sent:
            out.append(text[sent:safe])
            sent = safe
    return "".join(out) + tok.decode(ids, skip_special_tokens=True)[sent:], None


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_text_of_real_strings_equals_their_whole_decode(name):
    tok = TOKENIZERS[name]()
    rng = random.Random(5)
    words = ["the", "cat", "sat", " on", "naïve", "日本語", "é", "!", "\n", "  ", "ing", "😀", "ñ", "mat", "ed"]
    for _ in range(200):
        ids = tok.encode("".join(rng.choice(words) for _ in range(rng.randrange(1, 30)))).ids
        assert _track(tok, ids)[0] == tok.decode(ids, skip_special_tokens=True), ids


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_random_tokens_stream_as_decoding_everything_each_time_would(name):
    # random ids split characters and make invalid byte runs (whose U+FFFD can reach back over earlier
    # bytes): the stream must still be what decoding the whole output after every token hands out
    tok = TOKENIZERS[name]()
    vocab = tok.get_vocab_size()
    rng = random.Random(7)
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        assert _track(tok, ids) == _reference(tok, ids, ()), ids


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_stop_strings_end_the_text_where_the_whole_decode_finds_them(name):
    tok = TOKENIZERS[name]()
    vocab = tok.get_vocab_size()
    rng = random.Random(11)
    stopped = 0
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        text = tok.decode(ids, skip_special_tokens=True)
        # a stop string taken from the text itself (so it does occur), and one that never does
        start = rng.randrange(max(1, len(text) - 2))
        stop = (text[start:start + rng.randrange(1, 4)].replace("\ufffd", "") or "x", "\x00never")
        got, ref = _track(tok, ids, stop), _reference(tok, ids, stop)
        assert got == ref, (ids, stop)
        stopped += ref[1] is not None
    assert stopped > 50  # the cases above really stop


def test_a_long_output_decodes_a_window_per_token():
    tok = build_tokenizer(512)

    class Counting:  # counts the tokens handed to decode
        decoded = 0

        def decode(self, ids, skip_special_tokens):
            Counting.decoded += len(ids)
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    rng = random.Random(3)
    ids = [rng.randrange(300, 512) for _ in range(2000)]  # merged pieces: whole characters
    assert _track(Counting(), ids)[0] == tok.decode(ids, skip_special_tokens=True)
    assert Counting.decoded < 20 * len(ids)  # the whole output every time would be ~2,000,000
