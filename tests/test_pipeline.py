"""The pipeline and its links: typed inbox messages, a failed release counted and logged (not swallowed),
and remote KV figures that come back with every Forward / Release reply, so a stats scrape costs no RPC."""
from __future__ import annotations

import logging
import queue

import pytest
from tokenizers import Tokenizer

from mesh.core.config import ModelConfig, SchedulerConfig, StationSpec
from mesh.core.params import SamplingParams
from mesh.core.wave import WaveEntry
from orchestrator.engine import Engine
from orchestrator.pipeline import LocalLink, Pipeline
from orchestrator.remote import RemoteLink
from orchestrator.scheduler_types import WavePlan
from station.server import start_server
from station.servicer import StationServicer
from station.step import Station

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


class ReleaseFailsOnce(LocalLink):
    """A LocalLink whose first release raises, as a station that lost the call would."""

    def __init__(self, station) -> None:
        super().__init__(station)
        self.failures_left = 1

    def release(self, seq_ids) -> None:
        """Raise once, then free KV as a LocalLink does."""
        if self.failures_left:
            self.failures_left -= 1
            raise ConnectionError("release lost on the way")
        super().release(seq_ids)


def test_failed_release_is_counted_logged_and_the_pipeline_keeps_working(tiny_llama, caplog):
    first = LocalLink(Station(tiny_llama, StationSpec(layers=(0, 3))))
    second = ReleaseFailsOnce(Station(tiny_llama, StationSpec(layers=(3, 6))))
    done: queue.Queue = queue.Queue()
    pipeline = Pipeline([first, second], lambda plan, samples, error: done.put((plan.wave_id, samples, error)))
    try:
        with caplog.at_level(logging.WARNING, logger="orchestrator.pipeline"):
            pipeline.submit(WavePlan((WaveEntry(0, 0, 3, GREEDY),), (1, 17, 300), wave_id=0))
            results = [done.get(timeout=60)]  # as the engine does: release only what is not in flight
            pipeline.release((0,))  # station 0 frees seq 0; station 1's release raises
            pipeline.submit(WavePlan((WaveEntry(1, 0, 2, GREEDY),), (1, 45), wave_id=1))
            results.append(done.get(timeout=60))
            assert pipeline.barrier(60)
        assert [(wave_id, error) for wave_id, _, error in results] == [(0, None), (1, None)]
        assert all(samples is not None and samples[0] is not None for _, samples, _ in results)
        assert pipeline.failed_releases == [0, 1]
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert "station 1" in warnings[0].getMessage() and "release lost on the way" in warnings[0].getMessage()
        assert first.station.kv.length(0) is None  # station 0 did free it
        assert second.station.kv.length(0) == 3  # the failed release really left the KV there
        pipeline.release((1,))  # the next release at station 1 goes through
        assert pipeline.barrier(60) and pipeline.failed_releases == [0, 1]
        assert second.station.kv.length(1) is None
    finally:
        pipeline.close()


def test_local_link_health_follows_close(tiny_llama):
    link = LocalLink(Station(tiny_llama, StationSpec(layers=(0, 6))))
    assert link.health() and link.describe()["healthy"] and link.describe()["address"] == "in-process"
    link.close()
    assert not link.health()


@pytest.fixture
def counted_stations(tiny_llama, monkeypatch):
    """Two station servers whose Info calls are counted: ({"Info": n}, [server, server])."""
    calls = {"Info": 0}
    real_info = StationServicer.Info

    def counting_info(self, request, context):
        calls["Info"] += 1
        return real_info(self, request, context)

    monkeypatch.setattr(StationServicer, "Info", counting_info)  # before start_server registers the handler
    servers = [start_server(Station(tiny_llama, StationSpec(layers=r))) for r in ((0, 2), (2, 6))]
    try:
        yield calls, servers
    finally:
        for s in servers:
            s.stop(grace=0)


def test_remote_kv_figures_come_with_replies_not_info_calls(counted_stations):
    calls, servers = counted_stations
    links = [RemoteLink(s.address, timeout_s=30) for s in servers]
    try:
        assert calls["Info"] == 2  # one each, to learn the stations' geometry
        entry = WaveEntry(5, 0, 20, GREEDY)  # 20 rows: two KV blocks of 16
        hidden = links[0].forward(0, (entry,), list(range(1, 21)), None).hidden
        assert links[0].kv().bytes_used == servers[0].servicer.station.stats().kv.bytes_used > 0
        assert links[1].kv().bytes_used == 0  # station 1 has not seen the wave yet
        out = links[1].forward(0, (entry,), None, hidden)
        assert out.samples[0] is not None
        assert links[1].kv().bytes_used == servers[1].servicer.station.stats().kv.bytes_used > 0
        for link in links:
            link.release((5,))
            assert link.kv().bytes_used == 0
        for _ in range(50):
            [link.kv() for link in links]
        assert calls["Info"] == 2
    finally:
        for link in links:
            link.close()


def test_engine_stats_scrapes_make_no_info_call(tiny_llama, counted_stations):
    calls, servers = counted_stations
    cfg = ModelConfig.from_dir(tiny_llama)
    tok = Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))
    engine = Engine([RemoteLink(s.address, timeout_s=30) for s in servers], cfg,
                    SchedulerConfig(max_seqs=4, max_wave_tokens=64), tok)
    try:
        before = calls["Info"]
        assert engine.stats().kv_bytes_used == 0
        assert calls["Info"] == before
        stream = engine.submit([1, 5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True))
        used = []
        for ev in stream:
            if not used:  # the first token: the sequence holds KV at both stations
                # the first station asked its successor once for its relay link (station.relay): not a scrape
                before = calls["Info"]
                used = [engine.stats().kv_bytes_used for _ in range(20)]
                engine.cancel(stream.request_id)
        assert min(used) > 0, used
        assert engine.quiesce(30)
        assert engine.stats().kv_bytes_used == 0  # the release replies brought the figures down
        assert sum(s.servicer.station.stats().kv.bytes_used for s in servers) == 0
        assert calls["Info"] == before, "a stats scrape made an Info call"
    finally:
        engine.close()
        for link in engine.pipeline.links:
            link.close()
