"""Wave entries, sampled tokens and Forward requests <-> the typed messages of station.proto (tensors:
mesh.core.wire_tensor).

Everything that arrives from the wire is checked here before a station touches it:
rows that match the entries and are finite (no NaN / inf; their dtype, shape and byte size by wire_tensor),
token ids inside the vocabulary, sampling values the dataclasses accept. Any failure is a `WireError` whose message starts with the field
(`hidden.shape[1]: ...`, `entries[3].sample.top_p: ...`), so the server can answer
INVALID_ARGUMENT and keep serving. Tensor payloads are raw little-endian,
C-contiguous bytes; nothing here deserializes Python objects.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from mesh.core.config import MAX_DECODE_STEPS
from mesh.core.params import ParamError, SamplingParams
from mesh.core.proto import station_pb2 as pb
from mesh.core.wave import SampledToken, WaveEntry, entry_unchecked
from mesh.core.wire_tensor import WireError, all_finite, dtype_itemsize, proto_to_tensor, tensor_to_proto

_INT32_MAX = 2**31 - 1
_UINT32_MAX = 2**32 - 1
_F32_TINY = float(np.finfo(np.float32).tiny)  # least positive normal float32


def _from_f32(v: float) -> float:
    """Undo float32 rounding for values that were short decimals (0.7 -> 0.7, not 0.699999988)."""
    return float(str(np.float32(v)))


def _sampling_to_proto(s: SamplingParams) -> pb.Sampling:
    """The per-step sampling fields of `s`. Every valid SamplingParams must travel: a top_k past uint32 means "all"
    as much as the vocabulary size does, and a top_p below float32's least normal keeps the top token alone, as
    top_p = 1.2e-38 does; float32 rounding would otherwise turn it into a refused 0.0."""
    return pb.Sampling(temperature=s.temperature, top_p=max(s.top_p, _F32_TINY), top_k=min(s.top_k, _UINT32_MAX),
                       seed=s.seed, logprobs=s.logprobs)


def entries_to_proto(entries: Sequence[WaveEntry], into=None) -> Sequence[pb.Entry]:
    """Encode a wave's entries as a list, or into the repeated field `into` (e.g. a request's `entries`: no copy of
    them into the request after), which is returned; only the per-step sampling fields of SamplingParams travel."""
    out = [] if into is None else into
    add = out.add if into is not None else (lambda **fields: out.append(pb.Entry(**fields)))
    sampling: dict[int, pb.Sampling] = {}  # one message per distinct SamplingParams object (a wave shares few)
    for i, e in enumerate(entries):
        if not isinstance(e, WaveEntry):
            raise WireError(f"entries[{i}]: expected a WaveEntry, got {type(e).__name__}")
        try:
            sample = None
            if e.sample is not None:
                if (sample := sampling.get(id(e.sample))) is None:
                    sample = sampling[id(e.sample)] = _sampling_to_proto(e.sample)
            add(seq_id=e.seq_id, start_pos=e.start_pos, n_tokens=e.n_tokens, blocks=e.blocks, sample=sample)
        except (ValueError, TypeError) as err:  # out of uint32/uint64 range
            raise WireError(f"entries[{i}]: {err}") from err
    return out


_SAMPLINGS_KEPT = 256  # decoded samplings kept across waves (a serving mesh has few distinct ones at a time)
_samplings: dict[bytes, SamplingParams] = {}  # by the Sampling message's bytes: one validated object for each


def _keep_sampling(s: pb.Sampling, key: bytes) -> SamplingParams:
    """The SamplingParams of the Sampling message `s` (not yet kept), whose bytes are `key`: decoded, checked and
    kept; ParamError where its values are not valid (nothing kept)."""
    params = SamplingParams(max_tokens=1, temperature=_from_f32(s.temperature), top_p=_from_f32(s.top_p),
                            top_k=s.top_k, seed=s.seed, logprobs=s.logprobs)
    if len(_samplings) >= _SAMPLINGS_KEPT:
        _samplings.clear()  # cheaper than an LRU, and rare
    _samplings[key] = params
    return params


def proto_to_entries(msgs: Iterable[pb.Entry]) -> tuple[WaveEntry, ...]:
    """Decode and validate a wave's entries: n_tokens >= 1, sampling values valid, seq_ids unique. Every station
    does this for every wave, 64 entries a step in a busy chain: written for speed (0.094-0.099 against 0.149-0.153 ms
    at rest for 64 decode entries), the entries built unchecked where the wire's unsigned fields already bound them."""
    out: list[WaveEntry] = []
    first_index: dict[int, int] = {}
    for i, m in enumerate(msgs):
        n, seq = m.n_tokens, m.seq_id
        if n < 1:
            raise WireError(f"entries[{i}].n_tokens: must be >= 1, got {n}")
        if seq in first_index:
            raise WireError(f"entries[{i}].seq_id: {seq} already appears at "
                            f"entries[{first_index[seq]}]; a sequence has one entry per wave")
        first_index[seq] = i
        sample = None
        if m.HasField("sample"):
            s = m.sample
            key = s.SerializeToString()  # equal bytes, equal fields (unequal bytes at worst a second equal object)
            if (sample := _samplings.get(key)) is None:
                try:
                    sample = _keep_sampling(s, key)
                except ParamError as err:
                    raise WireError(f"entries[{i}].sample.{err}") from err
        # uint64 / uint32 fields: the ids and positions are non-negative ints, n_tokens checked above
        out.append(entry_unchecked(seq, m.start_pos, n, sample, tuple(m.blocks[:])))
    return tuple(out)


def samples_to_proto(samples: Sequence[SampledToken | None]) -> pb.Samples:
    """Encode one result per entry, in wave order; None (no token asked) becomes present=False."""
    out = pb.Samples()
    for i, s in enumerate(samples):
        if s is None:
            out.samples.add(present=False)
            continue
        try:
            msg = out.samples.add(present=True, token_id=s.token_id)
            if s.logprob is not None:
                msg.logprob = s.logprob
            for tok, lp in s.top_logprobs:
                msg.top.add(token_id=tok, logprob=lp)
        except (ValueError, TypeError) as err:
            raise WireError(f"samples[{i}]: {err}") from err
    return out


def sampled_token_ids(msg: pb.Samples, *, n_entries: int, vocab_size: int) -> list[int]:
    """The token ids of one step's samples, every entry having sampled, each within the vocabulary: what the first
    station of a chain feeds into its next step (the orchestrator decodes and checks the whole samples, logprobs
    included, from the call's reply): 0.026 against 0.086 ms with `proto_to_samples` for 64 entries, the token tensor
    made from them included."""
    ids = [s.token_id for s in msg.samples]
    if len(ids) != n_entries:
        raise WireError(f"samples: expected {n_entries} (one per entry), got {len(ids)}")
    if not all(s.present for s in msg.samples):
        raise WireError("samples: an entry of a several-step decode wave came back without a token")
    if ids and not (0 <= min(ids) and max(ids) < vocab_size):
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise WireError(f"samples: token id {bad} is outside the vocabulary [0, {vocab_size})")
    return ids


def proto_to_samples(msg: pb.Samples, *, n_entries: int | None = None,
                     vocab_size: int | None = None) -> list[SampledToken | None]:
    """Decode sampled tokens; checks the count (if n_entries), token ids and logprobs."""
    if n_entries is not None and len(msg.samples) != n_entries:
        raise WireError(f"samples: expected {n_entries} (one per entry), got {len(msg.samples)}")
    hi = vocab_size if vocab_size is not None else _INT32_MAX + 1

    def bad_token(where: str, tok: int) -> WireError:
        return WireError(f"{where}: {tok} is outside the vocabulary [0, {hi})")

    def bad_logprob(where: str, lp: float) -> WireError:
        return WireError(f"{where}: must be a log-probability <= 0, got {lp}")

    out: list[SampledToken | None] = []
    for i, s in enumerate(msg.samples):  # the checks inline, their messages built only on failure
        if not s.present:
            if s.top or s.HasField("logprob"):
                raise WireError(f"samples[{i}]: logprobs given for an entry that sampled no token")
            out.append(None)
            continue
        token_id = s.token_id
        if not 0 <= token_id < hi:
            raise bad_token(f"samples[{i}].token_id", token_id)
        logprob = None
        if s.HasField("logprob"):
            logprob = s.logprob
            if math.isnan(logprob) or logprob > 0.0:
                raise bad_logprob(f"samples[{i}].logprob", logprob)
        top = []
        for j, t in enumerate(s.top):
            if not 0 <= t.token_id < hi:
                raise bad_token(f"samples[{i}].top[{j}].token_id", t.token_id)
            if math.isnan(t.logprob) or t.logprob > 0.0:
                raise bad_logprob(f"samples[{i}].top[{j}].logprob", t.logprob)
            top.append((t.token_id, t.logprob))
        out.append(SampledToken(token_id, logprob, tuple(top)))
    return out


def encode_forward(wave_id: int, entries: Sequence[WaveEntry], token_ids: Sequence[int] | None,
                   hidden: torch.Tensor | None, relay_to: Sequence[str] = (), steps: int = 1,
                   reply_steps: int = 0) -> pb.ForwardRequest:
    """Build a ForwardRequest: token ids for the first station, hidden rows for the others; `relay_to`:
    the stations after this one, to which the station sends its output itself (direct transfer); `steps`:
    decode steps run in this call (by the only station, or by the first station of a relay chain, which
    sends each step through `relay_to` and feeds the samples back); `reply_steps`: for ForwardSteps, the
    steps per streamed reply (0: all in one)."""
    if (token_ids is None) == (hidden is None):
        raise WireError("payload: give exactly one of token_ids or hidden")
    if not 1 <= steps <= MAX_DECODE_STEPS:
        raise WireError(f"steps: {steps} is outside [1, {MAX_DECODE_STEPS}]")
    if not 0 <= reply_steps <= steps:
        raise WireError(f"reply_steps: {reply_steps} is outside [0, {steps}]")
    rows = sum(e.n_tokens for e in entries)
    req = pb.ForwardRequest(wave_id=wave_id, relay_to=list(relay_to), steps=steps if steps > 1 else 0,
                            reply_steps=reply_steps)
    entries_to_proto(entries, into=req.entries)
    if token_ids is not None:
        ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        if len(ids) != rows:
            raise WireError(f"token_ids.ids: {len(ids)} ids, but the entries cover {rows} rows")
        try:
            req.token_ids.ids.extend(ids)
        except (ValueError, TypeError) as err:
            raise WireError(f"token_ids.ids: {err}") from err
    else:
        assert hidden is not None
        if hidden.dim() != 2 or hidden.shape[0] != rows:
            raise WireError(f"hidden.shape: expected [{rows}, hidden_size], got {list(hidden.shape)}")
        tensor_to_proto(hidden, into=req.hidden)
    return req


def decode_entries(msg: pb.ForwardRequest, *, max_entries: int, max_rows: int) -> tuple[WaveEntry, ...]:
    """A ForwardRequest's entries, validated against a station's limits (the part of `decode_forward` that needs no
    payload: a relay link decodes it as soon as a request is announced)."""
    n = len(msg.entries)
    if n == 0:
        raise WireError("entries: a wave needs at least one entry")
    if n > max_entries:
        raise WireError(f"entries: {n} entries exceeds max_entries {max_entries}")
    entries = proto_to_entries(msg.entries)
    rows = sum(e.n_tokens for e in entries)
    if rows > max_rows:
        raise WireError(f"entries: {rows} rows (sum of n_tokens) exceeds max_rows {max_rows}")
    return entries


def decode_forward(
    msg: pb.ForwardRequest, *, hidden_size: int, dtype: str, vocab_size: int, max_entries: int, max_rows: int,
    hidden_data: bytearray | memoryview | None = None, entries: tuple[WaveEntry, ...] | None = None,
) -> tuple[int, tuple[WaveEntry, ...], torch.Tensor | None, torch.Tensor | None]:
    """Validate a ForwardRequest against a station's shape and limits.

    Returns (wave_id, entries, token_ids [T] int64 or None, hidden [T, hidden_size] or None),
    where T is the sum of the entries' n_tokens; exactly one of the two payloads is set. `hidden_data`: the hidden
    rows' bytes where they came beside the message (a relay link's frame), `hidden.data` then empty; `entries`:
    what `decode_entries` returned for this message, where it was decoded ahead of its rows.
    """
    if entries is None:
        entries = decode_entries(msg, max_entries=max_entries, max_rows=max_rows)
    rows = sum(e.n_tokens for e in entries)
    payload = msg.WhichOneof("payload")
    if payload is None:
        raise WireError("payload: missing; expected token_ids or hidden")
    if hidden_data is not None and payload != "hidden":
        raise WireError("hidden: rows came beside the message, but its payload is not hidden rows")
    if payload == "token_ids":
        ids = msg.token_ids.ids
        if len(ids) != rows:
            raise WireError(f"token_ids.ids: {len(ids)} ids, but the entries cover {rows} rows")
        token_ids = torch.tensor(list(ids), dtype=torch.int64)  # [T]
        bad = ((token_ids < 0) | (token_ids >= vocab_size)).nonzero()
        if bad.numel():
            j = int(bad[0, 0])
            raise WireError(f"token_ids.ids[{j}]: {int(token_ids[j])} is outside the vocabulary [0, {vocab_size})")
        return msg.wave_id, entries, token_ids, None
    shape = list(msg.hidden.shape)
    if shape and shape[0] != rows:
        raise WireError(f"hidden.shape[0]: {shape[0]} rows, but the entries cover {rows} rows")
    hidden = proto_to_tensor(msg.hidden, expect_dtype=dtype, expect_shape=(rows, hidden_size),
                             max_bytes=rows * hidden_size * dtype_itemsize(dtype), field="hidden",
                             data=hidden_data)  # [T, H]
    if not all_finite(hidden):  # NaN / inf would poison every later layer and the sample
        j = int((~torch.isfinite(hidden).all(dim=-1)).nonzero()[0, 0])
        raise WireError(f"hidden[{j}]: holds NaN or infinite values; hidden rows must be finite")
    return msg.wave_id, entries, None, hidden


MAX_RELAY_HOPS = 64  # stations after the first in one relayed wave
MAX_ADDRESS_CHARS = 255


def decode_steps(msg: pb.ForwardRequest) -> int:
    """The decode steps a ForwardRequest asks for (0 on the wire = 1), checked: at most MAX_DECODE_STEPS."""
    steps = msg.steps or 1
    if steps > MAX_DECODE_STEPS:
        raise WireError(f"steps: {steps} exceeds {MAX_DECODE_STEPS}")
    return steps


def decode_reply_steps(msg: pb.ForwardRequest, steps: int) -> int:
    """The steps per streamed reply a ForwardSteps request asks for (0 on the wire = all `steps`), checked."""
    if msg.reply_steps > steps:
        raise WireError(f"reply_steps: {msg.reply_steps} exceeds the call's {steps} steps")
    return msg.reply_steps or steps


def decode_relay(msg: pb.ForwardRequest) -> tuple[str, ...]:
    """The `relay_to` addresses of a ForwardRequest, checked: at most MAX_RELAY_HOPS "host:port" strings."""
    hops = tuple(msg.relay_to)
    if len(hops) > MAX_RELAY_HOPS:
        raise WireError(f"relay_to: {len(hops)} stations exceeds {MAX_RELAY_HOPS}")
    for i, address in enumerate(hops):
        host, sep, port = address.rpartition(":")
        if not (sep and host and port.isdigit() and len(address) <= MAX_ADDRESS_CHARS and address.isprintable()):
            raise WireError(f"relay_to[{i}]: {address[:80]!r} is not a host:port address")
    return hops
