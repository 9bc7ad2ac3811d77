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


def _station(model_dir, graphs: bool, max_graphs: int = 2) -> Station:
    layers = ModelConfig.from_dir(model_dir).num_hidden_layers
    st = Station(model_dir, StationSpec(layers=(0, layers), dtype="bfloat16", linear_backend="aten"))
    assert st.graphs is None  # a CPU station runs eagerly
    if graphs:
        st.graphs = DecodeGraphs(st.model, st.kv, st.device, max_graphs=max_graphs, capture=False)
    return st


# 16-token blocks. Lengths 14, 15, 14: step 0 one block each (whole, 3 rows x 1 block); step 1 seq 2 reaches a second
# block (pieces, 3 rows); steps 2-4 two blocks each (whole, 3 x 2, recorded then replayed twice from copies).
# Lengths 14, 15, 30: seq 3 is always a block ahead, so every step is in pieces (recorded, then replayed 4 times).
@pytest.mark.parametrize("lengths, shapes", [((14, 15, 14), [1, 2, 3, 3, 3]), ((14, 15, 30), [1, 1, 1, 1, 1])])
def test_replayed_decode_waves_keep_the_eager_bits_across_shapes(tiny_llama, lengths, shapes):
    eager, replay = _station(tiny_llama, False), _station(tiny_llama, True, max_graphs=3)
    g = torch.Generator().manual_seed(sum(lengths))
    prompts = {s: torch.randint(0, 16, (n,), generator=g).tolist() for s, n in zip((1, 2, 3), lengths)}
    prefill = tuple(WaveEntry(s, 0, len(p), GREEDY) for s, p in prompts.items())
    ids = torch.tensor([t for p in prompts.values() for t in p])
    outs = [st.forward(prefill, token_ids=ids, want_logits=True) for st in (eager, replay)]
    assert torch.equal(outs[0].logits, outs[1].logits)
    assert len(replay.graphs) == 0  # prompt chunks run eagerly
    tokens = {s: t.token_id for s, t in zip(prompts, outs[0].samples)}
    recorded = []
    for step in range(5):
        decode = tuple(WaveEntry(s, len(p) + step, 1, GREEDY) for s, p in prompts.items())
        token_ids = torch.tensor([tokens[s] for s in prompts])
        a, b = (st.forward(decode, token_ids=token_ids, want_logits=True) for st in (eager, replay))
        assert torch.equal(a.logits, b.logits), f"step {step}: replayed logits differ from the eager ones"
        assert a.samples == b.samples
        tokens = {s: t.token_id for s, t in zip(prompts, a.samples)}
        recorded.append(len(replay.graphs))
    assert recorded == shapes and replay.graphs.captures == 0
    mixed = (WaveEntry(1, 19, 1, GREEDY), WaveEntry(4, 0, 3, GREEDY))  # a decode row and a prompt chunk: eager
    a, b = (st.forward(mixed, token_ids=torch.tensor([tokens[1], 1, 2, 3]), want_logits=True) for st in (eager, replay))
    assert torch.equal(a.logits, b.logits) and len(replay.graphs) == shapes[-1]


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
        DecodeGraphs(None, None, torch.device("cpu"), max_graphs=0)


def test_graph_counters_reach_the_station_metrics(tiny_llama):
    from prometheus_client.parser import text_string_to_metric_families

    from station.metrics import StationMetrics

    st = _station(tiny_llama, True)
    st.graphs.replays, st.graphs.captures = 7, 3  # what a CUDA station's graphs would have counted
    assert (st.stats().graph_waves, st.stats().graph_captures) == (7, 3)
    text = StationMetrics(st).render().decode()
    samples = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples["wavemesh_station_graph_waves_total"] == 7
    assert samples["wavemesh_station_graph_captures_total"] == 3
