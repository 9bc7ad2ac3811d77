"""Token sampling: (logits rows, per-row params, per-row position) -> token ids.

Randomness is counter-based: a row's uniform draw comes from a generator seeded
by (request seed, position of the token being drawn), so a request's tokens do
not depend on which other requests share its wave, and a replayed step draws
the same token.
"""
from __future__ import annotations

import torch

from mesh.params import SamplingParams
from mesh.wave import SampledToken

_MASK64 = (1 << 64) - 1


def row_seed(seed: int, position: int) -> int:
    """Mix (seed, position) into a 63-bit generator seed (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def _draw(logits: torch.Tensor, p: SamplingParams, position: int) -> int:
    """One stochastic draw from logits [V] (float32) under temperature / top-k / top-p."""
    scaled = logits / p.temperature
    probs, ids = torch.sort(torch.softmax(scaled, dim=-1), descending=True)  # [V] each
    keep = probs.shape[0]
    if p.top_k > 0:
        keep = min(keep, p.top_k)
    if p.top_p < 1.0:
        cum = torch.cumsum(probs[:keep], dim=0)
        keep = min(keep, int(torch.searchsorted(cum, torch.tensor([p.top_p])).item()) + 1)
    kept = probs[:keep] / probs[:keep].sum()
    g = torch.Generator().manual_seed(row_seed(p.seed, position))
    u = torch.rand(1, generator=g, dtype=torch.float64).item()
    cdf = torch.cumsum(kept.double(), dim=0)
    idx = min(int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64)).item()), keep - 1)
    return int(ids[idx].item())


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[SampledToken]:
    """Draw one token per row of logits [R, V]; `positions[r]` is the position the token will take."""
    logits = logits.float().cpu()
    greedy_ids = torch.argmax(logits, dim=-1).tolist()  # [R]
    want_lp = any(p.logprobs for p in params)
    logprobs = torch.log_softmax(logits, dim=-1) if want_lp else None  # [R, V]
    out = []
    for r, (p, pos) in enumerate(zip(params, positions)):
        tok = greedy_ids[r] if p.greedy else _draw(logits[r], p, pos)
        if p.logprobs and logprobs is not None:
            top_v, top_i = torch.topk(logprobs[r], p.logprobs)
            top = tuple((int(i), float(v)) for i, v in zip(top_i.tolist(), top_v.tolist()))
            out.append(SampledToken(tok, float(logprobs[r, tok]), top))
        else:
            out.append(SampledToken(tok))
    return out
