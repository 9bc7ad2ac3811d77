"""Front-door figures (issue 17 items 6-8): the red team's probes, timed against an in-process engine over uvicorn.

    python bench/front_door.py [--model DIR]   (default: a synthetic tiny llama in a temp folder)

1. a 7.9 MB prompt: seconds to its answer, the slowest GET /v1/models sent meanwhile, the process's RSS after;
2. 10^5 empty chat messages: the same;
3. 40 streams at once to max_seqs 16 / max_queue 8: how many were admitted;
4. 32 keyless /health loops beside 69 keyed requests (max_seqs 16, max_queue 8): keyed requests refused.
Figures are printed, never asserted; the last line is one JSON object.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import _serve_http  # noqa: E402  (the tests' loopback uvicorn helper)

from mesh.core.config import ApiConfig, ModelConfig, SchedulerConfig, StationSpec  # noqa: E402
from mesh.core.model.synthetic import init_model  # noqa: E402
from orchestrator.api import create_app  # noqa: E402
from orchestrator.engine import Engine  # noqa: E402
from orchestrator.pipeline import LocalLink  # noqa: E402
from station.step import Station  # noqa: E402


def rss_mb() -> float:
    """This process's resident set, MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def while_models(http: httpx.AsyncClient, base: str, route: str, body: dict) -> dict:
    """POST `body`; meanwhile GET /v1/models every 50 ms. Seconds to the POST's answer and the slowest GET."""
    t0 = time.monotonic()
    post = asyncio.ensure_future(http.post(f"{base}/v1/{route}", json=body))
    slowest = 0.0
    while not post.done():
        t = time.monotonic()
        await http.get(base + "/v1/models")
        slowest = max(slowest, time.monotonic() - t)
        await asyncio.sleep(0.05)
    r = await post
    return {"status": r.status_code, "answer_s": round(time.monotonic() - t0, 3), "slowest_models_s": round(slowest, 3),
            "message": r.json().get("error", {}).get("message", "")[:160], "rss_mb": round(rss_mb())}


async def burst(http: httpx.AsyncClient, base: str, n: int) -> dict:
    """`n` streaming completions at once: statuses once every stream has answered its headers."""
    body = {"prompt": "The river ran", "max_tokens": 64, "ignore_eos": True, "stream": True}

    async def one() -> int:
        async with http.stream("POST", base + "/v1/completions", json=body) as r:
            await r.aread()
            return r.status_code

    codes = await asyncio.gather(*(one() for _ in range(n)))
    return {"sent": n, "admitted": codes.count(200), "refused": codes.count(503)}


async def health_beside_keyed(http: httpx.AsyncClient, base: str, key: str) -> dict:
    """32 keyless /health loops while 69 keyed completions are sent in 3 waves of 23."""
    stop = asyncio.Event()

    async def loop() -> int:
        calls = 0
        while not stop.is_set():
            await http.get(base + "/health")
            calls += 1
        return calls

    loops = [asyncio.ensure_future(loop()) for _ in range(32)]
    codes = []
    for _ in range(3):
        codes += [r.status_code for r in await asyncio.gather(*(
            http.post(base + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"prompt": "The river ran", "max_tokens": 16, "ignore_eos": True}) for _ in range(23)))]
    stop.set()
    return {"keyed": len(codes), "keyed_refused": codes.count(503), "health_calls": sum(await asyncio.gather(*loops))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    args = ap.parse_args()
    model_dir = args.model or init_model(Path(tempfile.mkdtemp()) / "tiny-llama", "tiny", "llama")
    from tokenizers import Tokenizer

    cfg = ModelConfig.from_dir(model_dir)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    template = json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template")
    station = Station(model_dir, StationSpec(layers=(0, cfg.num_hidden_layers), kv_bytes=64 * 2**20))
    engine = Engine([LocalLink(station)], cfg, SchedulerConfig(max_seqs=16, max_queue=8, max_wave_tokens=256), tok)
    out = {"rss_start_mb": round(rss_mb())}
    try:
        with _serve_http(create_app(engine, tok, template, "tiny", ApiConfig(api_key="k"))) as base:
            async def run() -> None:
                async with httpx.AsyncClient(timeout=120, headers={"Authorization": "Bearer k"},
                                             limits=httpx.Limits(max_connections=128)) as http:
                    out["huge_prompt"] = await while_models(http, base, "completions",
                                                            {"prompt": "a" * 7_900_000, "max_tokens": 2})
                    out["empty_messages"] = await while_models(
                        http, base, "chat/completions",
                        {"messages": [{"role": "user", "content": ""}] * 100_000, "max_tokens": 2})
                    out["burst_40"] = await burst(http, base, 40)
                    out["burst_64"] = await burst(http, base, 64)
                async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=128)) as http:
                    out["health"] = await health_beside_keyed(http, base, "k")

            asyncio.run(run())
    finally:
        engine.close()
    for k, v in out.items():
        print(f"{k}: {v}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
