"""The `mesh` subcommands that talk to a running cluster's orchestrator over HTTP: status, scale, add-station, chat.

They find it at --url, else where `mesh up --detach` left its address (mesh-up.json under $WAVEMESH_CACHE), else
127.0.0.1:8000; WAVEMESH_API_KEY, where set, is sent as the bearer token.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def wavemesh_cache() -> Path:
    """$WAVEMESH_CACHE (default ~/.cache/wavemesh): the embedded model, packed weights, a detached cluster's state."""
    return Path(os.environ.get("WAVEMESH_CACHE", Path.home() / ".cache" / "wavemesh"))


def _url(args: argparse.Namespace) -> str:
    if args.url:
        return args.url.rstrip("/")
    state = wavemesh_cache() / "mesh-up.json"
    return json.loads(state.read_text())["url"] if state.is_file() else "http://127.0.0.1:8000"


def _call(args: argparse.Namespace, path: str, body: dict | None = None) -> dict:
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json"}
    key = os.environ.get("WAVEMESH_API_KEY")
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(_url(args) + path, data=data, headers=headers, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise ValueError(f"{path}: HTTP {e.code}: {e.read().decode(errors='replace')}") from None
    except urllib.error.URLError as e:
        raise ValueError(f"cannot reach the orchestrator at {_url(args)}: {e.reason}") from None


def cmd_chat(args: argparse.Namespace) -> int:
    """Chat with a running cluster in the terminal (streamed replies, the conversation kept)."""
    from mesh.control.chat import ChatSettings, chat_loop

    settings = ChatSettings(_url(args), args.system, os.environ.get("WAVEMESH_API_KEY"), args.max_tokens,
                            args.temperature, args.timeout)
    return chat_loop(settings)


def cmd_status(args: argparse.Namespace) -> int:
    """Print the stations, their ranges, addresses, health and KV use, and the engine's queues."""
    status = _call(args, "/v1/status")
    if args.json:
        print(json.dumps(status))
        return 0
    for st in status.get("stations", []):
        used, total = st.get("kv_bytes_used", 0), st.get("kv_bytes_total", 0) or 1
        start, end = st["layers"]
        cores = f"{st['torch_threads']} thread(s){' pinned' if st.get('cpu_pinned') else ''}" \
            if "torch_threads" in st else ""
        print(f"station {st.get('index')}: layers [{start}, {end})  {st.get('address')}  "
              f"{'healthy' if st.get('healthy') else 'DOWN'}  kv {100 * used / total:.1f}%  {cores}".rstrip())
    eng = status.get("engine", {})
    print(f"running {eng.get('running')}  waiting {eng.get('waiting')}  waves in flight {eng.get('waves_in_flight')}")
    if cu := eng.get("route_catchup"):
        print(f"re-plan in progress: the new stations hold {cu['tokens_done']} of "
              f"{cu['tokens_done'] + cu['tokens_behind']} tokens of {cu['sequences']} live sequence(s) "
              f"({cu['waves']} catch-up waves, {cu['seconds']:.1f} s)")
    return 0


def _with_progress(args: argparse.Namespace, path: str, body: dict) -> dict:
    """POST a re-plan and, while it runs, print the catch-up's progress from /v1/status once a second."""
    import threading

    out: dict = {}

    def call() -> None:
        try:
            out["reply"] = _call(args, path, body)
        except ValueError as e:
            out["error"] = e

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    said = None
    while worker.is_alive():
        worker.join(1.0)
        try:
            cu = _call(args, "/v1/status").get("engine", {}).get("route_catchup") if worker.is_alive() else None
        except ValueError:
            cu = None
        if cu and cu != said:
            said = cu
            print(f"catching up: {cu['tokens_done']} of {cu['tokens_done'] + cu['tokens_behind']} tokens of "
                  f"{cu['sequences']} live sequence(s) on the new stations ({cu['waves']} waves, "
                  f"{cu['seconds']:.1f} s)", file=sys.stderr, flush=True)
    if "error" in out:
        raise out["error"]
    return out["reply"]


def cmd_scale(args: argparse.Namespace) -> int:
    """Re-plan a running cluster over N stations (printing the new route's catch-up as it goes)."""
    print(json.dumps(_with_progress(args, "/admin/scale", {"stations": args.stations})))
    return 0


def cmd_add_station(args: argparse.Namespace) -> int:
    """Add one station to a running cluster."""
    layers = None
    if args.layers:
        try:
            layers = [int(x) for x in args.layers.split("-")]
        except ValueError:
            raise ValueError(f"--layers: expected A-B, got {args.layers!r}") from None
    print(json.dumps(_with_progress(args, "/admin/add-station", {"layers": layers, "num_gpus": args.num_gpus})))
    return 0


def add_cluster_commands(sub) -> None:
    """The parsers of status, scale, add-station and chat under `sub` (the `mesh` subparsers)."""
    for name, func, helptext in (("status", cmd_status, "stations, health, KV use, waves in flight"),
                                 ("scale", cmd_scale, "re-plan a running cluster over N stations"),
                                 ("add-station", cmd_add_station, "add a station to a running cluster"),
                                 ("chat", cmd_chat, "chat with a running cluster in the terminal")):
        cmd = sub.add_parser(name, help=helptext)
        cmd.add_argument("--url", help="orchestrator URL (default: the detached cluster, or 127.0.0.1:8000)")
        cmd.add_argument("--timeout", type=float, default=600.0)
        cmd.set_defaults(func=func)
        if name == "status":
            cmd.add_argument("--json", action="store_true")
        if name == "scale":
            cmd.add_argument("--stations", type=int, required=True)
        if name == "add-station":
            cmd.add_argument("--layers", help="A-B: the new station's layer range")
            cmd.add_argument("--num-gpus", type=float)
        if name == "chat":
            cmd.add_argument("--system", help="a system message that opens the conversation")
            cmd.add_argument("--max-tokens", type=int, default=512)
            cmd.add_argument("--temperature", type=float, default=0.0)
