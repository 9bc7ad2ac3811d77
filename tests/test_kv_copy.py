"""KV copy between stations (ExportKV / ImportKV, issue 14): a copied sequence decodes on with the very bits of the
station it came from, in-process and over gRPC, on any kernels; bad copies are refused by name and the station
keeps serving."""
from __future__ import annotations

import threading

import grpc
import pytest
import torch

from mesh.core.config import ModelConfig, SchedulerConfig, StationSpec
from mesh.core.params import SamplingParams
from mesh.core.proto import station_pb2 as pb
from mesh.core.wave import WaveEntry
from mesh.core.wire_tensor import tensor_to_proto
from mesh.core.wire_kv import encode_import
from orchestrator.engine import Engine
from orchestrator.kv_move import CopySourceFailed, KVCopier, _pieces
from orchestrator.pipeline import LocalLink
from orchestrator.remote import RemoteLink
from orchestrator.scheduler_types import WavePlan
from station.client import StationCallError
from station.server import start_server
from station.step import Station, StepError

GREEDY = SamplingParams(max_tokens=1, ignore_eos=True)


def _prefill(station: Station, seq_id: int, n: int, chunk: int = 37) -> None:
    """`n` prompt tokens of `seq_id` in chunks of `chunk` (a cut a copy must keep)."""
    ids = [(seq_id * 31 + 7 * j) % 500 + 5 for j in range(n)]
    for start in range(0, n, chunk):
        part = ids[start:start + chunk]
        station.forward((WaveEntry(seq_id, start, len(part)),), token_ids=torch.tensor(part))


def _next_logits(stations: list[Station], seq_ids: list[int], pos: int) -> torch.Tensor:
    """One decode row per sequence through `stations` in order: the last one's logits [B, V]."""
    entries = tuple(WaveEntry(s, pos, 1, GREEDY) for s in seq_ids)
    x = torch.tensor([11 + s for s in seq_ids])
    out = None
    for st in stations:
        out = st.forward(entries, token_ids=x if st.is_first else None, hidden=None if st.is_first else x,
                         want_logits=st.is_last)
        x = out.hidden
    return out.logits


class _Done:
    def __init__(self):
        self.results, self.event = [], threading.Event()

    def __call__(self, plan, _samples, error):
        self.results.append((plan.wave_id, error))
        self.event.set()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_copied_kv_decodes_with_the_source_bits(tiny_llama, dtype):
    """Two sequences prefilled in odd chunks on one whole-model station, copied (by KVCopier, cut into pieces of
    at most 50 rows) onto two stations that split the layers: their next decode rows give logits equal bit for
    bit to the source's. bfloat16 runs the torch kernels, whose KV depends on the cut: the copy keeps it."""
    src = Station(tiny_llama, StationSpec(layers=(0, 6), dtype=dtype))
    dst = [Station(tiny_llama, StationSpec(layers=r, dtype=dtype)) for r in ((0, 2), (2, 6))]
    assert dtype == "float32" or not src.prefill_chunk_invariant
    for s in (3, 4):
        _prefill(src, s, 100)
    done = _Done()
    cfg = ModelConfig.from_dir(tiny_llama)
    row_bytes = 2 * cfg.num_key_value_heads * cfg.head_dim * (4 if dtype == "float32" else 2)
    copier = KVCopier([LocalLink(src)], [LocalLink(d) for d in dst], row_bytes, 16, done)
    copier.max_rows = 50
    tables = {3: tuple(range(0, 7)), 4: tuple(range(10, 17))}  # 100 positions: 7 blocks of 16
    plan = WavePlan((WaveEntry(3, 0, 100, None, tables[3]), WaveEntry(4, 0, 60, None, tables[4][:4])), (), 1)
    copier.submit(plan)
    assert done.event.wait(30) and done.results == [(1, None)]
    copier.copy(WavePlan((WaveEntry(4, 60, 40, None, tables[4]),), (), 2))  # the rest, on this thread
    copier.close()
    for d in dst:
        assert d.kv.length(3) == d.kv.length(4) == 100 and d.kv.table(3) == list(tables[3])
    assert torch.equal(_next_logits(dst, [3, 4], 100), _next_logits([src], [3, 4], 100))


def test_copy_drops_sequences_the_old_route_let_go(tiny_llama):
    """A plan whose sequence the old station released meanwhile (the old route finished it) is exported again
    without it once the catch-up says it is forgotten; a sequence still live that the old station lacks is an
    error (CopySourceFailed), never skipped."""
    src = Station(tiny_llama, StationSpec(layers=(0, 6)))
    dst = Station(tiny_llama, StationSpec(layers=(0, 6)))
    for s in (1, 2):
        _prefill(src, s, 20)
    src.release([2])
    cfg = ModelConfig.from_dir(tiny_llama)
    copier = KVCopier([LocalLink(src)], [LocalLink(dst)], 2 * cfg.num_key_value_heads * cfg.head_dim * 4, 16,
                      _Done())
    plan = WavePlan((WaveEntry(1, 0, 20, None, (0, 1)), WaveEntry(2, 0, 20, None, (2, 3))), (), 1)
    with pytest.raises(CopySourceFailed, match="unknown seq_id 2"):
        copier.copy(plan)
    assert dst.kv.stats().sequences == 0  # nothing imported: every export comes first
    copier.forgotten = lambda seq_id: seq_id == 2
    copier.copy(plan)
    copier.close()
    assert dst.kv.length(1) == 20 and dst.kv.length(2) is None


def test_pieces_cut_entries_at_the_row_limit():
    """A plan is cut into calls of at most max_rows rows; a long entry into consecutive ranges, each with its
    table up to its end."""
    entries = (WaveEntry(1, 0, 70, None, tuple(range(5))), WaveEntry(2, 16, 20, None, (9, 8, 7)))
    pieces = list(_pieces(entries, 32, 16))
    assert [sum(e.n_tokens for e in p) for p in pieces] == [32, 32, 26]
    assert [(e.seq_id, e.start_pos, e.n_tokens, e.blocks) for p in pieces for e in p] == [
        (1, 0, 32, (0, 1)), (1, 32, 32, (0, 1, 2, 3)), (1, 64, 6, (0, 1, 2, 3, 4)), (2, 16, 20, (9, 8, 7))]


def test_station_refuses_bad_copies_by_name(tiny_llama):
    """Unknown sequences, ranges past what is held, layers outside the station, tensors of the wrong shape or
    dtype, and an import that does not continue the sequence are refused naming the field; nothing changes."""
    src = Station(tiny_llama, StationSpec(layers=(0, 6)))
    dst = Station(tiny_llama, StationSpec(layers=(2, 6)))
    _prefill(src, 1, 40)
    with pytest.raises(StepError, match="unknown seq_id 9"):
        src.export_kv((WaveEntry(9, 0, 4),), 0, 6)
    with pytest.raises(StepError, match="up to 41 asked, seq_id 1 holds 40"):
        src.export_kv((WaveEntry(1, 0, 41),), 0, 6)
    with pytest.raises(StepError, match=r"layers \[4, 7\) are not within"):
        src.export_kv((WaveEntry(1, 0, 4),), 4, 7)
    k, v = src.export_kv((WaveEntry(1, 0, 40),), 2, 6)
    assert k.shape == (4, 40, *k.shape[2:]) and k.dtype == torch.float32
    with pytest.raises(StepError, match=r"k: expected float32 \[4, 40"):
        dst.import_kv((WaveEntry(1, 0, 40),), k[:3], v)
    with pytest.raises(StepError, match=r"v: expected float32"):
        dst.import_kv((WaveEntry(1, 0, 40),), k, v.double())
    with pytest.raises(StepError, match="unknown seq_id 1"):
        dst.import_kv((WaveEntry(1, 8, 32),), k[:, 8:], v[:, 8:])
    assert dst.kv.stats().sequences == 0
    dst.import_kv((WaveEntry(1, 0, 40),), k, v)
    with pytest.raises(StepError, match="goes backwards"):
        dst.import_kv((WaveEntry(1, 0, 40),), k, v)
    assert dst.kv.length(1) == 40


@pytest.fixture(scope="module")
def copy_servers(tiny_llama):
    """gRPC stations: a whole-model source and a two-station destination."""
    servers = [start_server(Station(tiny_llama, StationSpec(layers=r))) for r in ((0, 6), (0, 3), (3, 6))]
    try:
        yield servers
    finally:
        for s in servers:
            s.stop(grace=0)


def test_copy_over_grpc_is_exact_and_bad_messages_are_refused(tiny_llama, copy_servers):
    """ExportKV / ImportKV through RemoteLinks move a sequence exactly (the destination decodes the source's
    token); malformed ImportKV messages (a short tensor, NaN, a wrong dtype, no entries) answer INVALID_ARGUMENT
    naming the field, and the station goes on serving."""
    links = [RemoteLink(s.address) for s in copy_servers]
    try:
        src, dst = links[0], links[1:]
        ids = [(5 * j) % 400 + 3 for j in range(50)]
        src.forward(1, (WaveEntry(7, 0, 50),), ids, None)
        done = _Done()
        cfg = ModelConfig.from_dir(tiny_llama)
        copier = KVCopier([src], dst, 2 * cfg.num_key_value_heads * cfg.head_dim * 4, 16, done)
        copier.copy(WavePlan((WaveEntry(7, 0, 50, None, (0, 1, 2, 3)),), (), 2))
        copier.close()
        step = (WaveEntry(7, 50, 1, GREEDY),)
        want = src.forward(3, step, [42], None).samples[0].token_id
        hidden = dst[0].forward(3, step, [42], None).hidden
        assert dst[1].forward(3, step, None, hidden).samples[0].token_id == want

        client = dst[1].client
        k, v = src.export_kv((WaveEntry(7, 0, 8),), 3, 6)
        nan = k.clone()
        nan[0, 0, 0, 0] = float("nan")
        bad = {"k.shape": encode_import((WaveEntry(8, 0, 8),), k[:2], v),
               "holds NaN": encode_import((WaveEntry(8, 0, 8),), nan, v),
               "v.dtype": pb.ImportKVRequest(entries=encode_import((WaveEntry(8, 0, 8),), k, v).entries,
                                             k=tensor_to_proto(k), v=tensor_to_proto(v.half())),
               "needs at least one entry": pb.ImportKVRequest(k=tensor_to_proto(k), v=tensor_to_proto(v))}
        for field, request in bad.items():
            with pytest.raises(grpc.RpcError) as err:
                client._stub.ImportKV(request, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details(), field
        with pytest.raises(StationCallError, match="unknown seq_id 99"):
            src.client.export_kv((WaveEntry(99, 0, 1),), 0, 6, dtype="float32", kv_heads=cfg.num_key_value_heads,
                                 head_dim=cfg.head_dim)
        assert dst[1].client.info().sequences == 1 and dst[1].health()
    finally:
        for link in links:
            link.close()


def test_bf16_route_switch_copies_and_matches_a_cluster_that_never_changed(tiny_llama):
    """bfloat16 stations (torch kernels: a prompt's KV depends on how it is cut) make before break by copy: the
    switch is a catch-up, not a pause, every sequence switches with its one decode token, and every stream's
    tokens equal those of the same engine left on its first route."""
    cfg = ModelConfig.from_dir(tiny_llama)
    prompts = [[1] + [(13 * i + 3 * j) % 400 + 5 for j in range(120)] for i in range(6)]
    params = [SamplingParams(max_tokens=150, ignore_eos=True, temperature=0.0 if i % 2 else 0.8, seed=i)
              for i in range(6)]
    sched = SchedulerConfig(max_seqs=8, max_wave_tokens=96)

    def run(switch: bool) -> list[list[int]]:
        station = Station(tiny_llama, StationSpec(layers=(0, 6), dtype="bfloat16"))
        engine = Engine([LocalLink(station)], cfg, sched)
        try:
            streams = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
            tokens = [[] for _ in streams]
            it = [iter(s) for s in streams]
            for i in range(len(streams)):  # every prompt prefilled and decoding before the switch
                while len(tokens[i]) < 5:
                    tokens[i].extend(next(it[i]).token_ids)
            if switch:
                new = [LocalLink(Station(tiny_llama, StationSpec(layers=r, dtype="bfloat16")))
                       for r in ((0, 2), (2, 6))]
                report = engine.switch_route(new)
                assert report.mode == "catchup" and report.replayed == (), report
                assert len(report.residual) == 6 and set(report.residual.values()) == {1}, report.residual
            for i in range(len(streams)):
                for ev in it[i]:
                    tokens[i].extend(ev.token_ids)
            return tokens
        finally:
            engine.close()

    assert run(switch=True) == run(switch=False)
