"""GET /health's proof that the forward path works, at no cost to the users' capacity.

The proof is a real 1-token generation through every station, submitted as the engine's `probe`: it
goes first, takes a lane of its own and counts against no user's queue place. One proof runs at a time
(concurrent callers share it) and a success is reused for `cache_s` seconds, so any number of callers
cost at most one 1-token generation per `cache_s`. A failure is never reused, and a route that is down
or closed answers 503 at once, whatever the last proof said.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

from mesh.core.params import SamplingParams
from orchestrator.scheduler import AdmissionError

__all__ = ["HealthProbe"]


class HealthProbe:
    """Answers "is the forward path up?" with a shared, briefly cached 1-token generation."""

    def __init__(self, engine, timeout_s: float, cache_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """A probe over `engine`: each proof waits at most `timeout_s`; a success holds for `cache_s`."""
        self.engine, self.timeout_s, self.cache_s, self._clock = engine, timeout_s, cache_s, clock
        self._proved_at: float | None = None
        self._running: asyncio.Future | None = None
        self.proofs = 0  # generations run so far (the cost callers shared)

    async def check(self) -> str | None:
        """None when the forward path works, else the reason it does not."""
        refused = self.engine.route.refusal()  # shutting down, route down: no cached success hides it
        if refused is not None:
            return refused.message
        if self._proved_at is not None and self._clock() - self._proved_at < self.cache_s:
            return None
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(self._prove())
        return await asyncio.shield(self._running)  # a caller that leaves does not cancel the others' proof

    async def _prove(self) -> str | None:
        """Run one 1-token generation as a probe; remember when it succeeded."""
        self.proofs += 1
        model = self.engine.model
        token = model.bos_token_id if model.bos_token_id is not None else 0
        try:
            stream = self.engine.submit([token], SamplingParams(max_tokens=1, ignore_eos=True), 1,
                                        f"health-{uuid.uuid4().hex}", probe=True)
        except AdmissionError as err:
            return err.message
        try:
            outs = await asyncio.wait_for(stream.result_async(), self.timeout_s)
        except TimeoutError:
            return f"no token within {self.timeout_s} s"
        finally:
            if not stream.done:
                self.engine.cancel(stream.request_id)
        if outs[0].finish_reason == "error" or not outs[0].token_ids:
            return outs[0].error or outs[0].finish_reason
        self._proved_at = self._clock()
        return None
