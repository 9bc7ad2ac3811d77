"""The OpenAI-compatible HTTP surface over a real in-process engine (tiny model, uvicorn on 127.0.0.1)."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from mesh.core.config import ApiConfig, ModelConfig, SchedulerConfig, StationSpec
from mesh.core.params import SamplingParams
from orchestrator.api import OPEN_PATHS, create_app
from orchestrator.engine import Engine
from orchestrator.metrics import RequestRecord
from station.metrics import StationMetrics
from orchestrator.pipeline import LocalLink
from station.step import Station

MODEL, KEY, T = "tiny-llama", "sekrit", 60.0


def _engine(model_dir, **sched) -> Engine:
    cfg = ModelConfig.from_dir(model_dir)
    links = [LocalLink(Station(model_dir, StationSpec(layers=(0, cfg.num_hidden_layers), kv_bytes=64 * 2**20)))]
    return Engine(links, cfg, SchedulerConfig(**sched), Tokenizer.from_file(str(model_dir / "tokenizer.json")))


def _app(engine, model_dir, **api):
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    template = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    return create_app(engine, tok, template, MODEL, ApiConfig(max_n=4, **api),
                      status_provider=lambda: {"stations": [{"layers": [0, 6]}]})


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = _engine(tiny_llama, max_seqs=32, max_wave_tokens=512, max_queue=256)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def url(engine, tiny_llama, serve_http):
    with serve_http(_app(engine, tiny_llama)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=T)


def _ok(url, **extra):
    body = {"model": MODEL, "prompt": "The river ran", "max_tokens": 4, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=T)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    return r.json()


def _idle(engine):
    assert engine.quiesce(30)
    s = engine.stats()
    assert (s.running, s.waiting, s.waves_in_flight, s.kv_bytes_used) == (0, 0, 0, 0), s


def test_openai_client_completions_stream_equals_plain(client):
    ask = dict(model=MODEL, prompt="The river ran slowly", max_tokens=12, temperature=0,
               extra_body={"return_token_ids": True, "ignore_eos": True})
    plain = client.completions.create(**ask)
    choice = plain.choices[0]
    assert plain.object == "text_completion" and choice.finish_reason == "length"
    assert plain.usage.completion_tokens == len(choice.token_ids) == 12
    assert plain.usage.prompt_tokens == len(plain.prompt_token_ids)
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + 12
    ids, text, usage = [], "", None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **ask):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            ids += c.token_ids
            text += c.text
    assert ids == choice.token_ids and text == choice.text
    assert usage.completion_tokens == 12 and usage.prompt_tokens == plain.usage.prompt_tokens
    by_ids = client.completions.create(**{**ask, "prompt": plain.prompt_token_ids})
    assert by_ids.choices[0].token_ids == choice.token_ids


def test_openai_client_chat_stream_equals_plain(client):
    ask = dict(model=MODEL, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
               max_tokens=10, temperature=0, extra_body={"return_token_ids": True})
    plain = client.chat.completions.create(**ask)
    msg = plain.choices[0]
    assert plain.object == "chat.completion" and msg.message.role == "assistant"
    assert plain.usage.completion_tokens == len(msg.token_ids) >= 1
    ids, text, roles = [], "", []
    for chunk in client.chat.completions.create(stream=True, **ask):
        for c in chunk.choices:
            roles += [c.delta.role] if c.delta.role else []
            text += c.delta.content or ""
            ids += getattr(c, "token_ids", None) or []
    assert roles == ["assistant"] and ids == msg.token_ids and text == msg.message.content
    lp = client.chat.completions.create(logprobs=True, top_logprobs=2, **ask).choices[0].logprobs.content
    assert len(lp) == len(msg.token_ids) and all(len(e.top_logprobs) == 2 for e in lp)
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in lp)


def test_models_n_choices_and_completion_logprobs(client, url):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    two = client.completions.create(model=MODEL, prompt="A computer", max_tokens=5, n=2, temperature=0.9, seed=5,
                                    logprobs=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in two.choices) == [0, 1] and two.usage.completion_tokens == 10
    for c in two.choices:
        assert len(c.logprobs.tokens) == 5 and all(len(t) == 3 for t in c.logprobs.top_logprobs)
    again = client.completions.create(model=MODEL, prompt="A computer", max_tokens=5, n=2, temperature=0.9, seed=5,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in two.choices]  # seeded: reproducible
    status = httpx.get(url + "/v1/status", timeout=T).json()
    assert status["model"] == MODEL and "running" in status["engine"] and status["stations"]
    assert httpx.get(url + "/health", timeout=T).json() == {"status": "ok"}


ERRORS = [  # (route, body, status, param, code)
    ("completions", "{not json", 400, None, "invalid_json"),
    ("completions", [1, 2], 400, None, None),
    ("completions", {"prompt": ""}, 400, "prompt", None),
    ("completions", {"prompt": []}, 400, "prompt", None),
    ("completions", {}, 400, "prompt", None),
    ("completions", {"prompt": [1, 512]}, 400, "prompt", None),
    ("completions", {"prompt": [1, -3]}, 400, "prompt", None),
    ("completions", {"prompt": [[1, 2]]}, 400, "prompt", None),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ("completions", {"prompt": "x", "max_tokens": -5}, 400, "max_tokens", None),
    ("completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens", None),
    ("completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature", None),
    ("completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", None),
    ("completions", {"prompt": "x", "top_p": 0}, 400, "top_p", None),
    ("completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p", None),
    ("completions", {"prompt": "x", "top_k": "all"}, 400, "top_k", None),
    ("completions", {"prompt": "x", "seed": -1}, 400, "seed", None),
    ("completions", {"prompt": "x", "stop": 7}, 400, "stop", None),
    ("completions", {"prompt": "x", "stop_token_ids": [9999]}, 400, "stop_token_ids", None),
    ("completions", {"prompt": "x", "stream": "yes"}, 400, "stream", None),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ("completions", {"prompt": "x", "logprobs": 99}, 400, "logprobs", None),
    ("completions", {"prompt": "x", "n": 5}, 400, "n", None),
    ("completions", {"prompt": "x", "n": 0}, 400, "n", None),
    ("completions", {"prompt": "x", "echo": True}, 400, "echo", "unsupported_parameter"),
    ("completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("completions", {"prompt": "x", "model": 3}, 400, "model", None),
    ("completions", {"prompt": [1] * 1000, "max_tokens": 100}, 400, "max_tokens", "context_length_exceeded"),
    ("chat/completions", {"messages": "hi"}, 400, "messages", None),
    ("chat/completions", {"messages": []}, 400, "messages", None),
    ("chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, 400, "messages[0].role", None),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", None),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs", None),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2000}, 400,
     "max_tokens", "context_length_exceeded"),
]


@pytest.mark.parametrize("route,body,status,param,code", ERRORS)
def test_errors_have_openai_shape_and_server_keeps_serving(url, route, body, status, param, code):
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    r = httpx.post(f"{url}/v1/{route}", timeout=T, headers={"content-type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param and (code is None or err["code"] == code)
    if param:
        assert param in err["message"] or err["code"] == "model_not_found"
    if code == "context_length_exceeded":
        assert "1024" in err["message"] and ("1000" in err["message"] or "2000" in err["message"])
    _ok(url)


def test_unknown_route_and_method_are_openai_errors(url):
    for r in (httpx.get(url + "/v1/nope", timeout=T), httpx.get(url + "/v1/completions", timeout=T)):
        assert r.status_code in (404, 405) and set(r.json()["error"]) == {"message", "type", "param", "code"}
    _ok(url)


def test_queue_full_is_503_with_retry_after(tiny_llama, serve_http):
    eng = _engine(tiny_llama, max_seqs=1, max_wave_tokens=16, max_queue=1)
    try:
        with serve_http(_app(eng, tiny_llama)) as base:
            hog = SamplingParams(max_tokens=900, ignore_eos=True)
            hogs = [eng.submit([1, 2, 3], hog)]
            deadline = time.monotonic() + 30
            while eng.stats().running < 1 and time.monotonic() < deadline:  # the first runs, the next waits
                time.sleep(0.01)
            hogs.append(eng.submit([1, 2, 3], hog))
            r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=T)
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "queue_full"
            assert httpx.get(base + "/health", timeout=T).json() == {"status": "ok"}  # the probe takes no place
            metrics = httpx.get(base + "/metrics", timeout=T).text
            assert 'wavemesh_requests_rejected_total{reason="queue_full"}' in metrics
            for h in hogs:
                eng.cancel(h.request_id)
            _ok(base)
            assert httpx.get(base + "/health", timeout=T).json() == {"status": "ok"}
            _idle(eng)
            eng.close()
            assert httpx.get(base + "/health", timeout=T).status_code == 503  # a closed engine is unhealthy
    finally:
        eng.close()


def test_a_kv_pool_shorter_than_the_context_bounds_the_default_max_tokens(tiny_llama, serve_http):
    """A chat without max_tokens may fill the context (OpenAI's default), but no further than the route's KV pool
    holds: 20 blocks of 16 tokens (320) here, against the model's 1,024. It is served, not refused."""
    cfg = ModelConfig.from_dir(tiny_llama)
    per_block = 16 * cfg.num_hidden_layers * cfg.kv_bytes_per_token_layer * 4  # float32
    station = Station(tiny_llama, StationSpec(layers=(0, cfg.num_hidden_layers), kv_bytes=20 * per_block))
    eng = Engine([LocalLink(station)], cfg, SchedulerConfig(), Tokenizer.from_file(str(tiny_llama / "tokenizer.json")))
    try:
        with serve_http(_app(eng, tiny_llama)) as base:
            assert eng.max_context() == 320 < cfg.max_position_embeddings
            assert httpx.get(base + "/v1/models", timeout=T).json()["data"][0]["max_model_len"] == 320
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "temperature": 0,
                    "ignore_eos": True}
            r = httpx.post(base + "/v1/chat/completions", json=body, timeout=T)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            assert r.json()["choices"][0]["finish_reason"] == "length"
            assert usage["prompt_tokens"] + usage["completion_tokens"] == 320
            long_ids = {"model": MODEL, "prompt": [5] * 321, "max_tokens": 1}
            r = httpx.post(base + "/v1/completions", json=long_ids, timeout=T)
            assert r.status_code == 400 and "321 tokens exceed the context of 320" in r.json()["error"]["message"]
    finally:
        eng.close()


def _metrics(url) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics", timeout=T).text
    assert "_created" not in text  # no creation-timestamp series beside the counters and histograms
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _total(m, name, **labels) -> float:
    return sum(v for (n, lab), v in m.items() if n == name and all(dict(lab).get(k) == x for k, x in labels.items()))


def test_100_streams_10_disconnect_and_metrics_agree(url, engine):
    prompts = [[1] + [(31 * i + 7 * j) % 400 + 20 for j in range(3 + i % 9)] for i in range(20)]
    expected = [_ok(url, prompt=p, max_tokens=10, ignore_eos=True, return_token_ids=True)["choices"][0]["token_ids"]
                for p in prompts]
    before, finished_before = _metrics(url), dict(engine.stats().finished)
    leavers = {i for i in range(100) if i % 10 == 3}

    async def one(http: httpx.AsyncClient, i: int):
        leave = i in leavers
        body = {"model": MODEL, "prompt": prompts[i % 20], "stream": True, "ignore_eos": True,
                "max_tokens": 900 if leave else 10, "return_token_ids": True,
                "stream_options": {"include_usage": True}}
        ids, usage, events = [], None, 0
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk, events = json.loads(line[6:]), events + 1
                usage = chunk.get("usage") or usage
                for c in chunk["choices"]:
                    ids += c["token_ids"]
                if leave and events == 3:
                    return None  # leaving the block closes the connection mid-stream
        return ids, usage

    async def main():
        async with httpx.AsyncClient(timeout=T, limits=httpx.Limits(max_connections=200)) as http:
            return await asyncio.wait_for(asyncio.gather(*(one(http, i) for i in range(100))), 120)

    results = asyncio.run(main())
    for i, res in enumerate(results):
        if i not in leavers:
            assert res[0] == expected[i % 20], i
            assert res[1]["completion_tokens"] == 10
    deadline = time.monotonic() + 30
    while (engine.stats().running or engine.stats().waiting) and time.monotonic() < deadline:
        time.sleep(0.05)
    _idle(engine)
    finished = engine.stats().finished
    assert finished.get("cancelled", 0) - finished_before.get("cancelled", 0) == 10
    after = _metrics(url)

    def delta(name, **labels):
        return _total(after, name, **labels) - _total(before, name, **labels)

    assert delta("wavemesh_request_success_total", finished_reason="length") == 90
    assert delta("wavemesh_request_success_total", finished_reason="cancelled") == 10
    cancelled_tokens = delta("wavemesh_generation_tokens_total") - 900
    assert 10 * 2 <= cancelled_tokens < 10 * 900  # the leavers stopped early
    assert delta("wavemesh_prompt_tokens_total") == sum(len(prompts[i % 20]) for i in range(100))
    assert delta("wavemesh_time_to_first_token_seconds_count") == 100
    assert delta("wavemesh_inter_token_latency_seconds_count") >= 90 * 9
    assert after[("wavemesh_num_requests_running", ())] == 0 and after[("wavemesh_kv_cache_usage_perc", ())] == 0


def test_non_streaming_client_that_leaves_cancels(url, engine, monkeypatch):
    """The station holds its waves until the request is cancelled, so it cannot finish first however fast."""
    cancelled = engine.stats().finished.get("cancelled", 0)
    station, gate = engine.pipeline.links[0].station, threading.Event()
    real = station.forward
    monkeypatch.setattr(station, "forward", lambda *a, **k: (gate.wait(30), real(*a, **k))[1])
    try:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
            httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 900, "ignore_eos": True},
                       timeout=httpx.Timeout(T, read=0.3))
        deadline = time.monotonic() + 30
        while engine.stats().finished.get("cancelled", 0) == cancelled and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        gate.set()
    assert engine.stats().finished.get("cancelled", 0) == cancelled + 1
    _idle(engine)
    _ok(url)


def test_metrics_counters_match_responses(url, client):
    before = _metrics(url)
    reported, choices = 0, 0
    for i in range(4):
        r = _ok(url, prompt=f"The mill {i}", max_tokens=3 + i, n=1 + i % 2, temperature=0.7, seed=i)
        reported, choices = reported + r["usage"]["completion_tokens"], choices + len(r["choices"])
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                            stream=True, stream_options={"include_usage": True})
    reported += next(c.usage for c in stream if c.usage).completion_tokens
    choices += 1
    bad = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 0}, timeout=T)
    assert bad.status_code == 400
    after = _metrics(url)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert delta[("wavemesh_generation_tokens_total", ())] == reported
    assert _total(after, "wavemesh_request_success_total") - _total(before, "wavemesh_request_success_total") == choices
    assert delta[("wavemesh_e2e_request_latency_seconds_count", ())] == 5
    assert delta[("wavemesh_requests_rejected_total", (("reason", "invalid"),))] == 1
    for name in ("wavemesh_num_requests_waiting", "wavemesh_wave_tokens_count", "wavemesh_num_preemptions_total"):
        assert any(k[0] == name for k in after), name


def test_api_key_guards_every_route_but_health_and_metrics(engine, tiny_llama, serve_http):
    app = _app(engine, tiny_llama, api_key=KEY)
    routes = [(r.path, m) for r in app.routes for m in sorted(getattr(r, "methods", None) or ()) if m != "HEAD"]
    assert {p for p, _ in routes} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/status",
                                      "/health", "/metrics"}
    body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with serve_http(app) as base:
        for path, method in routes + [("/no/such/route", "GET")]:
            target = base + path.replace("{model_id:path}", MODEL)
            kw = {"json": body} if method == "POST" else {}
            anon = httpx.request(method, target, timeout=T, **kw)
            wrong = httpx.request(method, target, timeout=T, headers={"Authorization": "Bearer nope"}, **kw)
            keyed = httpx.request(method, target, timeout=T, headers={"Authorization": f"Bearer {KEY}"}, **kw)
            if path in OPEN_PATHS:
                assert anon.status_code == 200, path
            else:
                assert anon.status_code == wrong.status_code == 401, (method, path)
                assert anon.json()["error"]["code"] == "invalid_api_key"
            if path.startswith("/v1") or path in OPEN_PATHS:
                assert keyed.status_code == 200, (method, path, keyed.text)
            else:
                assert keyed.status_code != 401, (method, path)
        keyed_client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=T)
        assert keyed_client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0, timeout=T).models.list()


def test_station_metrics_render(tiny_llama):
    station = Station(tiny_llama, StationSpec(layers=(0, 6)))
    wire = {"in": 120, "out": 4096}
    text = StationMetrics(station, {"station": "s0"}, wire=lambda: wire).render().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    lab = (("layers", "0-6"), ("station", "s0"))
    assert samples[("wavemesh_station_kv_bytes_used", lab)] == 0
    assert samples[("wavemesh_station_kv_bytes_total", lab)] > 0
    assert samples[("wavemesh_station_wire_bytes_total", tuple(sorted(lab + (("direction", "out"),))))] == 4096
    assert ("wavemesh_station_forward_seconds_total", tuple(sorted(lab + (("phase", "decode"),)))) in samples


# what Prometheus 2.x and 3.x send: OpenMetrics first (prometheus_client would then answer with colons escaped)
SCRAPER_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                  "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
                  "application/openmetrics-text;version=1.0.0;escaping=underscores;q=0.6,"
                  "text/plain;version=1.0.0;escaping=underscores;q=0.5,*/*;q=0.1", None)


def test_every_metrics_endpoint_answers_text_0_0_4_whatever_the_scraper_asks(url, tiny_llama):
    """The orchestrator's /metrics and a station's endpoint answer the same names, none with a colon, in the
    text format 0.0.4 to an OpenMetrics Accept header too: Prometheus stores one spelling (issue 17 item 11)."""
    endpoint = StationMetrics(Station(tiny_llama, StationSpec(layers=(0, 6)))).serve()
    try:
        for base in (url, f"http://127.0.0.1:{endpoint.server_port}"):
            names = []
            for accept in SCRAPER_ACCEPT:
                r = httpx.get(base + "/metrics", headers={"Accept": accept} if accept else {}, timeout=T)
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
                names.append({s.name for fam in text_string_to_metric_families(r.text) for s in fam.samples})
            assert names[0] == names[1] == names[2] and names[0], base
            assert all(n.startswith("wavemesh_") and ":" not in n for n in names[0]), sorted(names[0])
    finally:
        endpoint.shutdown()
        endpoint.server_close()


def test_request_record_feeds_histograms():
    from orchestrator.metrics import MetricsRegistry

    reg = MetricsRegistry()
    reg.observe_request(RequestRecord(5, 3, ("stop",), 0.01, 0.2, None, (0.01, 0.02)))
    reg.observe_wave(12, 12 / 512, 0.004)
    fams = {f.name: f for f in text_string_to_metric_families(reg.render().decode())}
    assert fams["wavemesh_generation_tokens"].samples[0].value == 3
    assert {s.name: s.value for s in fams["wavemesh_inter_token_latency_seconds"].samples}[
        "wavemesh_inter_token_latency_seconds_count"] == 2
    assert {s.name: s.value for s in fams["wavemesh_wave_tokens"].samples}["wavemesh_wave_tokens_sum"] == 12


def test_usage_reports_prompt_tokens_served_from_the_prefix_cache(client, url):
    """A prompt whose first full blocks another request computed reports them as cached, plain and streamed."""
    prompt = [7] + [(17 * j) % 400 + 11 for j in range(39)]  # 40 tokens: 2 full blocks of 16 can be reused
    ask = dict(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    first = client.completions.create(**ask)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(**ask)
    assert again.usage.prompt_tokens_details.cached_tokens == 32
    assert again.choices[0].text == first.choices[0].text
    streamed = [c.usage for c in client.completions.create(stream=True, stream_options={"include_usage": True}, **ask)
                if c.usage is not None]
    assert streamed[-1].prompt_tokens_details.cached_tokens == 32
    status = httpx.get(url + "/v1/status", timeout=T).json()["engine"]
    assert status["prefix_cache"] and status["prefix_cache_hits"] >= 64
    metrics = httpx.get(url + "/metrics", timeout=T).text
    assert "wavemesh_prefix_cache_hits_total" in metrics and "wavemesh_prefix_cache_blocks" in metrics
