"""The HTTP front door under a hostile afternoon (issue 17 items 3, 6-9), uvicorn on 127.0.0.1 over a tiny engine.

A burst fills every free lane and the queue before it is refused; a prompt longer than the context could hold is
refused before the tokenizer sees it, and tokenizing blocks no other request; /health costs users nothing; a
client that leaves mid-body is counted, not traced; the admin routes read bodies as the API does.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from mesh.control.cluster_yaml import mesh_config_from_dict
from mesh.core.config import ApiConfig, ConfigError, ModelConfig, SchedulerConfig, StationSpec
from orchestrator.api import MAX_BODY_BYTES, create_app
from orchestrator.engine import Engine
from orchestrator.pipeline import LocalLink
from station.step import Station

MODEL, KEY, T = "tiny-llama", "front-key", 60.0
KEYED = {"Authorization": f"Bearer {KEY}"}


class GatedLink(LocalLink):
    """An in-process station whose waves wait for `gate` (so nothing finishes during a burst); `fail` breaks it."""

    def __init__(self, station) -> None:
        super().__init__(station)
        self.gate, self.fail = threading.Event(), False

    def forward(self, wave_id, entries, token_ids, hidden):
        """Wait for the gate (bounded), then run the wave, or raise when broken."""
        assert self.gate.wait(T), "the test never opened the gate"
        if self.fail:
            raise RuntimeError("the forward path is broken")
        return super().forward(wave_id, entries, token_ids, hidden)


class GatedTokenizer:
    """The tiny tokenizer, recording the size of every text it is asked to encode; a text holding "HOLD"
    waits for `release` (bounded) after setting `entered`."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner, self.sizes = inner, []
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _wait(self, text: str) -> None:
        self.sizes.append(len(text))
        if "HOLD" in text:
            self.entered.set()
            assert self.release.wait(T), "the test never released the tokenizer"

    def encode(self, text, *args, **kw):
        """Tokenizer.encode, after the gate."""
        self._wait(text)
        return self.inner.encode(text, *args, **kw)

    def encode_batch(self, texts, *args, **kw):
        """Tokenizer.encode_batch, after the gate."""
        for text in texts:
            self._wait(text)
        return self.inner.encode_batch(texts, *args, **kw)


def _tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def _engine(model_dir, link_cls=LocalLink, **sched) -> Engine:
    cfg = ModelConfig.from_dir(model_dir)
    link = link_cls(Station(model_dir, StationSpec(layers=(0, cfg.num_hidden_layers), kv_bytes=64 * 2**20)))
    return Engine([link], cfg, SchedulerConfig(**sched), _tokenizer(model_dir))


def _app(engine, model_dir, tokenizer=None, **api):
    template = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    return create_app(engine, tokenizer or _tokenizer(model_dir), template, MODEL, ApiConfig(**api))


def _metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", timeout=T).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


def _burst(base: str, n: int, gate: threading.Event, headers: dict | None = None, health_calls: int = 0):
    """POST `n` streaming completions at once, beside `health_calls` keyless GET /health; once every status
    is in, open `gate` and read each accepted stream to its end. Returns (stream statuses, health statuses,
    streams that ended with [DONE])."""
    body = {"model": MODEL, "prompt": "The river ran", "max_tokens": 2, "ignore_eos": True, "stream": True}

    async def main():
        async with httpx.AsyncClient(timeout=T, limits=httpx.Limits(max_connections=n + health_calls)) as http:
            async def stream() -> httpx.Response:
                request = http.build_request("POST", base + "/v1/completions", json=body, headers=headers)
                return await http.send(request, stream=True)

            async def health() -> int:
                return (await http.get(base + "/health")).status_code

            got = await asyncio.wait_for(asyncio.gather(*(stream() for _ in range(n)),
                                                        *(health() for _ in range(health_calls))), T)
            responses, healths = got[:n], got[n:]
            gate.set()
            done = 0
            for r in responses:
                text = (await asyncio.wait_for(r.aread(), T)).decode()
                done += r.status_code == 200 and text.rstrip().endswith("data: [DONE]")
                await r.aclose()
            return [r.status_code for r in responses], healths, done

    return asyncio.run(main())


def _ok(base: str, headers: dict | None = None) -> None:
    r = httpx.post(base + "/v1/completions", json={"prompt": "The river ran", "max_tokens": 2}, headers=headers,
                   timeout=T)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text


# ---- item 6: admission bursts --------------------------------------------------------------------

def test_burst_at_the_bound_is_admitted_and_only_the_excess_refused(tiny_llama, serve_http):
    """max_seqs 16 + max_queue 8: a burst of 24 is all admitted, one of 29 refuses exactly 5 (503)."""
    engine = _engine(tiny_llama, GatedLink, max_seqs=16, max_queue=8, max_wave_tokens=128)
    gate = engine.pipeline.links[0].gate  # closed: nothing finishes (or leaves its lane) during a burst
    try:
        with serve_http(_app(engine, tiny_llama)) as base:
            statuses, _, done = _burst(base, 24, gate)
            assert statuses == [200] * 24 and done == 24
            assert engine.wait_idle(T)
            gate.clear()
            statuses, _, done = _burst(base, 24 + 5, gate)
            assert sorted(statuses) == [200] * 24 + [503] * 5 and done == 24
            assert engine.stats().refusals["queue_full"] == 5
            _ok(base)
    finally:
        engine.close()


# ---- item 7: huge prompts and the tokenizer -------------------------------------------------------

def test_text_past_the_context_is_refused_before_the_tokenizer_sees_it(tiny_llama, serve_http):
    """A 7.9 MB prompt, 10^5 empty chat messages and a 7.9 MB message: 400s naming the limit, tokenizer untouched."""
    tokenizer = GatedTokenizer(_tokenizer(tiny_llama))
    context = ModelConfig.from_dir(tiny_llama).max_position_embeddings
    limit = context * max(4, max(len(t.encode()) for t in tokenizer.get_vocab()))
    engine = _engine(tiny_llama, max_seqs=4, max_wave_tokens=64)
    huge = "a" * 7_900_000
    try:
        with serve_http(_app(engine, tiny_llama, tokenizer)) as base:
            for route, body, param, names in (
                    ("completions", {"prompt": huge}, "prompt", (f"the limit is {limit} bytes", "7900000 bytes")),
                    ("chat/completions", {"messages": [{"role": "user", "content": huge}]}, "messages",
                     (f"the limit is {limit} bytes",)),
                    ("chat/completions", {"messages": [{"role": "user", "content": ""}] * 100_000}, "messages",
                     ("100000 messages", f"context of {context} tokens"))):
                r = httpx.post(f"{base}/v1/{route}", json={**body, "max_tokens": 2}, timeout=T)
                err = r.json()["error"]
                assert r.status_code == 400 and err["param"] == param, r.text[:300]
                assert err["code"] == "context_length_exceeded" and all(n in err["message"] for n in names), err
            assert max(tokenizer.sizes, default=0) <= limit  # nothing that long reached the tokenizer
            _ok(base)
    finally:
        engine.close()


def test_tokenizing_runs_off_the_event_loop(tiny_llama, serve_http):
    """While one request's prompt is being tokenized (held in the tokenizer), GET /v1/models answers."""
    tokenizer = GatedTokenizer(_tokenizer(tiny_llama))
    engine = _engine(tiny_llama, max_seqs=4, max_wave_tokens=64)
    try:
        with serve_http(_app(engine, tiny_llama, tokenizer)) as base, ThreadPoolExecutor(1) as pool:
            try:
                held = pool.submit(httpx.post, base + "/v1/completions",
                                   json={"prompt": "HOLD the river", "max_tokens": 2}, timeout=T)
                assert tokenizer.entered.wait(T), "the prompt never reached the tokenizer"
                models = httpx.get(base + "/v1/models", timeout=20)  # on the event loop it would wait for the gate
                assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
                assert not held.done()  # answered while the other request was still in the tokenizer
            finally:
                tokenizer.release.set()
            assert held.result(T).status_code == 200
    finally:
        engine.close()


# ---- item 8: /health at no cost ------------------------------------------------------------------

def test_health_takes_no_users_place_and_still_sees_a_broken_path(tiny_llama, serve_http):
    """32 keyless /health beside keyed requests exactly at the bound refuse none of them; one proof served all;
    a broken forward path is still a 503, and so is a closed engine whatever the cache says."""
    engine = _engine(tiny_llama, GatedLink, max_seqs=4, max_queue=2, max_wave_tokens=64)
    link = engine.pipeline.links[0]
    app = _app(engine, tiny_llama, api_key=KEY, health_cache_s=600)
    try:
        with serve_http(app) as base:
            link.gate.set()
            assert httpx.get(base + "/health", timeout=T).json() == {"status": "ok"}
            link.gate.clear()
            statuses, healths, done = _burst(base, 4 + 2, link.gate, KEYED, health_calls=32)
            assert statuses == [200] * 6 and done == 6
            assert healths == [200] * 32 and app.state.health.proofs == 1
            link.fail = True
            with serve_http(_app(engine, tiny_llama, api_key=KEY, health_cache_s=0)) as uncached:
                r = httpx.get(uncached + "/health", timeout=T)
                assert r.status_code == 503 and "broken" in r.json()["reason"], r.text
            engine.close()
            r = httpx.get(base + "/health", timeout=T)
            assert r.status_code == 503 and "shutting down" in r.json()["reason"]
    finally:
        link.gate.set()
        engine.close()


# ---- item 9: clients that leave mid-body ---------------------------------------------------------

class _Lines(logging.Handler):
    """Every line logged (tracebacks included)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines += self.format(record).splitlines()


def test_client_that_leaves_mid_body_is_counted_not_traced(tiny_llama, serve_http):
    """Content-Length 1000 then close, or a bad chunk: no traceback, at most one line each, each counted."""
    engine = _engine(tiny_llama, max_seqs=4, max_wave_tokens=64)
    handler, loggers = _Lines(), (logging.getLogger("uvicorn"), logging.getLogger())
    for logger in loggers:
        logger.addHandler(handler)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    raws = ([head + b'Content-Length: 1000\r\n\r\n{"prompt": "the ri'] * 5
            + [head + b'Transfer-Encoding: chunked\r\n\r\n5\r\n{"pro\r\nZZ\r\n'] * 5)
    try:
        with serve_http(_app(engine, tiny_llama)) as base:
            port = int(base.rsplit(":", 1)[1])
            for raw in raws:
                with socket.create_connection(("127.0.0.1", port), timeout=T) as conn:
                    conn.sendall(raw)
            deadline = time.monotonic() + T
            while _metric(base, "wavemesh_client_disconnects_total") < len(raws) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _metric(base, "wavemesh_client_disconnects_total") == len(raws)
            _ok(base)
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
        engine.close()
    text = "\n".join(handler.lines)
    assert "Traceback" not in text and "Exception in ASGI" not in text, text[:3000]
    assert len(handler.lines) <= len(raws), text


# ---- item 3: admin bodies ------------------------------------------------------------------------

class FakeCluster:
    """What build_app needs of a Cluster, over a real engine; scale and add_station are recorded, not run."""

    def __init__(self, engine, model_dir) -> None:
        self.engine, self.model_dir, self.calls, self.on_restart = engine, model_dir, [], None

    def status(self) -> dict:
        """No station to report."""
        return {"stations": []}

    def scale(self, count: int) -> tuple:
        """Record; refuse more stations than layers as the Cluster does."""
        self.calls.append(("scale", count))
        if count > 6:
            raise ConfigError(f"stations: expected 1..6, got {count}")
        return ()

    def add_station(self, layers, num_gpus) -> tuple:
        """Record; refuse more GPUs than a node has as the Cluster does."""
        self.calls.append(("add", layers, num_gpus))
        if num_gpus and num_gpus > 8:
            raise ConfigError(f"station [3, 6): num_gpus={num_gpus:g} but no node has that many GPUs")
        return ()


ADMIN_BAD = [  # (route, raw body, param, words the message must hold)
    ("scale", b"[1]", None, "JSON object"),
    ("scale", b"1", None, "JSON object"),
    ("scale", b"{not json", None, "not valid JSON"),
    ("scale", b'{"stations": "two"}', "stations", "integer"),
    ("scale", b'{"stations": 2, "extra": 1}', "extra", "unknown field"),
    ("scale", b'{"stations": 99}', "stations", "1..6"),
    ("add-station", b'{"num_gpus": Infinity}', "num_gpus", "finite"),
    ("add-station", b'{"num_gpus": 1e308}', "num_gpus", "no node"),
    ("add-station", b'{"layers": [1]}', "layers", "[start, end]"),
    ("add-station", b'{"layers": [1, "2"], "num_gpus": 0}', "layers", "[start, end]"),
]


def test_admin_bodies_get_the_api_size_limit_and_name_the_field(tiny_llama):
    from fastapi.testclient import TestClient

    from mesh.control.up import build_app

    engine = _engine(tiny_llama, max_seqs=4, max_wave_tokens=64)
    cluster = FakeCluster(engine, tiny_llama)
    try:
        http = TestClient(build_app(cluster, mesh_config_from_dict({"model": {"path": str(tiny_llama)}})))
        for route, raw, param, words in ADMIN_BAD:
            r = http.post(f"/admin/{route}", content=raw, headers={"content-type": "application/json"})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param and words in err["message"], (raw, r.text)
            assert (param is None or param in err["message"]) and err["code"] in ("invalid_value", "invalid_json"), err
        big = b'{"stations": 2, "pad": "' + b"a" * MAX_BODY_BYTES + b'"}'
        for kw in ({"content": big}, {"content": iter([big[:2**20], big[2**20:]])}):  # declared, then chunked
            r = http.post("/admin/scale", headers={"content-type": "application/json"}, **kw)
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text[:300]
        assert http.post("/admin/scale", json={"stations": 2}).json() == {"stations": []}
        assert http.post("/admin/add-station", json={"layers": [0, 3], "num_gpus": 0}).status_code == 200
        assert cluster.calls == [("scale", 99), ("add", None, 1e308), ("scale", 2), ("add", (0, 3), 0)]
    finally:
        engine.close()
