"""`mesh` command line: init-model, generate, bench.

Environment is read here, at the edge, and nowhere deeper: WAVEMESH_CACHE names
where the embedded default model is written (default ~/.cache/wavemesh).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from mesh.config import ConfigError
from mesh.params import ParamError, SamplingParams, sampling_from_json


def _cache_dir() -> Path:
    return Path(os.environ.get("WAVEMESH_CACHE", Path.home() / ".cache" / "wavemesh")) / "models"


def resolve_model(path: str | None, preset: str = "tiny") -> Path:
    """A checkpoint directory: the one given, or the built-in synthetic model."""
    if path:
        return Path(path)
    from mesh.model.synthetic import builtin_model

    return builtin_model(_cache_dir(), preset)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--prompt-ids: expected comma-separated integers ({e})") from e


def cmd_init_model(args: argparse.Namespace) -> int:
    """Write a synthetic HF checkpoint."""
    from mesh.model.synthetic import init_model

    out = init_model(args.out, args.preset, args.arch, seed=args.seed, shards=args.shards)
    print(f"wrote {args.preset} {args.arch} checkpoint to {out}")
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
    from mesh.config import SchedulerConfig, StationSpec
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
    from tokenizers import Tokenizer

    from mesh.config import ModelConfig, StationSpec
    from station.generate import generate_one
    from station.step import Station

    model_dir = resolve_model(args.model)
    cfg = ModelConfig.from_dir(model_dir)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
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


def cmd_bench(args: argparse.Namespace) -> int:
    """Run a benchmark from bench/ by name."""
    import runpy

    script = Path(__file__).resolve().parent.parent / "bench" / f"{args.name}.py"
    if not script.is_file():
        print(f"mesh bench: no benchmark named {args.name!r} ({script} missing)", file=sys.stderr)
        return 2
    sys.argv = [str(script), *args.rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = argparse.ArgumentParser(prog="mesh", description="wavemesh: layer-range stations serving one model")
    sub = p.add_subparsers(dest="command", required=True)

    init = sub.add_parser("init-model", help="write a synthetic HF checkpoint with deterministic random weights")
    init.add_argument("--preset", default="tiny", choices=["tiny", "small", "bench"])
    init.add_argument("--arch", default="llama", choices=["llama", "mistral", "qwen2"])
    init.add_argument("--out", required=True)
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--shards", type=int, default=1, help="split the weights into N safetensors files")
    init.set_defaults(func=cmd_init_model)

    gen = sub.add_parser("generate", help="generate for one prompt on an in-process station")
    gen.add_argument("--model", help="HF checkpoint directory (default: the built-in tiny model)")
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
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    gen.add_argument("--json", action="store_true", help='print {"token_ids", "text", "finish_reason"} on one line')
    gen.set_defaults(func=cmd_generate)

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
