"""The simplest driver of a chain of stations: one sequence, alone, prompt then decode.

It is the reference the batched paths are compared with, and what `mesh generate`
runs for a single prompt.
"""
from __future__ import annotations

import torch

from mesh.core.params import SamplingParams
from mesh.core.wave import WaveEntry
from station.step import Station


def forward_chain(stations: list[Station], entries: tuple[WaveEntry, ...], token_ids: list[int]):
    """Pass one wave through stations in order; returns the last station's output."""
    out = None
    hidden = None
    for i, st in enumerate(stations):
        if i == 0:
            out = st.forward(entries, token_ids=torch.tensor(token_ids, dtype=torch.long))
        else:
            out = st.forward(entries, hidden=hidden)
        hidden = out.hidden
    return out


def generate_one(station: Station | list[Station], prompt: list[int], params: SamplingParams,
                 seq_id: int = 0, chunk: int = 512) -> tuple[list[int], str]:
    """Generate for one prompt alone; returns (token ids, finish reason). Releases its KV at the end."""
    chain = station if isinstance(station, list) else [station]
    cfg = chain[0].config
    if not prompt:
        raise ValueError("prompt: must hold at least one token")
    tokens, out_ids, pos, reason = list(prompt), [], 0, "length"
    try:
        while len(out_ids) < params.max_tokens:
            n = min(chunk, len(tokens) - pos)
            last = pos + n == len(tokens)
            entry = WaveEntry(seq_id, pos, n, params if last else None)
            out = forward_chain(chain, (entry,), tokens[pos:pos + n])
            pos += n
            if not last:
                continue
            tok = out.samples[0].token_id
            tokens.append(tok)
            out_ids.append(tok)
            if (tok in cfg.eos_token_ids and not params.ignore_eos) or tok in params.stop_token_ids:
                reason = "stop"
                break
            if len(tokens) >= cfg.max_position_embeddings:
                break
    finally:
        for st in chain:
            st.release([seq_id])
    return out_ids, reason
