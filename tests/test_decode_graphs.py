"""Decode waves replayed from recorded input tensors (station.decode_graphs): the plumbing a CUDA graph relies on.

On the CPU nothing is captured (capture=False runs the layers on the recorded input tensors), so these tests check
what a graph replay depends on: every input of a later wave of the same shape is copied into the recorded tensors
(a missed copy replays the first wave's positions, KV slots or mask), a new block count records a new shape, waves
that are not one decode group run eagerly, and the outputs keep the eager path's bits. The capture itself runs on
the device (bench/device_check.sh's `graphs` part)."""
from __future__ import annotations

import pytest
import torch

from mesh.core.config import ConfigError, ModelConfig, StationSpec
from mesh.core.params import SamplingParams
from mesh.core.wave import WaveEntry
from station.decode_graphs import DecodeGraphs
from station.step import Station

GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


def _station(model_dir, graphs: bool) -> Station:
    layers = ModelConfig.from_dir(model_dir).num_hidden_layers
    st = Station(model_dir, StationSpec(layers=(0, layers), dtype="bfloat16", linear_backend="aten"))
    assert st.graphs is None  # a CPU station runs eagerly
    if graphs:
        st.graphs = DecodeGraphs(st.model, st.kv, 0, st.device, max_graphs=2, capture=False)
    return st


def test_replayed_decode_waves_keep_the_eager_bits_across_shapes(tiny_llama):
    eager, replay = _station(tiny_llama, False), _station(tiny_llama, True)
    prompts = {1: [5, 9, 13, 2, 7, 11, 3, 8, 1, 4, 6, 12, 10, 14], 2: [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9],
               3: [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0]}
    prefill = tuple(WaveEntry(s, 0, len(p), GREEDY) for s, p in prompts.items())
    ids = torch.tensor([t for p in prompts.values() for t in p])
    outs = [st.forward(prefill, token_ids=ids, want_logits=True) for st in (eager, replay)]
    assert torch.equal(outs[0].logits, outs[1].logits)
    assert len(replay.graphs) == 0  # prompt chunks run eagerly
    tokens = {s: t.token_id for s, t in zip(prompts, outs[0].samples)}
    shapes = []
    for step in range(5):  # 14/15-token prompts: block counts 1 then 2 (16-token blocks), and back to one wave shape
        decode = tuple(WaveEntry(s, len(p) + step, 1, GREEDY) for s, p in prompts.items())
        token_ids = torch.tensor([tokens[s] for s in prompts])
        a, b = (st.forward(decode, token_ids=token_ids, want_logits=True) for st in (eager, replay))
        assert torch.equal(a.logits, b.logits), f"step {step}: replayed logits differ from the eager ones"
        assert a.samples == b.samples
        tokens = {s: t.token_id for s, t in zip(prompts, a.samples)}
        shapes.append(len(replay.graphs))
    # step 0: every row within one block, shape (3 rows, 1 block) recorded; step 1: seq 2 reaches a second block, two
    # groups, eager; steps 2-4: shape (3, 2) recorded, then replayed twice from copies of each wave's inputs
    assert shapes == [1, 1, 2, 2, 2] and replay.graphs.captures == 0
    mixed = (WaveEntry(1, 19, 1, GREEDY), WaveEntry(4, 0, 3, GREEDY))  # a decode row and a prompt chunk: eager
    a, b = (st.forward(mixed, token_ids=torch.tensor([tokens[1], 1, 2, 3]), want_logits=True) for st in (eager, replay))
    assert torch.equal(a.logits, b.logits) and len(replay.graphs) == 2


def test_a_shape_dropped_beyond_the_limit_is_recorded_again(tiny_llama):
    eager, replay = _station(tiny_llama, False), _station(tiny_llama, True)  # max_graphs=2
    sizes = (1, 2, 3, 1)  # waves of 1, 2, 3 rows: three shapes, the first dropped, then recorded again
    for seq, n in enumerate(sizes):
        entries = tuple(WaveEntry(100 * seq + i, 0, 4, GREEDY) for i in range(n))
        ids = torch.arange(4 * n) % 10
        for st in (eager, replay):
            st.forward(entries, token_ids=ids)
        decode = tuple(WaveEntry(e.seq_id, 4, 1, GREEDY) for e in entries)
        a, b = (st.forward(decode, token_ids=torch.arange(n), want_logits=True) for st in (eager, replay))
        assert torch.equal(a.logits, b.logits)
        assert len(replay.graphs) == min(seq + 1, 2)


def test_cuda_graphs_is_a_checked_switch():
    assert StationSpec(layers=(0, 1)).cuda_graphs is True
    assert StationSpec(layers=(0, 1), cuda_graphs=False).cuda_graphs is False
    with pytest.raises(ConfigError, match="cuda_graphs"):
        StationSpec(layers=(0, 1), cuda_graphs="no")
    with pytest.raises(ValueError, match="max_graphs"):
        DecodeGraphs(lambda h, p, c: h, None, 0, torch.device("cpu"), max_graphs=0)
