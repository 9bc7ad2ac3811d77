"""The --decode-steps / --reply-steps flags the benchmarks share: SchedulerConfig's call shape, its defaults by route
(SchedulerConfig.call_steps) named in the help from the same constants, so the help cannot go stale."""
from __future__ import annotations

import argparse

from mesh.core.config import CHAIN_CALL_STEPS, CHAIN_REPLY_STEPS, LONE_CALL_STEPS, SchedulerConfig


def add_call_shape_args(p: argparse.ArgumentParser) -> None:
    """Add --decode-steps and --reply-steps (scheduler.decode_steps / reply_steps, every config of the run)."""
    p.add_argument("--decode-steps", type=int, default=SchedulerConfig().decode_steps,
                   help="scheduler.decode_steps: decode steps per wave call once only decodes run (0: by route, "
                        f"{CHAIN_CALL_STEPS} on a direct chain, {LONE_CALL_STEPS} on one station)")
    p.add_argument("--reply-steps", type=int, default=SchedulerConfig().reply_steps,
                   help="scheduler.reply_steps: decode steps per streamed reply of such a call (0: one per call; "
                        f"by route with --decode-steps 0: every {CHAIN_REPLY_STEPS} on a chain)")
