"""What the benchmarks share about the calls and the requests they time: the --decode-steps / --reply-steps flags
(SchedulerConfig's call shape, its defaults by route (SchedulerConfig.call_steps) named in the help from the same
constants, so the help cannot go stale), and --min-tokens' mixed lengths (a seeded draw of each request's max_tokens)."""
from __future__ import annotations

import argparse
import random

from mesh.core.config import CHAIN_CALL_STEPS, CHAIN_REPLY_STEPS, LONE_CALL_STEPS, SchedulerConfig


def add_call_shape_args(p: argparse.ArgumentParser) -> None:
    """Add --decode-steps and --reply-steps (scheduler.decode_steps / reply_steps, every config of the run)."""
    p.add_argument("--decode-steps", type=int, default=SchedulerConfig().decode_steps,
                   help="scheduler.decode_steps: decode steps per wave call once only decodes run (0: by route, "
                        f"{CHAIN_CALL_STEPS} on a direct chain, {LONE_CALL_STEPS} on one station)")
    p.add_argument("--reply-steps", type=int, default=SchedulerConfig().reply_steps,
                   help="scheduler.reply_steps: decode steps per streamed reply of such a call (0: one per call; "
                        f"by route with --decode-steps 0: every {CHAIN_REPLY_STEPS} on a chain)")


def min_tokens_problem(min_tokens: int | None, tokens: int) -> str | None:
    """What is wrong with --min-tokens against --tokens (None: nothing; --min-tokens not given is fine)."""
    if min_tokens is not None and not 1 <= min_tokens <= tokens:
        return f"--min-tokens: must be in [1, --tokens ({tokens})], got {min_tokens}"
    return None


def mixed_lengths(n: int, tokens: int, min_tokens: int, seed: int) -> list[int]:
    """n requests' max_tokens drawn from [min_tokens, tokens], the same list for the same seed (every config, every
    run of a benchmark meets one workload)."""
    rng = random.Random(seed)
    return [rng.randint(min_tokens, tokens) for _ in range(n)]
