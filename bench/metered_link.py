"""A StationLink wrapper for `mesh bench mesh` (bench/chain.py): each wave call's wall time, the station's own seconds
and, after the timed run, the protobuf bytes of what crossed the wire."""
from __future__ import annotations

import time

from mesh.core.proto import station_pb2 as pb
from mesh.core.wire import encode_forward, samples_to_proto
from mesh.core.wire_tensor import tensor_to_proto


class MeteredLink:
    """A StationLink that records every forward: link wall time, the station's own seconds, what crossed the wire."""

    def __init__(self, inner, remote: bool) -> None:
        self.inner, self.remote = inner, remote
        self.address = inner.address
        self.reset()

    def reset(self) -> None:
        """Zero the counters (between timed runs)."""
        self.calls, self.call_s, self.compute_s, self.release_s = 0, 0.0, 0.0, 0.0
        self.sent: list[tuple] = []  # (wave_id, entries, token_ids, hidden, output, steps) of remote calls
        self.released: list[tuple[int, ...]] = []

    def forward(self, wave_id, entries, token_ids, hidden, steps=1):
        """Run the wave (`steps` decode steps: the wrapped links, LocalLink and RemoteLink, take them) on the
        wrapped link, timing it."""
        t0 = time.perf_counter()
        out = self.inner.forward(wave_id, entries, token_ids, hidden, **({"steps": steps} if steps > 1 else {}))
        self.call_s += time.perf_counter() - t0
        self.calls += 1
        self.compute_s += out.seconds
        if self.remote:
            self.sent.append((wave_id, entries, token_ids, hidden, out, steps))
        return out

    def relay(self, wave_id, entries, token_ids, successors, steps=1):
        """Direct transfer (`scheduler.hidden_path: direct`): run the wave (`steps` decode steps) here and on
        through `successors` (metered links too), each station's own seconds and call time taken from the relayed
        reports (summed over the steps)."""
        t0 = time.perf_counter()
        reply = self.inner.relay(wave_id, entries, token_ids, [s.inner for s in successors], steps=steps)
        self.call_s += time.perf_counter() - t0
        self.calls += 1
        self.compute_s += reply.output.seconds
        for link, hop in zip(successors, reply.hops):
            link.calls += 1
            link.call_s += hop.call_seconds
            link.compute_s += hop.forward_seconds
        if self.remote:  # only token ids went out and samples came back through the orchestrator
            self.sent.append((wave_id, entries, token_ids, None, reply.output, steps))
        return reply

    def release(self, seq_ids) -> None:
        """Free KV on the wrapped link, timing it."""
        t0 = time.perf_counter()
        self.inner.release(seq_ids)
        self.release_s += time.perf_counter() - t0
        if self.remote:
            self.released.append(tuple(seq_ids))

    def kv(self):
        """The wrapped link's KV figures."""
        return self.inner.kv()

    def health(self) -> bool:
        """The wrapped link's health."""
        return self.inner.health()

    def describe(self) -> dict:
        """The wrapped link's description."""
        return self.inner.describe()

    def close(self) -> None:
        """Close the wrapped link."""
        self.inner.close()

    def wire_bytes(self) -> dict[str, int]:
        """Protobuf bytes of what this link sent and received (0 in-process); call after the timed run."""
        req = rep = hid = rel = 0
        for wave_id, entries, ids, hidden, out, steps in self.sent:
            req += encode_forward(wave_id, entries, ids, hidden, steps=steps).ByteSize()
            hid += 0 if hidden is None else hidden.numel() * hidden.element_size()
            if out.hidden is not None:
                rep += pb.ForwardReply(hidden=tensor_to_proto(out.hidden), forward_seconds=out.seconds).ByteSize()
                hid += out.hidden.numel() * out.hidden.element_size()
            else:
                rep += pb.ForwardReply(samples=samples_to_proto(out.samples or []),
                                       forward_seconds=out.seconds).ByteSize()
        rel = sum(pb.ReleaseRequest(seq_ids=list(s)).ByteSize() for s in self.released)
        return {"request": req, "reply": rep, "release": rel, "hidden_payload": hid}
