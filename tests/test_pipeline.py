"""The pipeline and its links: typed inbox messages, a failed release counted and logged (not swallowed)."""
from __future__ import annotations

import logging
import queue

from mesh.core.config import StationSpec
from mesh.core.params import SamplingParams
from mesh.core.wave import WaveEntry
from orchestrator.pipeline import LocalLink, Pipeline
from orchestrator.scheduler_types import WavePlan
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
