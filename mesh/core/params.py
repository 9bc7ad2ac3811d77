"""Per-request sampling parameters (no torch: the scheduler and API import this)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from mesh.core.config import is_int

MAX_LOGPROBS = 20  # the most top-n logprobs one token may ask for


class ParamError(ValueError):
    """A sampling parameter is invalid; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its tokens and when it stops, as OpenAI-style servers take them."""

    max_tokens: int = 16  # tokens to generate at most
    temperature: float = 0.0  # 0 = greedy; otherwise logits are divided by it
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose mass reaches top_p
    top_k: int = 0  # keep the k most likely tokens (0 = all)
    seed: int = 0  # counter-based randomness: a row draws from (seed, position)
    stop: tuple[str, ...] = ()  # stop strings (matched on the decoded text, excluded from it)
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that end the sequence
    ignore_eos: bool = False  # keep generating past EOS
    logprobs: int = 0  # top-n logprobs to return with each sampled token (0 = none)

    def __post_init__(self) -> None:
        def need(cond: bool, param: str, msg: str) -> None:
            if not cond:
                raise ParamError(param, msg)

        need(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
             f"must be an integer >= 1, got {self.max_tokens!r}")
        need(_is_num(self.temperature) and 0.0 <= self.temperature <= 100.0, "temperature",
             f"must be a number in [0, 100], got {self.temperature!r}")
        need(_is_num(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p",
             f"must be a number in (0, 1], got {self.top_p!r}")
        need(is_int(self.top_k) and self.top_k >= 0, "top_k", f"must be an integer >= 0, got {self.top_k!r}")
        need(is_int(self.seed) and 0 <= self.seed < 2**63, "seed", f"must be an integer in [0, 2^63), got {self.seed!r}")
        need(isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop), "stop",
             "must be non-empty strings")
        need(isinstance(self.stop_token_ids, tuple) and all(is_int(t) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids", "must be non-negative integers")
        need(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a boolean")
        need(is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
             f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        """True when the argmax token is taken."""
        return self.temperature == 0.0 or self.top_k == 1


def _is_num(v: object) -> bool:
    return is_int(v) or (isinstance(v, float) and math.isfinite(v))  # an int is finite (isfinite(10**400) raises)


SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                   "ignore_eos", "logprobs")


def sampling_from_json(d: dict, defaults: SamplingParams | None = None) -> SamplingParams:
    """SamplingParams from a JSON object's sampling fields (others are ignored); None means the default.

    `stop` may be one string or a list; lists become tuples. Raises ParamError naming the field.
    """
    base = defaults or SamplingParams()
    kw = {}
    for name in SAMPLING_FIELDS:
        v = d.get(name)
        if v is None:
            continue
        if name == "stop":
            v = (v,) if isinstance(v, str) else v
        if name in ("stop", "stop_token_ids"):
            if not isinstance(v, (list, tuple)):
                raise ParamError(name, f"must be a list, got {type(v).__name__}")
            v = tuple(v)
        kw[name] = v
    if isinstance(kw.get("logprobs"), bool):  # chat-style `logprobs: true` means the sampled token's logprob
        kw["logprobs"] = int(kw["logprobs"])
    fields = {name: getattr(base, name) for name in SAMPLING_FIELDS}
    fields.update(kw)
    return SamplingParams(**fields)
