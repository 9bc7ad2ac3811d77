"""Deterministic byte-level BPE tokenizer for synthetic checkpoints.

The project writes Hugging Face checkpoints with random weights; they still need
a real tokenizer that `tokenizers.Tokenizer.from_file` and
`transformers.AutoTokenizer.from_pretrained` both load, covering exactly
`vocab_size` ids. Nothing is downloaded and nothing is cached on disk: the merges
are learned here, from a built-in corpus, by a small greedy BPE whose ties are
broken lexicographically, so the same `vocab_size` always gives a byte-identical
tokenizer.json (independent of PYTHONHASHSEED).

Layout of the ids:
    0 <pad>, 1 <s> (bos), 2 </s> (eos), 3 <|im_start|>, 4 <|im_end|>
    5 .. 260                the 256 byte-level symbols (GPT-2 byte->unicode map)
    261 .. vocab_size - 1   merged tokens, in merge order

Byte-level pre-tokenizer and decoder mean any UTF-8 text round-trips and there
is no unknown token. The post-processor prepends one `<s>`.
"""
from __future__ import annotations

import functools
import heapq
import json
import random
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from mesh.core.config import SUPPORTED_ARCHS
from mesh.core.model.byte_level import byte_chars

PAD, BOS, EOS, IM_START, IM_END = "<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, IM_START, IM_END)  # ids 0..4
N_BYTES = 256
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + N_BYTES  # 261: specials + bytes, no merges
MODEL_MAX_LENGTH = 8192

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A few paragraphs of plain English, written for this file. Weighted heavily so
# that common English words get merged first.
_ENGLISH = """\
The river ran slowly through the valley, carrying leaves and small branches past
the old mill. In the morning the water was cold and clear; by the afternoon it had
turned brown with the rain that fell on the hills. People in the town said that the
river had always been there, and that it would be there long after they were gone.

A computer program is a list of instructions that a machine can follow. Some programs
are short and simple, while others contain millions of lines written by many people
over many years. When a program works, nobody thinks about it. When it fails, everyone
wants to know why, and the answer is usually hidden in a place that no one looked.

She opened the window and listened. There were birds in the garden, a dog barking
somewhere down the street, and the quiet sound of a car moving along the road. It was
going to be a good day, she thought, if only the train would arrive on time and the
meeting would not last for more than an hour.

Numbers are everywhere: 1, 2, 3, 10, 42, 100, 2024 and 3.14159. We count apples and
stars, we measure distance in meters and time in seconds, and we pay for things with
money that is, in the end, just another kind of number. "What is the answer?" he asked.
"It depends on the question," she said (and smiled).

Learning a new language takes patience. At first every sentence is a puzzle, and every
word must be found in a dictionary. Later the words begin to connect, the grammar makes
sense, and one day you notice that you have been thinking in the new language without
trying. That is the moment when learning becomes understanding.
"""

_ONSETS = ("", "", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t",
           "v", "w", "z", "br", "cr", "dr", "fr", "gr", "pr", "tr", "st", "sp", "sk", "sl",
           "pl", "bl", "cl", "fl", "gl", "ch", "sh", "th", "wh", "qu")
_VOWELS = ("a", "e", "i", "o", "u", "y", "ai", "ea", "ee", "ie", "oa", "oo", "ou", "au")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "rd", "nt", "x",
          "sh", "ll", "ss", "ght")


def _synthetic_text(n_words: int, seed: int = 0) -> str:
    """Pseudo-words built from syllables; a Zipf-like mix of frequent and rare ones."""
    rng = random.Random(seed)
    lexicon: list[str] = []
    seen: set[str] = set()
    while len(lexicon) < n_words:
        w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                    for _ in range(rng.randint(1, 4)))
        if rng.random() < 0.1:
            w = w.capitalize()
        if w not in seen:
            seen.add(w)
            lexicon.append(w)
    out: list[str] = []
    for rank, w in enumerate(lexicon):
        out.extend([w] * max(1, 400 // (rank + 1)))
    return " " + " ".join(out)


def _corpus_word_counts() -> list[tuple[str, int]]:
    """Pre-tokenized corpus pieces (byte-level strings) with counts, in first-seen order."""
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    counts: dict[str, int] = {}
    for text, weight in ((_ENGLISH, 50), (_synthetic_text(40000), 1)):
        for piece, _ in pre.pre_tokenize_str(text):
            counts[piece] = counts.get(piece, 0) + weight
    return list(counts.items())


def _merge_word(syms: list[str], a: str, b: str, new: str) -> tuple[list[str], list[int]] | None:
    """`syms` with each (a, b) merged into `new` left to right, and the positions of the merged symbols in the
    result; None when the word holds no (a, b)."""
    out: list[str] = []
    merged: list[int] = []
    j = 0
    while True:
        try:
            k = syms.index(a, j)
        except ValueError:
            break
        if k + 1 < len(syms) and syms[k + 1] == b:
            out.extend(syms[j:k])
            merged.append(len(out))
            out.append(new)
            j = k + 2
        else:
            out.extend(syms[j:k + 1])
            j = k + 1
    if not merged:
        return None
    out.extend(syms[j:])
    return out, merged


def _learn_merges(word_counts: list[tuple[str, int]], vocab: dict[str, int],
                  vocab_size: int) -> list[tuple[str, str]]:
    """Greedy BPE until `vocab` holds `vocab_size` entries; mutates `vocab`.

    The most frequent adjacent pair is merged first, ties going to the
    lexicographically smallest (left, right). Pair counts are updated
    incrementally (only the pairs beside a merge, in the words holding the merged
    pair, change) and a lazy max-heap finds the best pair. If the corpus runs out
    of pairs, the rest is filled by `_fallback_merges`.
    """
    words = [list(w) for w, _ in word_counts]
    freqs = [c for _, c in word_counts]
    pair_counts: dict[tuple[str, str], int] = {}
    where: dict[tuple[str, str], set[int]] = {}  # the words holding each pair, or that once did (a superset)
    for i, syms in enumerate(words):
        for p in zip(syms, syms[1:]):
            pair_counts[p] = pair_counts.get(p, 0) + freqs[i]
            where.setdefault(p, set()).add(i)
    heap = [(-c, p) for p, c in pair_counts.items()]
    heapq.heapify(heap)
    merges: list[tuple[str, str]] = []

    while len(vocab) < vocab_size and heap:
        neg, pair = heapq.heappop(heap)
        if pair_counts.get(pair) != -neg:
            continue  # stale entry; the current count has its own entry
        a, b = pair
        new = a + b
        merges.append(pair)
        if new not in vocab:
            vocab[new] = len(vocab)
        delta: dict[tuple[str, str], int] = {}
        for i in where.pop(pair):
            syms = words[i]
            got = _merge_word(syms, a, b, new)
            if got is None:
                continue  # an earlier merge took this word's last (a, b)
            out, merged = got
            words[i] = out
            # the r-th merged symbol, at m in `out`, was syms[m + r], syms[m + r + 1]: the pairs starting one
            # before it to one after it in `syms` are gone, the two beside it in `out` are new; the rest is kept
            gone = {j for r, m in enumerate(merged) for j in (m + r - 1, m + r, m + r + 1) if 0 <= j < len(syms) - 1}
            made = {j for m in merged for j in (m - 1, m) if 0 <= j < len(out) - 1}
            for j in gone:
                p = (syms[j], syms[j + 1])
                delta[p] = delta.get(p, 0) - freqs[i]
            for j in made:
                p = (out[j], out[j + 1])
                delta[p] = delta.get(p, 0) + freqs[i]
                where.setdefault(p, set()).add(i)
        for p, d in delta.items():
            if d == 0:
                continue
            c = pair_counts.get(p, 0) + d
            if c > 0:
                pair_counts[p] = c
                heapq.heappush(heap, (-c, p))
            else:
                pair_counts.pop(p, None)
                where.pop(p, None)
        pair_counts.pop(pair, None)

    if len(vocab) < vocab_size:
        merges.extend(_fallback_merges(vocab, vocab_size))
    return merges


def _fallback_merges(vocab: dict[str, int], vocab_size: int) -> list[tuple[str, str]]:
    """Cheap deterministic filler: extend existing tokens (in id order) by a letter."""
    letters = [c for c in "etaoinsrhldcumfpgwybvkxjqz"]
    tokens = [t for t, i in sorted(vocab.items(), key=lambda kv: kv[1])
              if i >= len(SPECIAL_TOKENS)]
    merges: list[tuple[str, str]] = []
    k = 0
    while len(vocab) < vocab_size:
        t = tokens[k]  # `tokens` grows as we go, so this never runs dry
        k += 1
        for c in letters:
            if len(vocab) >= vocab_size:
                break
            if t + c not in vocab:
                vocab[t + c] = len(vocab)
                tokens.append(t + c)
                merges.append((t, c))
    return merges


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer with exactly `vocab_size` ids (deterministic)."""
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be an int >= {MIN_VOCAB_SIZE}, got {vocab_size!r}")
    vocab: dict[str, int] = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for ch in byte_chars():
        vocab[ch] = len(vocab)
    merges = _learn_merges(_corpus_word_counts(), vocab, vocab_size)
    assert len(vocab) == vocab_size, (len(vocab), vocab_size)

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOS}:0 $A:0",
            pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
            special_tokens=[(BOS, vocab[BOS])],
        ),
    ])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False, lstrip=False,
                                       rstrip=False, single_word=False)
                            for t in SPECIAL_TOKENS])
    return tok


@functools.lru_cache(maxsize=4)
def tokenizer_json(vocab_size: int) -> str:
    """tokenizer.json's text for `vocab_size` ids, built once a process: the build takes seconds and gives the same
    text every time (a test run writes dozens of checkpoints of one size)."""
    return build_tokenizer(vocab_size).to_str(pretty=True)


def write_tokenizer(out_dir: str | Path, vocab_size: int, arch: str) -> None:
    """Write tokenizer.json and tokenizer_config.json into `out_dir`.

    `arch` ("llama", "mistral", "qwen2") is validated but does not change the
    output yet; it is the hook for per-architecture chat templates.
    """
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch: unsupported {arch!r} ({', '.join(SUPPORTED_ARCHS)})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tokenizer_json(vocab_size), encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n",
                                               encoding="utf-8")
