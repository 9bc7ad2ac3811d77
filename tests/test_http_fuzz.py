"""Hostile HTTP bodies against the OpenAI routes, in process over a real Engine (tiny model): never a 5xx.

Hypothesis draws bodies field by field from the request schemas of /v1/completions and
/v1/chat/completions, each field either good or hostile (wrong types, huge and negative
numbers, NaN / Infinity, lone surrogates, nested JSON), plus raw bodies that are not JSON at
all. Every answer is below 500, errors keep OpenAI's shape, and afterwards the engine is idle
with no KV held and a normal request still succeeds. Good max_tokens values stay small and
hostile ones never land in [1, 1024], so a valid body costs a handful of decode steps.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient
from tokenizers import Tokenizer

from mesh.core.config import ApiConfig, ModelConfig, SchedulerConfig, StationSpec
from orchestrator.api import MAX_BODY_BYTES, create_app
from orchestrator.engine import Engine
from orchestrator.pipeline import LocalLink
from station.step import Station

MODEL, VOCAB, CONTEXT = "tiny-llama", 512, 1024
FUZZ = settings(deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def engine(tiny_llama):
    cfg = ModelConfig.from_dir(tiny_llama)
    links = [LocalLink(Station(tiny_llama, StationSpec(layers=(0, cfg.num_hidden_layers), kv_bytes=64 * 2**20)))]
    eng = Engine(links, cfg, SchedulerConfig(max_seqs=32, max_wave_tokens=512, max_queue=256),
                 Tokenizer.from_file(str(tiny_llama / "tokenizer.json")))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def client(engine, tiny_llama):
    tok = Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))
    template = json.loads((tiny_llama / "tokenizer_config.json").read_text())["chat_template"]
    app = create_app(engine, tok, template, MODEL, ApiConfig(max_n=4))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def post(client: TestClient, route: str, body: bytes):
    """POST raw bytes as JSON; check the answer is no 5xx and has OpenAI's shape."""
    r = client.post(f"/v1/{route}", content=body, headers={"content-type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text[:500], body[:300])
    if r.status_code >= 400:
        assert set(r.json()["error"]) == ERROR_KEYS, r.text[:300]
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
    else:
        assert r.json()["choices"], r.text[:300]
    return r


def assert_still_serving(client: TestClient, engine: Engine) -> None:
    """Nothing left running or holding KV, and a normal request works."""
    assert engine.quiesce(30)
    s = engine.stats()
    assert (s.running, s.waiting, s.kv_bytes_used) == (0, 0, 0), s
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "The river ran", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text


# ---- values --------------------------------------------------------------------------------------

SURROGATE = st.sampled_from(["\ud800", "\udfff", "a\udc80b", "\ud83d"])  # lone halves: no UTF-8 form
TEXT = st.text(max_size=40) | st.text(st.characters(codec="utf-8"), max_size=10).map(lambda s: s + "\U0001f600")
NUMBER = (st.integers() | st.integers(min_value=2**63 - 2, max_value=2**70) | st.integers(max_value=-2**63)
          | st.floats() | st.sampled_from([10**400, -(10**400), 1e308, -0.0, 5e-324]))
JSON = st.recursive(st.none() | st.booleans() | NUMBER | TEXT,  # surrogates are added where they are aimed
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
                    max_leaves=12)
# max_tokens: small when good; when hostile never a count a valid request could run for long
MAX_TOKENS_GOOD = st.integers(1, 4)
MAX_TOKENS_BAD = (st.integers(max_value=0) | st.integers(min_value=CONTEXT + 1) | st.floats().filter(
    lambda f: not (1 <= f <= CONTEXT)) | st.booleans() | TEXT | SURROGATE | st.lists(st.integers(1, 4), max_size=2)
    | st.dictionaries(TEXT, st.integers(), max_size=2) | st.sampled_from([1.5, 2.25, "3", 10**400]))
TOKEN_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)
BAD_TOKEN_IDS = st.lists(st.integers(-2**64, 2**64) | st.floats() | TEXT | st.lists(st.integers(0, 5), max_size=3),
                         max_size=20) | st.just([1] * (CONTEXT + 5))

SAMPLING = {  # field: (good values, hostile values)
    "max_tokens": (MAX_TOKENS_GOOD, MAX_TOKENS_BAD),
    "temperature": (st.sampled_from([0, 0.0, 0.7, 1.0, 2]), NUMBER | TEXT | JSON),
    "top_p": (st.sampled_from([1, 1.0, 0.9, 1e-30]), NUMBER | TEXT | JSON),
    "top_k": (st.sampled_from([-1, 0, 1, 5, 2**40]), NUMBER | TEXT | JSON),
    "seed": (st.integers(0, 2**63 - 1), NUMBER | TEXT | JSON),
    "n": (st.integers(1, 4), NUMBER | TEXT | JSON),
    "stop": (st.none() | st.just("\n") | st.lists(st.text(min_size=1, max_size=5), max_size=3),
             JSON | SURROGATE | st.lists(SURROGATE, max_size=2)),
    "stop_token_ids": (st.lists(st.integers(0, VOCAB - 1), max_size=3), JSON),
    "stream": (st.booleans(), JSON),
    "stream_options": (st.none(), JSON),  # a good one is added below when stream is true
    "ignore_eos": (st.booleans(), JSON),
    "return_token_ids": (st.booleans(), JSON),
    "model": (st.just(MODEL), JSON),
    "user": (TEXT, JSON | SURROGATE),
    "echo": (st.just(False), JSON),
    "logit_bias": (st.just({}), JSON),
}
COMPLETION_ONLY = {"logprobs": (st.integers(0, 20) | st.none(), JSON),
                   "prompt": (TEXT.filter(bool) | TOKEN_IDS, JSON | BAD_TOKEN_IDS | SURROGATE)}
CHAT_ONLY = {"logprobs": (st.just(True), JSON), "top_logprobs": (st.integers(0, 20), JSON)}
ROLES = st.sampled_from(["system", "user", "assistant", "tool", "developer"])
GOOD_MESSAGE = st.fixed_dictionaries({"role": ROLES, "content": TEXT | st.lists(st.fixed_dictionaries(
    {"type": st.just("text"), "text": TEXT}), max_size=3)}, optional={"name": TEXT})
BAD_MESSAGE = JSON | st.fixed_dictionaries({"role": JSON | TEXT, "content": JSON}) | st.fixed_dictionaries(
    {"role": ROLES, "content": JSON | SURROGATE | st.lists(JSON, max_size=3)})


@st.composite
def bodies(draw, fields: dict) -> dict:
    """A body whose schema fields are absent or good, except none (clean), one, or several hostile ones."""
    mode = draw(st.sampled_from(["clean", "one", "one", "several"]))
    target = draw(st.sampled_from(sorted(fields))) if mode == "one" else None
    body: dict = {}
    for name, (good, hostile) in fields.items():
        if name == target or (mode == "several" and draw(st.integers(0, 3)) == 0):
            body[name] = draw(hostile)
        elif name == "max_tokens" or draw(st.booleans()):
            body[name] = draw(good)
    if draw(st.integers(0, 3)) == 0:
        extra = draw(st.dictionaries(TEXT, JSON, max_size=3))  # unknown keys are ignored
        body.update({k: v for k, v in extra.items() if k not in fields})
    return body


@st.composite
def completion_bodies(draw) -> dict:
    body = draw(bodies({**SAMPLING, **COMPLETION_ONLY}))
    if body.get("stream") is True and body.get("stream_options") is None and draw(st.booleans()):
        body["stream_options"] = {"include_usage": True}
    body.setdefault("prompt", "Once upon")
    return body


@st.composite
def chat_bodies(draw) -> dict:
    body = draw(bodies({**SAMPLING, **CHAT_ONLY}))
    if body.get("stream") is True and body.get("stream_options") is None and draw(st.booleans()):
        body["stream_options"] = {"include_usage": True}
    pick = draw(st.integers(0, 3))
    if pick == 0:
        body["messages"] = draw(JSON | st.lists(BAD_MESSAGE, max_size=3))
    else:
        body["messages"] = draw(st.lists(GOOD_MESSAGE if pick > 1 else GOOD_MESSAGE | BAD_MESSAGE,
                                         min_size=1, max_size=4))
    if body.get("max_tokens") is None:  # chat's default is the whole remaining context: keep it short
        body["max_tokens"] = 2
    return body


def encode(body) -> bytes:
    """JSON bytes, lone surrogates escaped (`\\ud800`) as a hostile client would send them."""
    return json.dumps(body).encode()  # ensure_ascii: surrogates become \\udXXX escapes; NaN -> NaN


RAW = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=100).map(str.encode),
    st.integers(1, 200_000).map(lambda d: b"[" * d + b"]" * d),  # nesting past the JSON parser's recursion limit
    st.integers(1, 200_000).map(lambda d: b'{"prompt": ' + b"[" * d + b"1" + b"]" * d + b"}"),
    st.integers(1, 100_000).map(lambda d: b'{"messages": [' + b'{"a": ' * d + b"1" + b"}" * d + b"]}"),
    st.integers(4000, 20_000).map(lambda d: b'{"prompt": "x", "max_tokens": 1' + b"0" * d + b"}"),
    st.sampled_from([b"", b"null", b"[]", b"1", b'"x"', b"NaN", b"\xff\xfe\x00", b'{"prompt": "\xed\xa0\x80"}',
                     b'{"prompt": "x", "max_tokens": 2', b'{"prompt": "x"}}', b'{"prompt": "x", "prompt": 3}',
                     b'\xef\xbb\xbf{"prompt": "x", "max_tokens": 2}', b'{"prompt": "\\ud800", "max_tokens": 2}']),
    JSON.map(encode),
)


# ---- tests ----------------------------------------------------------------------------------------

def test_completions_fuzz(client, engine):
    @settings(FUZZ, max_examples=1200)
    @given(body=completion_bodies())
    def fuzz(body):
        post(client, "completions", encode(body))

    fuzz()
    assert_still_serving(client, engine)


def test_chat_fuzz(client, engine):
    @settings(FUZZ, max_examples=1000)
    @given(body=chat_bodies())
    def fuzz(body):
        post(client, "chat/completions", encode(body))

    fuzz()
    assert_still_serving(client, engine)


def test_raw_body_fuzz(client, engine):
    @settings(FUZZ, max_examples=600)
    @given(route=st.sampled_from(["completions", "chat/completions"]), body=RAW)
    def fuzz(route, body):
        r = post(client, route, body)
        assert r.status_code != 200 or body.lstrip(b"\xef\xbb\xbf").startswith(b"{")

    fuzz()
    assert_still_serving(client, engine)


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_oversized_body_is_413(client, engine, route):
    big = b'{"prompt": "' + b"a" * (20 * 2**20) + b'"}'
    r = post(client, route, big)  # Content-Length says 20 MB: refused before reading
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: refused once the bytes read pass the limit
        for i in range(0, len(big), 2**20):
            yield big[i:i + 2**20]

    r = client.post(f"/v1/{route}", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text[:300]
    ids = b"[" + b"1, " * ((MAX_BODY_BYTES - 100) // 3) + b"1]"  # just under the limit: read and parsed
    field = "prompt" if route == "completions" else "messages"
    r = post(client, route, b'{"' + field.encode() + b'": ' + ids + b', "max_tokens": 1}')
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(field), r.text[:300]
    assert_still_serving(client, engine)


@pytest.mark.parametrize("body, param", [
    (b'{"prompt": "\\ud800abc", "max_tokens": 2}', None),
    (b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}', None),
    (b"[" * 100_000 + b"]" * 100_000, None),
    (b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", None),
    (b'{"prompt": "x", "max_tokens": 1e400}', "max_tokens"),
    (b'{"prompt": "x", "temperature": NaN}', "temperature"),
    (b'{"prompt": "x", "top_p": -Infinity}', "top_p"),
])
def test_known_hostile_bodies_are_400(client, body, param):
    route = "chat/completions" if b"messages" in body else "completions"
    r = post(client, route, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text[:300]
