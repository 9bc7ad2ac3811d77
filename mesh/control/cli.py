"""`mesh` command line: up, down, generate, bench, init-model here; status, scale, add-station and chat (the
commands that call a running cluster over HTTP) in mesh.control.cli_cluster.

Environment is read at this edge (these two modules) and nowhere deeper: WAVEMESH_CACHE names where the embedded
default model is written (default ~/.cache/wavemesh), and where stations keep packed GGUF weights unless the YAML
names its own `model.packed_cache`; WAVEMESH_API_KEY is what the cluster commands send.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from mesh.control.cli_cluster import add_cluster_commands, wavemesh_cache
from mesh.core.config import SUPPORTED_ARCHS, SUPPORTED_DTYPES, ConfigError
from mesh.core.params import ParamError, SamplingParams, sampling_from_json
from mesh.core.transport import host_port


def _cache_dir() -> Path:
    return wavemesh_cache() / "models"


def resolve_model(path: str | None, preset: str = "tiny") -> Path:
    """A checkpoint directory or GGUF file: the one given, or the built-in model of that preset; a `path` that names
    no file or checkpoint directory but a preset (`--model bench`, `--model smollm2-135m-instruct`) is that preset's
    built-in model."""
    if path and (Path(path).is_file() or (Path(path) / "config.json").is_file()):
        return Path(path)
    from mesh.core.compute import on_compute_thread
    from mesh.core.model.gguf_convert import SMOLLM2, builtin_chat_model
    from mesh.core.model.synthetic import PRESETS, builtin_model

    if path and path not in PRESETS and path != SMOLLM2:
        return Path(path)  # what reads it names the missing file
    preset = path or preset
    if preset == SMOLLM2:
        return builtin_chat_model(_cache_dir())
    return on_compute_thread(builtin_model, _cache_dir(), preset)  # torch work stays on one thread (mesh.core.compute)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--prompt-ids: expected comma-separated integers ({e})") from e


def cmd_init_model(args: argparse.Namespace) -> int:
    """Write a synthetic HF checkpoint."""
    from mesh.core.model.synthetic import init_model

    out = init_model(args.out, args.preset, args.arch, seed=args.seed, shards=args.shards, dtype=args.dtype)
    print(f"wrote {args.preset} {args.arch} {args.dtype} checkpoint to {out}")
    return 0


def _read_requests(path: str, tok) -> list[tuple[list[int], SamplingParams]]:
    """Parse a JSONL file of requests; errors name the line and the field."""
    jobs = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            if not isinstance(d, dict):
                raise ValueError("expected a JSON object")
            if ("prompt" in d) == ("prompt_ids" in d):
                raise ValueError("give exactly one of prompt / prompt_ids")
            ids = tok.encode(d["prompt"]).ids if "prompt" in d else d["prompt_ids"]
            if not (isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)):
                raise ValueError("prompt_ids: must be a non-empty list of integers")
            jobs.append((ids, sampling_from_json(d)))
        except (ValueError, ParamError) as e:
            raise ValueError(f"{path}:{n}: {e}") from e
    return jobs


def _generate_many(model_dir: Path, cfg, tok, args: argparse.Namespace) -> int:
    from mesh.core.config import SchedulerConfig, StationSpec
    from orchestrator.engine import Engine
    from orchestrator.pipeline import LocalLink
    from station.step import Station

    jobs = _read_requests(args.requests, tok)
    station = Station(model_dir, StationSpec(layers=(0, cfg.num_hidden_layers), device=args.device, dtype=args.dtype))
    engine = Engine([LocalLink(station)], cfg, SchedulerConfig(max_seqs=args.max_seqs, max_queue=max(256, len(jobs))), tok)
    try:
        streams = [engine.submit(ids, params) for ids, params in jobs]
        for s in streams:
            out = s.result()[0]
            if args.json:
                print(json.dumps({"token_ids": out.token_ids, "text": out.text, "finish_reason": out.finish_reason}))
            else:
                print(out.text)
    finally:
        engine.close()
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Run one prompt on an in-process full-model station, or a JSONL file of requests through the engine."""
    from mesh.core.config import ModelConfig, StationSpec
    from mesh.core.model.tokenizer_files import load_tokenizer
    from station.generate import generate_one
    from station.step import Station

    model_dir = resolve_model(args.model)
    cfg = ModelConfig.from_dir(model_dir)
    tok = load_tokenizer(model_dir)
    if args.requests:
        return _generate_many(model_dir, cfg, tok, args)
    prompt = args.prompt_ids if args.prompt_ids is not None else tok.encode(args.prompt).ids
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    station = Station(model_dir, StationSpec(layers=(0, cfg.num_hidden_layers), device=args.device, dtype=args.dtype))
    ids, reason = generate_one(station, prompt, params)
    text = tok.decode(ids, skip_special_tokens=True)
    if args.json:
        print(json.dumps({"token_ids": ids, "text": text, "finish_reason": reason}))
    else:
        print(text)
    return 0


def _load_config(path: str | None):
    """The cluster YAML (or the embedded default); where WAVEMESH_CACHE is set, a default `model.packed_cache` moves
    under it with the rest of the cache."""
    from mesh.control.cluster_yaml import load_mesh_config
    from mesh.control.mesh_config import DEFAULT_PACKED_CACHE, default_mesh_config

    config = load_mesh_config(path) if path else default_mesh_config()
    if "WAVEMESH_CACHE" in os.environ and config.model.packed_cache == DEFAULT_PACKED_CACHE:
        config = config.with_packed_cache(str(_cache_dir().parent / "packed"))
    return config


def _model_dir_of(config) -> Path:
    if config.model.path is not None:
        return Path(config.model.path)
    from mesh.core.model.gguf_convert import SMOLLM2, smollm2_gguf
    from mesh.core.model.synthetic import builtin_model

    if config.model.preset == SMOLLM2:  # the packaged GGUF as it is: its Q4_1 blocks stay quantized in the station
        return smollm2_gguf()
    return builtin_model(_cache_dir(), config.model.preset, config.model.arch)


def cmd_up(args: argparse.Namespace) -> int:
    """Start a cluster from a YAML (or the embedded default) and serve until SIGINT/SIGTERM."""
    from dataclasses import replace

    config = _load_config(args.config)  # every mistake is refused here, before anything starts (or is imported)
    from mesh.control import up  # torch, Ray and the server: seconds to import, so only for a config that holds
    if args.port is not None:
        config = replace(config, api=replace(config.api, port=args.port))
    if args.detach:
        rest = [a for a in sys.argv[2:] if a != "--detach"]
        return up.detach(rest, f"http://{host_port(config.api.host, config.api.port)}", _cache_dir().parent,
                         targets_file=config.cluster.targets_file)
    return up.serve(config, _model_dir_of(config))


def cmd_down(args: argparse.Namespace) -> int:
    """Stop a cluster started with `mesh up --detach`."""
    from mesh.control import up

    return up.down(_cache_dir().parent)


# `mesh bench NAME` runs bench/FILE.py; a name that is a package here (mesh) has a file named otherwise
BENCH_FILES = {"mesh": "chain"}


def cmd_bench(args: argparse.Namespace) -> int:
    """Run a benchmark from bench/ by name."""
    import runpy

    script = Path(__file__).resolve().parents[2] / "bench" / f"{BENCH_FILES.get(args.name, args.name)}.py"
    if not script.is_file():
        print(f"mesh bench: no benchmark named {args.name!r} ({script} missing)", file=sys.stderr)
        return 2
    sys.argv = [str(script), *args.rest]
    sys.path.insert(0, str(script.parent))  # as `python bench/X.py` would: bench scripts import their neighbours
    runpy.run_path(str(script), run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = argparse.ArgumentParser(prog="mesh", description="wavemesh: layer-range stations serving one model")
    sub = p.add_subparsers(dest="command", required=True)

    init = sub.add_parser("init-model", help="write a synthetic HF checkpoint with deterministic random weights")
    init.add_argument("--preset", default="tiny", choices=["tiny", "small", "bench"])
    init.add_argument("--arch", default="llama", choices=SUPPORTED_ARCHS)
    init.add_argument("--out", required=True)
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--shards", type=int, default=1, help="split the weights into N safetensors files")
    init.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                      help="how the weights are stored (bfloat16 or float16: rounded to it, as published "
                      "checkpoints are)")
    init.set_defaults(func=cmd_init_model)

    gen = sub.add_parser("generate", help="generate for one prompt on an in-process station")
    gen.add_argument("--model", help="HF checkpoint directory or .gguf file (default: the built-in tiny model)")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-ids", type=_parse_ids)
    src.add_argument("--requests", help="JSONL file, one request per line, run concurrently through the engine")
    gen.add_argument("--max-seqs", type=int, default=32, help="with --requests: sequences batched at once")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--dtype", default="float32", choices=SUPPORTED_DTYPES)
    gen.add_argument("--json", action="store_true", help='print {"token_ids", "text", "finish_reason"} on one line')
    gen.set_defaults(func=cmd_generate)

    up_ = sub.add_parser("up", help="start a cluster from a YAML (default: the embedded local one) and serve")
    up_.add_argument("config", nargs="?", help="cluster YAML (see deploy/README.md)")
    up_.add_argument("--detach", action="store_true", help="run in the background; stop with `mesh down`")
    up_.add_argument("--port", type=int, help="override api.port")
    up_.set_defaults(func=cmd_up)
    sub.add_parser("down", help="stop a cluster started with --detach").set_defaults(func=cmd_down)
    add_cluster_commands(sub)

    bench = sub.add_parser("bench", help="run a benchmark from bench/ (step, ...)")
    bench.add_argument("name")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `mesh` console script."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ParamError, ValueError, FileNotFoundError) as e:
        print(f"mesh {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
