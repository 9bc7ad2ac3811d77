"""The tokens a cluster that never changed gives: every stream on one in-process full-model station, batched by the
engine (a stream's tokens do not depend on its wave: tests/test_engine.py holds the engine to each stream run alone
with `generate_one`). Long runs here take seconds rather than the tens a stream at a time takes, and a run is kept
for the test session, so the tests that share their jobs compute it once."""
from __future__ import annotations

from pathlib import Path

from mesh.core.config import ModelConfig, SchedulerConfig, StationSpec
from mesh.core.params import SamplingParams
from orchestrator.engine import Engine
from orchestrator.pipeline import LocalLink
from station.step import Station

_RUNS: dict[tuple, list[list[int]]] = {}


def reference_tokens(model_dir: str | Path, prompts: list[list[int]], params: list[SamplingParams]
                     ) -> list[list[int]]:
    """Each stream's token ids from one unchanged full-model station, all streams in one engine."""
    key = (str(model_dir), tuple(map(tuple, prompts)), tuple(params))
    if key not in _RUNS:
        cfg = ModelConfig.from_dir(model_dir)
        station = Station(model_dir, StationSpec(layers=(0, cfg.num_hidden_layers)))
        engine = Engine([LocalLink(station)], cfg, SchedulerConfig(max_seqs=len(prompts), max_wave_tokens=512))
        try:
            streams = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
            _RUNS[key] = [s.result(timeout=300)[0].token_ids for s in streams]
        finally:
            engine.close()
    return [list(ids) for ids in _RUNS[key]]
