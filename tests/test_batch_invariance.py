"""A row's bits do not depend on its wave: the same logits, bit for bit, alone, among other
sequences of any length and count, and at another thread count (the batch-invariant CPU path)."""
from __future__ import annotations

import pytest
import torch

from mesh.core.config import StationSpec
from mesh.core.model.kernels import batch_invariant_linear, pick_linear
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
    if pick_linear("auto", torch.device("cpu"), torch.float32) is not batch_invariant_linear:
        pytest.skip("oneDNN is not row-count invariant in this torch build: F.linear is used (exact to 1e-4 only)")
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
