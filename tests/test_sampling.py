"""Token sampling: what temperature, top-k, top-p and seeds promise, on hand-built logits."""
from __future__ import annotations

import math

import pytest
import torch

from mesh.core.params import SamplingParams
from mesh.core.sampling import _nucleus, sample_tokens

DRAWS = 4000


def _draws(logits: torch.Tensor, params: SamplingParams, n: int = DRAWS) -> list[int]:
    """n draws from one row of logits [V], one per position (each position is its own counter-based draw)."""
    rows = logits[None].expand(n, -1)
    return [s.token_id for s in sample_tokens(rows, [params] * n, list(range(n)))]


def _frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


def _close_to(freq: torch.Tensor, probs: torch.Tensor) -> bool:
    """Every frequency within 4.5 standard errors of its probability (fixed seeds: no flakiness)."""
    se = torch.sqrt(probs * (1 - probs) / DRAWS) + 1e-9
    return bool(((freq - probs).abs() <= 4.5 * se + 1e-3).all())


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])  # token 0 most likely, then 1, 2, ...


def test_greedy_takes_the_argmax():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(0))
    out = sample_tokens(logits, [SamplingParams(max_tokens=1)] * 5, [0] * 5)
    assert [s.token_id for s in out] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_draws_follow_the_softmax(temperature):
    params = SamplingParams(max_tokens=1, temperature=temperature, seed=3)
    freq = _frequencies(_draws(LOGITS, params), len(LOGITS))
    assert _close_to(freq, torch.softmax(LOGITS.double() / temperature, -1))


def test_top_k_keeps_the_k_most_likely_renormalised():
    params = SamplingParams(max_tokens=1, temperature=1.0, top_k=3, seed=11)
    freq = _frequencies(_draws(LOGITS, params), len(LOGITS))
    assert freq[3:].sum() == 0
    assert _close_to(freq[:3], torch.softmax(LOGITS[:3].double(), -1))


def test_top_p_keeps_the_smallest_head_reaching_p():
    probs = torch.softmax(LOGITS.double(), -1)  # 0.53, 0.20, 0.12, 0.07, ...: 0.6 needs tokens 0 and 1
    params = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.6, seed=5)
    freq = _frequencies(_draws(LOGITS, params), len(LOGITS))
    assert set(torch.nonzero(freq).flatten().tolist()) == {0, 1}
    assert _close_to(freq[:2], probs[:2] / probs[:2].sum())


def test_top_p_on_a_flat_vocabulary_reaches_deep_into_it():
    # 3000 equally likely tokens and 29000 unlikely ones: top-p 0.9 keeps ~2700 of the first, none of the rest
    logits = torch.cat([torch.zeros(3000), torch.full((29000,), -30.0)])
    params = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9, seed=9)
    tokens = _draws(logits, params, n=2000)
    assert max(tokens) < 3000
    assert len(set(tokens)) > 1000  # spread over the head, not stuck on its first entries


def test_top_k_and_top_p_together_take_the_smaller_set():
    params = SamplingParams(max_tokens=1, temperature=1.0, top_k=2, top_p=0.99, seed=2)
    assert set(_draws(LOGITS, params, n=500)) == {0, 1}
    params = SamplingParams(max_tokens=1, temperature=1.0, top_k=6, top_p=0.7, seed=2)
    assert set(_draws(LOGITS, params, n=500)) == {0, 1}


def test_impossible_tokens_are_never_drawn():
    logits = torch.tensor([0.0, float("-inf"), 0.0, float("-inf")])
    for params in (SamplingParams(max_tokens=1, temperature=1.0, seed=1),
                   SamplingParams(max_tokens=1, temperature=1.0, top_p=0.999, seed=1)):
        assert set(_draws(logits, params, n=1000)) == {0, 2}


def test_a_draw_depends_on_seed_and_position_only():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 500, generator=g)
    params = [SamplingParams(max_tokens=1, temperature=0.9, top_p=0.9 if i % 2 else 1.0, top_k=40 * (i % 3),
                             seed=100 + i) for i in range(6)]
    batched = sample_tokens(logits, params, list(range(20, 26)))
    alone = [sample_tokens(logits[i:i + 1], params[i:i + 1], [20 + i])[0] for i in range(6)]
    assert batched == alone
    again = sample_tokens(logits, params, list(range(20, 26)))
    assert again == batched
    moved = sample_tokens(logits, params, list(range(21, 27)))
    assert moved != batched  # another position is another draw (6 rows: equal by chance is ~impossible)


def test_logprobs_are_the_sampled_tokens_log_softmax():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(max_tokens=1, logprobs=3), SamplingParams(max_tokens=1, temperature=0.7, seed=1, logprobs=2)]
    out = sample_tokens(logits, params, [0, 0])
    lp = torch.log_softmax(logits, -1)
    for row, s in enumerate(out):
        assert math.isclose(s.logprob, float(lp[row, s.token_id]), rel_tol=1e-6)
        assert [t for t, _ in s.top_logprobs] == torch.topk(lp[row], params[row].logprobs).indices.tolist()


@pytest.mark.parametrize("scale", [0.3, 1.0, 3.0, 10.0])  # flat to peaked
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.999])
def test_nucleus_without_sorting_is_the_sorted_prefix(scale, top_p):
    probs = torch.softmax(torch.randn(32000, generator=torch.Generator().manual_seed(int(scale * 10))) * scale, -1)
    ordered, ids = torch.sort(probs, descending=True)
    keep = int(torch.searchsorted(torch.cumsum(ordered.double(), 0), torch.tensor([top_p], dtype=torch.float64))) + 1
    assert sorted(_nucleus(probs, top_p).tolist()) == sorted(ids[:keep].tolist())
