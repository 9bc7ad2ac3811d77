"""Soak: rounds of streaming clients against `mesh up`, with stations killed along the way.

Each round sends concurrent streaming completions with random max_tokens (one in
three clients leaves mid-stream) plus a greedy canary whose tokens must never
change; every `--kill-every` rounds one station process is SIGKILLed. At the
end, KV must be back to zero and the server log free of tracebacks.

    python bench/soak.py [--rounds 12 --clients 12 --kill-every 3 --max-tokens 64] [--model DIR]
Prints a table of figures and, last, one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))  # also when run through `mesh bench soak`
from server_process import free_port, start_server, stop_server  # noqa: E402


def _model_dir(arg: str | None) -> str:
    if arg:
        return arg
    sys.path.insert(0, str(ROOT))
    from mesh.control.cli import resolve_model

    return str(resolve_model(None, "tiny"))


def start_mesh(model: str, stations: int, kills: int, workdir: Path) -> tuple[subprocess.Popen, str, Path]:
    """`mesh up` on a temporary YAML; returns (process, base URL, log path) once healthy."""
    port = free_port()
    cfg = workdir / "soak.yaml"
    cfg.write_text(f"model: {{path: {model}}}\nstations: {{count: {stations}}}\n"
                   f"scheduler: {{max_seqs: 32, max_wave_tokens: 256, max_queue: 512}}\n"
                   f"api: {{host: 127.0.0.1, port: {port}}}\n"
                   f"cluster: {{call_timeout_s: 5, restart_timeout_s: 90, max_restarts: {kills + 2}}}\n")
    log, url = workdir / "mesh-up.log", f"http://127.0.0.1:{port}"
    proc = start_server([sys.executable, "-m", "mesh.control.cli", "up", str(cfg)], url, log, "mesh up", 300)
    return proc, url, log


def stream_client(url: str, prompt: str, max_tokens: int, leave_after: int | None, out: dict) -> None:
    """One streaming completion; leaves after `leave_after` chunks when set. Records the outcome in `out`."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.8,
            "seed": random.randrange(1 << 30), "ignore_eos": True}
    chunks, finish = 0, None
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            if r.status_code != 200:
                out["outcome"] = f"http {r.status_code}"
                return
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    out["outcome"] = f"error: {data['error'].get('message')}"
                    return
                chunks += 1
                finish = data["choices"][0].get("finish_reason") if data.get("choices") else finish
                if leave_after is not None and chunks >= leave_after:
                    out["outcome"] = "left"
                    return
    except httpx.HTTPError as e:
        out["outcome"] = f"transport: {e}"
        return
    out["outcome"] = "completed" if finish == "length" else f"finish {finish}"


def canary(url: str) -> tuple[list[int], float]:
    """A short greedy request: its token ids and latency."""
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", timeout=300, json={"prompt": "The canary sings", "max_tokens": 12,
                                                               "temperature": 0, "return_token_ids": True})
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"], time.monotonic() - t0


def kill_station(url: str, rng: random.Random) -> int:
    """SIGKILL one station process of this cluster (pid from /v1/status); returns the pid."""
    stations = httpx.get(url + "/v1/status", timeout=60).json()["stations"]
    pids = [s["pid"] for s in stations if s.get("pid")]
    pid = rng.choice(pids)
    os.kill(pid, signal.SIGKILL)
    return pid


def wait_idle(url: str, timeout: float = 120.0) -> dict:
    """Poll /v1/status until nothing runs or waits and station KV is back to zero."""
    deadline = time.monotonic() + timeout
    engine = {}
    while time.monotonic() < deadline:
        engine = httpx.get(url + "/v1/status", timeout=60).json()["engine"]
        if engine["running"] == 0 and engine["waiting"] == 0 and engine["kv_bytes_used"] == 0:
            break
        time.sleep(0.5)
    return engine


def main() -> None:
    """Run the soak and print its figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--kill-every", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--stations", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    kills_planned = max(0, (args.rounds - 1) // args.kill_every)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url, log = start_mesh(_model_dir(args.model), args.stations, kills_planned, Path(tmp))
        try:
            reference, _ = canary(url)
            outcomes, canary_s, canary_bad, killed = [], [], 0, []
            for r in range(args.rounds):
                if r > 0 and r % args.kill_every == 0:
                    killed.append(kill_station(url, rng))
                results = [{} for _ in range(args.clients)]
                threads = [threading.Thread(target=stream_client, args=(
                    url, f"round {r} client {i} says", rng.randint(4, args.max_tokens),
                    rng.randint(1, 3) if i % 3 == 0 else None, results[i])) for i in range(args.clients)]
                for t in threads:
                    t.start()
                ids, seconds = canary(url)
                canary_s.append(seconds)
                canary_bad += ids != reference
                for t in threads:
                    t.join(timeout=600)
                outcomes += [res.get("outcome", "no answer") for res in results]
                print(f"round {r}: " + ", ".join(f"{k} {outcomes[-args.clients:].count(k)}"
                                                 for k in sorted(set(outcomes[-args.clients:]))), flush=True)
            engine = wait_idle(url)
        finally:
            stop_server(proc)
        text = log.read_text(errors="replace")
    failures = [o for o in outcomes if o not in ("completed", "left")]
    q = statistics.quantiles(canary_s, n=100) if len(canary_s) > 1 else canary_s * 99
    figures = {
        "rounds": args.rounds, "requests": len(outcomes) + args.rounds, "completed": outcomes.count("completed"),
        "left": outcomes.count("left"), "failures": len(failures), "failure_kinds": sorted(set(failures)),
        "kills": len(killed), "canary_mismatches": canary_bad,
        "canary_p50_s": round(statistics.median(canary_s), 3), "canary_p99_s": round(q[98], 3),
        "recovery_seconds": [round(x, 2) for x in engine.get("recovery_seconds", [])],
        "kv_bytes_used_end": engine.get("kv_bytes_used"), "running_end": engine.get("running"),
        "tracebacks": text.count("Traceback"), "exit_code": proc.returncode,
    }
    for k, v in figures.items():
        print(f"{k:>20}: {v}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
