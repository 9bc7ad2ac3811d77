"""The station step: split chains, ragged batches, KV isolation, budgets."""
from __future__ import annotations

import pytest
import torch

from mesh.core.config import StationSpec
from mesh.core.params import SamplingParams
from mesh.core.wave import WaveEntry
from station.generate import forward_chain, generate_one
from station.kv import KVBudgetError
from station.step import Station

L = 6  # layers of the tiny preset
PROMPT = [1, 40, 41, 42, 300, 7, 9, 88, 120, 5, 6]
SPLITS = {2: [(0, 1), (1, 6)], 3: [(0, 2), (2, 3), (3, 6)], 4: [(0, 1), (1, 2), (2, 5), (5, 6)]}


def _chain(model_dir, ranges, **kw):
    return [Station(model_dir, StationSpec(layers=r, **kw)) for r in ranges]


def _prompts(n):
    return [[1] + [(37 * i + 11 * j) % 500 + 5 for j in range(3 + (5 * i) % 19)] for i in range(n)]


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_split_chain_matches_one_station(tiny_llama, parts):
    ranges = SPLITS[parts]
    chain = _chain(tiny_llama, ranges)
    entry = (WaveEntry(0, 0, len(PROMPT)),)
    hidden = None
    for st, (a, b) in zip(chain[:-1], ranges[:-1]):
        hidden = (st.forward(entry, token_ids=torch.tensor(PROMPT)) if a == 0 else st.forward(entry, hidden=hidden)).hidden
        ref = Station(tiny_llama, StationSpec(layers=(0, b))).forward(entry, token_ids=torch.tensor(PROMPT)).hidden
        assert torch.allclose(hidden, ref, atol=1e-5), f"hidden after layer {b} differs"
    for st in chain:
        st.release([0])
    greedy = SamplingParams(max_tokens=24)
    one = Station(tiny_llama, StationSpec(layers=(0, L)))
    assert generate_one(chain, PROMPT, greedy) == generate_one(one, PROMPT, greedy)
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=5)
    assert generate_one(chain, PROMPT, seeded) == generate_one(one, PROMPT, seeded)


def _run_batched(chain, prompts, params, chunk=5, stagger=2):
    """Advance all sequences together in ragged waves (chunks and decodes mixed); sequences join late."""
    toks = [list(p) for p in prompts]
    done_prompt = [0] * len(prompts)
    outs = [[] for _ in prompts]
    for wave in range(10_000):
        entries, ids, active = [], [], []
        for i, p in enumerate(prompts):
            if wave < i * stagger // 3 or len(outs[i]) >= params[i].max_tokens:
                continue
            pos = done_prompt[i]
            n = min(chunk, len(toks[i]) - pos)
            last = pos + n == len(toks[i])
            entries.append(WaveEntry(100 + i, pos, n, params[i] if last else None))
            ids += toks[i][pos:pos + n]
            active.append(i)
        if not entries:
            break
        out = forward_chain(chain, tuple(entries), ids)
        for i, e, s in zip(active, entries, out.samples):
            done_prompt[i] = e.end_pos
            if s is not None:
                toks[i].append(s.token_id)
                outs[i].append(s.token_id)
    for st in chain:
        st.release([100 + i for i in range(len(prompts))])
    return outs


@pytest.mark.parametrize("n", [1, 2, 5, 16])
def test_batched_equals_alone(tiny_llama, n):
    prompts = _prompts(n)
    params = [SamplingParams(max_tokens=6 + i % 5, temperature=0.0 if i % 2 == 0 else 0.8, top_k=0 if i % 3 else 40,
                             seed=1000 + i) for i in range(n)]
    one = Station(tiny_llama, StationSpec(layers=(0, L)))
    alone = [generate_one(one, p, sp)[0] for p, sp in zip(prompts, params)]
    assert _run_batched([one], prompts, params) == alone
    assert one.kv.stats().blocks_used == 0


def test_batched_split_chain_equals_alone(tiny_llama):
    prompts = _prompts(8)
    params = [SamplingParams(max_tokens=8, temperature=0.7 * (i % 2), seed=i) for i in range(8)]
    one = Station(tiny_llama, StationSpec(layers=(0, L)))
    alone = [generate_one(one, p, sp)[0] for p, sp in zip(prompts, params)]
    assert _run_batched(_chain(tiny_llama, SPLITS[3]), prompts, params) == alone


def test_kv_isolation_and_budget_returns(tiny_llama):
    st = Station(tiny_llama, StationSpec(layers=(0, L)))
    initial = st.kv.stats()
    greedy = SamplingParams(max_tokens=10)
    ref = generate_one(st, PROMPT, greedy)[0]
    assert st.kv.stats() == initial
    # the same sequence, decoded while neighbours join (prompt), decode once, and are released around it
    toks, pos, out = list(PROMPT), 0, []
    neighbour = None  # (seq_id, tokens)
    for step in range(10):
        entries, ids = [WaveEntry(7, pos, len(toks) - pos, greedy)], toks[pos:]
        if step % 3 == 0:
            neighbour = (50 + step, [1, 9 + step, 33, 200 + step])
            entries.append(WaveEntry(neighbour[0], 0, 4, greedy))
            ids = ids + neighbour[1]
        elif step % 3 == 1:
            entries.append(WaveEntry(neighbour[0], len(neighbour[1]) - 1, 1, greedy))
            ids = ids + neighbour[1][-1:]
        else:
            assert st.release([neighbour[0]]) == 1
            neighbour = None
        o = st.forward(tuple(entries), token_ids=torch.tensor(ids))
        pos = len(toks)
        toks.append(o.samples[0].token_id)
        out.append(o.samples[0].token_id)
        if neighbour is not None:
            neighbour[1].append(o.samples[1].token_id)
    assert out == ref
    st.release([7] + ([neighbour[0]] if neighbour else []))
    assert st.kv.stats() == initial


def test_kv_budget_refusal_is_clean(tiny_llama):
    spec = StationSpec(layers=(0, L), kv_bytes=4 * 16 * 2 * L * 2 * 16 * 4)  # 4 blocks of 16 tokens
    st = Station(tiny_llama, spec)
    assert st.kv.stats().blocks_total == 4
    st.forward((WaveEntry(1, 0, 40),), token_ids=torch.arange(40) + 5)  # 3 blocks
    with pytest.raises(KVBudgetError, match="KV budget exhausted"):
        st.forward((WaveEntry(2, 0, 20),), token_ids=torch.arange(20) + 5)
    assert st.kv.stats().blocks_used == 3 and st.kv.length(2) is None
    st.forward((WaveEntry(2, 0, 8),), token_ids=torch.arange(8) + 5)  # still serving
    st.release([1, 2])
    assert st.kv.stats().blocks_used == 0


def test_bad_waves_are_refused_by_name(tiny_llama):
    first = Station(tiny_llama, StationSpec(layers=(0, 3)))
    second = Station(tiny_llama, StationSpec(layers=(3, L)))
    first.forward((WaveEntry(1, 0, 4),), token_ids=torch.tensor([1, 2, 3, 4]))
    cases = [
        ((WaveEntry(9, 3, 1),), {"token_ids": torch.tensor([5])}, "unknown seq_id 9"),
        ((WaveEntry(1, 6, 1),), {"token_ids": torch.tensor([5])}, "skips ahead"),
        ((WaveEntry(1, 2, 1),), {"token_ids": torch.tensor([5])}, "goes backwards"),
        ((WaveEntry(1, 4, 2),), {"token_ids": torch.tensor([5])}, "token_ids: expected int64 \\[2\\]"),
        ((WaveEntry(2, 0, 1),), {"token_ids": torch.tensor([999])}, "token_ids: ids must lie in"),
        ((WaveEntry(2, 0, 1), WaveEntry(2, 0, 1)), {"token_ids": torch.tensor([5, 6])}, "appears twice"),
        ((), {"token_ids": torch.tensor([], dtype=torch.long)}, "at least one entry"),
        ((WaveEntry(2, 0, 1),), {"hidden": torch.zeros(1, 64)}, "first station takes token ids"),
    ]
    for entries, kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            first.forward(entries, **kw)
    for kw, msg in [({"hidden": torch.zeros(2, 64)}, "expected float32 \\[1, 64\\]"),
                    ({"hidden": torch.zeros(1, 64, dtype=torch.float64)}, "got float64"),
                    ({"token_ids": torch.tensor([5])}, "takes hidden rows")]:
        with pytest.raises(ValueError, match=msg):
            second.forward((WaveEntry(1, 0, 1),), **kw)
    assert first.kv.length(1) == 4 and first.kv.stats().sequences == 1  # nothing half-applied
    first.forward((WaveEntry(1, 4, 1),), token_ids=torch.tensor([5]))  # and it still serves


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_station_runs(tiny_llama, dtype):
    st = Station(tiny_llama, StationSpec(layers=(0, L), dtype=dtype))
    assert st.model.model.layers["0"].mlp.up_proj.weight.dtype == getattr(torch, dtype)
    ids, reason = generate_one(st, PROMPT, SamplingParams(max_tokens=8))
    assert len(ids) == 8 and reason == "length"
    ref = generate_one(Station(tiny_llama, StationSpec(layers=(0, L))), PROMPT, SamplingParams(max_tokens=1))[0]
    assert ids[0] == ref[0]  # the first greedy token survives reduced precision on this model


def test_rows_go_where_the_caller_puts_them(tiny_llama):
    """`rows_out` (a successor's shared-memory segment): a station before the last writes its rows there and returns
    that tensor, the same bits as its own; a tensor of the wrong shape, dtype or device, at the last station, or
    for several decode steps is refused by name before anything runs."""
    first, alone = (Station(tiny_llama, StationSpec(layers=(0, 3))) for _ in range(2))
    entry, ids = (WaveEntry(1, 0, 4),), torch.tensor([1, 2, 3, 4])
    d = first.config.hidden_size
    space = torch.full((4, d), float("nan"))  # [T, d]
    out = first.forward(entry, token_ids=ids, rows_out=space)
    assert out.hidden is space and torch.equal(space, alone.forward(entry, token_ids=ids).hidden)
    middle, middle_alone = (Station(tiny_llama, StationSpec(layers=(3, 5))) for _ in range(2))
    rows, kept, onward = space.clone(), space.clone(), torch.full((4, d), float("nan"))
    assert middle.forward(entry, hidden=rows, rows_out=onward).hidden is onward
    assert torch.equal(rows, kept)  # its input rows are left as they came
    assert torch.equal(onward, middle_alone.forward(entry, hidden=kept).hidden)
    last = Station(tiny_llama, StationSpec(layers=(3, L)))
    step = (WaveEntry(1, 4, 1),)
    for station, kw, words in [
            (first, {"rows_out": torch.zeros(2, d)}, "rows_out: expected a CPU float32 \\[1, 64\\] tensor"),
            (first, {"rows_out": torch.zeros(1, d, dtype=torch.float64)}, "got cpu float64"),
            (first, {"rows_out": torch.zeros(1, d), "steps": 2}, "several decode steps return samples"),
            (last, {"rows_out": torch.zeros(1, d), "hidden": torch.zeros(1, d)}, "the last station samples")]:
        with pytest.raises(ValueError, match=words):
            station.forward(step if station is first else (WaveEntry(1, 0, 1),),
                            **({"token_ids": torch.tensor([5])} if station is first else {}), **kw)
    assert first.kv.length(1) == 4  # nothing ran
