"""A row's bits do not depend on its wave: the same logits, bit for bit, alone, among other
sequences of any length and count, and at another thread count (the batch-invariant CPU path)."""
from __future__ import annotations

import pytest
import torch

from mesh.core.config import StationSpec
from mesh.core.model.kernels import BATCH_INVARIANT_BACKENDS, resolve_linear_backend
from mesh.core.params import SamplingParams
from mesh.core.wave import WaveEntry
from mesh.core.compute import on_compute_thread
from station.step import Station

GREEDY = SamplingParams(max_tokens=64, temperature=0.0)
STEPS = 24


def _ids(seed: int, n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _logits_of_seq0(station: Station, company: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    """Sequence 0 (a 37-token prompt, then STEPS decode steps) with `company`: (seq_id, prompt length,
    wave it joins). Returns sequence 0's logits at every wave."""
    vocab = station.config.vocab_size
    tokens = {0: _ids(7, 37, vocab), **{sid: _ids(sid, n, vocab) for sid, n, _ in company}}
    length = {0: 0}
    logits = []
    for wave in range(STEPS + 1):
        entries, ids = [], []
        for sid, n, joins in [(0, 37, 0)] + company:
            if wave == joins:
                entries.append(WaveEntry(sid, 0, n, GREEDY))
                ids += tokens[sid]
                length[sid] = n
            elif wave > joins:
                entries.append(WaveEntry(sid, length[sid], 1, GREEDY))
                ids.append(tokens[sid][-1])
                length[sid] += 1
        out = station.forward(tuple(entries), token_ids=torch.tensor(ids), want_logits=True)
        for e, s in zip(entries, out.samples):
            tokens[e.seq_id].append(s.token_id)
        logits.append(out.logits[0].clone())
    station.release(list(length))
    return logits


@pytest.fixture(scope="module")
def station(tiny_llama):
    if resolve_linear_backend("auto", torch.device("cpu"), torch.float32) not in BATCH_INVARIANT_BACKENDS:
        pytest.skip("neither the packed kernel nor oneDNN runs row-count invariant here: F.linear is used "
                    "(exact to 1e-4 only)")
    return Station(tiny_llama, StationSpec(layers=(0, 6)))


@pytest.mark.parametrize("company", [
    [(1, 5, 0)],  # a short prompt in the same first wave
    [(1, 100, 3), (2, 3, 0), (3, 250, 10)],  # long prompts arriving mid-decode
    [(i, 10 * i, i % 5) for i in range(1, 16)],  # 15 others: decode groups of many block counts
], ids=["one", "three", "fifteen"])
def test_logits_are_bitwise_the_same_in_any_company(station, company):
    alone = _logits_of_seq0(station, [])
    batched = _logits_of_seq0(station, company)
    differ = [i for i, (a, b) in enumerate(zip(alone, batched)) if not torch.equal(a, b)]
    assert differ == [], f"waves whose logits differ from the run alone: {differ}"
    assert station.stats().kv.sequences == 0


def test_logits_are_bitwise_the_same_at_another_thread_count(station):
    threads = on_compute_thread(torch.get_num_threads)  # the station computes on this process's compute thread
    company = [(1, 20, 0), (2, 60, 4)]
    reference = _logits_of_seq0(station, company)
    other = 1 if threads > 1 else 2
    on_compute_thread(torch.set_num_threads, other)
    try:
        assert on_compute_thread(torch.get_num_threads) == other
        again = _logits_of_seq0(station, company)
    finally:
        on_compute_thread(torch.set_num_threads, threads)
    differ = [i for i, (a, b) in enumerate(zip(reference, again)) if not torch.equal(a, b)]
    assert differ == [], f"waves whose logits differ between {threads} and {other} threads: {differ}"


@pytest.mark.parametrize("chunks", [(13, 20, 7), (1, 38, 1), (16, 16, 8)], ids=["uneven", "ones", "blocks"])
def test_a_prompt_in_chunks_gives_the_bits_of_one_prefill(station, chunks):
    """With the native kernels a row's result does not depend on where its prompt's chunks began: the same
    logits, bit for bit, at the last prompt row and at every decode step after it (what an exact prefix cache
    and a replay in other chunk sizes rely on)."""
    if station.linear_backend != "packed":
        pytest.skip("chunk invariance is a property of the native float32 kernels, not used here")
    prompt = _ids(11, sum(chunks), station.config.vocab_size)
    one = station.forward((WaveEntry(0, 0, len(prompt), GREEDY),), token_ids=torch.tensor(prompt), want_logits=True)
    start = 0
    for i, n in enumerate(chunks):
        last = i == len(chunks) - 1
        split = station.forward((WaveEntry(1, start, n, GREEDY if last else None),),
                                token_ids=torch.tensor(prompt[start:start + n]), want_logits=last)
        start += n
    assert torch.equal(one.logits[0], split.logits[0])
    tokens = [one.samples[0].token_id, split.samples[0].token_id]
    for step in range(4):  # both sequences decode side by side in one wave
        pos = len(prompt) + step
        out = station.forward((WaveEntry(0, pos, 1, GREEDY), WaveEntry(1, pos, 1, GREEDY)),
                              token_ids=torch.tensor(tokens), want_logits=True)
        assert torch.equal(out.logits[0], out.logits[1]), f"decode step {step} differs"
        tokens = [s.token_id for s in out.samples]
    station.release([0, 1])
