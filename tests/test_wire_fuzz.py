"""Hostile Forward requests over the raw gRPC stub: every one is refused with INVALID_ARGUMENT or
RESOURCE_EXHAUSTED, the stations keep serving, hold no KV from refused waves, memory stays bounded,
and nothing on the wire path ever unpickles.

Each example starts from a VALID wave (fresh sequences at position 0, a payload that matches) and
applies one defect, so a success is a bug and not luck. Two servers: layers [0, 3) take token ids,
[3, 6) take hidden rows; small limits (16 entries, 64 rows, ~25 KB messages) keep the oversized
cases cheap.
"""
from __future__ import annotations

import gc
import math
import pickle
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mesh.core.config import StationSpec
from mesh.core.params import SamplingParams
from mesh.core.proto import station_pb2 as pb
from mesh.core.proto import station_pb2_grpc
from mesh.core.wave import WaveEntry
from mesh.core.wire import entries_to_proto, proto_to_entries
from mesh.core.wire_tensor import DTYPES
from station.server import ServerLimits, start_server
from station.step import Station

HIDDEN, VOCAB = 64, 512  # the tiny preset
LIMITS = ServerLimits(max_entries=16, max_rows=64, max_workers=4, max_pending=2, headroom_bytes=0)
KV_ROW = 2 * 3 * 2 * 16 * 4  # K and V of one position in a station's 3 layers (2 KV heads of 16, float32)
MAX_MESSAGE = LIMITS.message_bytes(HIDDEN, KV_ROW)
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
RSS_GROWTH_BOUND = 300 * 2**20
FUZZ = settings(max_examples=300, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class Mesh:
    """Two station servers (ids -> [0, 3), hidden -> [3, 6)) and raw stubs to them."""

    def __init__(self, model_dir: Path) -> None:
        self.stations = {"first": Station(model_dir, StationSpec(layers=(0, 3))),
                         "last": Station(model_dir, StationSpec(layers=(3, 6)))}
        for st in self.stations.values():  # the KV budgets resident before any memory bound below is measured
            st.kv.populating.join(60)
        self.servers = {k: start_server(s, limits=LIMITS) for k, s in self.stations.items()}
        opts = [("grpc.max_send_message_length", 64 * 2**20), ("grpc.max_receive_message_length", 64 * 2**20)]
        self.channels = {k: grpc.insecure_channel(s.address, options=opts) for k, s in self.servers.items()}
        self.stubs = {k: station_pb2_grpc.StationStub(c) for k, c in self.channels.items()}
        self.raw = {k: c.unary_unary("/wavemesh.v1.Station/Forward", request_serializer=lambda b: b,
                                     response_deserializer=pb.ForwardReply.FromString)
                    for k, c in self.channels.items()}

    def refused(self, target: str, request: pb.ForwardRequest | bytes) -> grpc.StatusCode:
        """Send a request that must fail; returns its status code."""
        call = self.raw[target] if isinstance(request, bytes) else self.stubs[target].Forward
        try:
            call(request, timeout=30)
        except grpc.RpcError as err:
            return err.code()
        raise AssertionError(f"{target} accepted a hostile request: {str(request)[:400]}")

    def assert_serving_and_empty(self) -> None:
        """No KV held from any refused wave, and a valid two-station wave still runs."""
        for k, stub in self.stubs.items():
            info = stub.Info(pb.InfoRequest(), timeout=30)
            assert (info.sequences, info.kv_blocks_used, info.kv_bytes_used) == (0, 0, 0), (k, info)
        entry = pb.Entry(seq_id=7, start_pos=0, n_tokens=3, sample=pb.Sampling(top_p=1.0))
        out = self.stubs["first"].Forward(pb.ForwardRequest(entries=[entry], token_ids=pb.TokenIds(ids=[1, 2, 3])),
                                          timeout=30)
        assert list(out.hidden.shape) == [3, HIDDEN]
        out = self.stubs["last"].Forward(pb.ForwardRequest(entries=[entry], hidden=out.hidden), timeout=30)
        assert out.samples.samples[0].present and 0 <= out.samples.samples[0].token_id < VOCAB
        for stub in self.stubs.values():
            assert stub.Release(pb.ReleaseRequest(seq_ids=[7]), timeout=30).released == 1

    def close(self) -> None:
        for c in self.channels.values():
            c.close()
        for s in self.servers.values():
            s.stop(grace=0)


@pytest.fixture(scope="module")
def mesh(tiny_llama):
    m = Mesh(tiny_llama)
    try:
        yield m
    finally:
        m.close()


def rss_bytes() -> int:
    """Resident set size of this process (the servers run in it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


# ---- strategies: a valid wave, then one defect ------------------------------------------------------

GOOD_SAMPLING = st.builds(pb.Sampling, temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
                          top_p=st.sampled_from([1.0, 0.9, 0.5]), top_k=st.integers(0, 2**32 - 1),
                          seed=st.integers(0, 2**63 - 1), logprobs=st.integers(0, 20))
BAD_SAMPLING = st.one_of(  # each value is refused after float32 rounding, too
    st.builds(pb.Sampling, temperature=st.sampled_from([float("nan"), float("inf"), -float("inf"), -1.0, 101.0, 1e30]),
              top_p=st.just(1.0)),
    st.builds(pb.Sampling, top_p=st.sampled_from([0.0, -0.5, 1.01, 7.0, float("nan"), float("inf")])),
    st.builds(pb.Sampling, top_p=st.just(1.0), seed=st.integers(2**63, 2**64 - 1)),
    st.builds(pb.Sampling, top_p=st.just(1.0), logprobs=st.integers(21, 2**32 - 1)))
SHAPES = st.lists(st.integers(0, 300), max_size=9)
HUGE_SHAPES = st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=12).filter(lambda s: max(s) >= 2**31)


@st.composite
def entries(draw, n: int | None = None) -> list[pb.Entry]:
    """1-4 fresh sequences at position 0 (16+ with n), some asking for a sample."""
    n = n if n is not None else draw(st.integers(1, 4))
    seq_ids = draw(st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n, unique=True))
    out = []
    for s in seq_ids:
        e = pb.Entry(seq_id=s, start_pos=0, n_tokens=draw(st.integers(1, 8)) if n <= 4 else 1)
        if draw(st.booleans()):
            e.sample.CopyFrom(draw(GOOD_SAMPLING))
        out.append(e)
    return out


def rows(es: list[pb.Entry]) -> int:
    return sum(e.n_tokens for e in es)


def hidden_array(draw, n_rows: int) -> np.ndarray:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return rng.standard_normal((n_rows, HIDDEN)).astype("<f4")  # [T, d]


def tensor(arr: np.ndarray, dtype: str = "float32") -> pb.Tensor:
    return pb.Tensor(dtype=dtype, shape=list(arr.shape), data=arr.tobytes())


def request(draw, es, ids=None, hidden=None) -> pb.ForwardRequest:
    req = pb.ForwardRequest(entries=es, wave_id=draw(st.integers(0, 2**64 - 1)))
    if ids is not None:
        req.token_ids.ids.extend(ids)
    if hidden is not None:
        req.hidden.CopyFrom(hidden)
    return req


def good_payload(draw, target: str, n_rows: int) -> dict:
    if target == "first":
        return {"ids": draw(st.lists(st.integers(0, VOCAB - 1), min_size=n_rows, max_size=n_rows))}
    return {"hidden": tensor(hidden_array(draw, n_rows))}


@st.composite
def entry_defects(draw) -> tuple[str, str, pb.ForwardRequest]:
    """Defects in the entries (or the payload's presence), sent with an otherwise good payload."""
    target = draw(st.sampled_from(["first", "last"]))
    kind = draw(st.sampled_from(["n_tokens_zero", "duplicate_seq", "huge_start_pos", "too_many_entries",
                                 "too_many_rows", "no_entries", "missing_payload", "bad_sampling"]))
    es = draw(entries(draw(st.integers(17, 64)) if kind == "too_many_entries" else None))
    k = draw(st.integers(0, len(es) - 1))
    if kind == "n_tokens_zero":
        es[k].n_tokens = 0
    elif kind == "duplicate_seq":
        twin = pb.Entry()
        twin.CopyFrom(es[k])
        twin.n_tokens = draw(st.integers(1, 4))
        es.insert(draw(st.integers(0, len(es))), twin)
    elif kind == "huge_start_pos":
        es[k].start_pos = draw(st.integers(1, 2**32 - 1))
    elif kind == "too_many_rows":
        es[k].n_tokens = draw(st.integers(LIMITS.max_rows + 1, 2**32 - 1))
    elif kind == "bad_sampling":
        es[k].sample.CopyFrom(draw(BAD_SAMPLING))
    payload = good_payload(draw, target, min(rows(es), 2 * LIMITS.max_rows))
    if kind == "no_entries":
        es = []
    if kind == "missing_payload":
        payload = {}
    return kind, target, request(draw, es, **payload)


@st.composite
def payload_defects(draw) -> tuple[str, str, pb.ForwardRequest | bytes]:
    """Defects in the token ids or the hidden tensor of an otherwise good wave."""
    es = draw(entries())
    n = rows(es)
    kind = draw(st.sampled_from(["bad_token_id", "ids_count", "hidden_to_first", "ids_to_last", "dtype_name",
                                 "other_dtype", "shape", "negative_dim", "huge_dim", "data_length", "non_finite",
                                 "oversized", "garbage_bytes"]))
    if kind in ("bad_token_id", "ids_count"):
        ids = good_payload(draw, "first", n)["ids"]
        if kind == "bad_token_id":
            ids[draw(st.integers(0, n - 1))] = draw(st.integers(-2**31, -1) | st.integers(VOCAB, 2**31 - 1))
        else:
            ids = ids[:draw(st.integers(0, n - 1))] if draw(st.booleans()) else ids + [1] * draw(st.integers(1, 70))
        return kind, "first", request(draw, es, ids=ids)
    if kind == "hidden_to_first":
        return kind, "first", request(draw, es, **good_payload(draw, "last", n))
    if kind == "ids_to_last":
        return kind, "last", request(draw, es, **good_payload(draw, "first", n))
    if kind == "garbage_bytes":
        return kind, draw(st.sampled_from(["first", "last"])), draw(st.binary(max_size=300))
    arr = hidden_array(draw, n)
    t = tensor(arr)
    if kind == "dtype_name":
        t.dtype = draw(st.text(max_size=30).filter(lambda s: s not in DTYPES))
    elif kind == "other_dtype":
        t.dtype = draw(st.sampled_from(sorted(set(DTYPES) - {"float32"})))
        if draw(st.booleans()):  # bytes that match the claimed dtype
            t.data = bytes(n * HIDDEN * DTYPES[t.dtype].itemsize)
    elif kind == "shape":
        shape = draw(SHAPES.filter(lambda s: s != [n, HIDDEN]))
        t.ClearField("shape")
        t.shape.extend(shape)
        size = int(np.prod(shape, dtype=np.float64)) * 4
        if size <= 20_000 and draw(st.booleans()):  # bytes that match the claimed shape
            t.data = bytes(size)
    elif kind == "negative_dim":
        shape = [n, HIDDEN]
        shape.insert(draw(st.integers(0, 2)), draw(st.integers(-2**63, -1)))
        if draw(st.booleans()):
            shape.pop(draw(st.integers(0, 2)))
        if all(d >= 0 for d in shape):
            shape[0] = -n
        t.ClearField("shape")
        t.shape.extend(shape)
    elif kind == "huge_dim":
        t.ClearField("shape")
        t.shape.extend(draw(HUGE_SHAPES))
    elif kind == "data_length":
        cut = draw(st.integers(1, len(t.data)))
        t.data = t.data[:-cut] if draw(st.booleans()) else t.data + bytes(draw(st.integers(1, 4096)))
    elif kind == "non_finite":
        flat = arr.reshape(-1)
        for _ in range(draw(st.integers(1, 5))):
            flat[draw(st.integers(0, flat.size - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
        t = tensor(arr)
    elif kind == "oversized":  # past the server's max_receive_message_length: refused by gRPC itself
        t.data = bytes(MAX_MESSAGE + draw(st.integers(1, 3 * MAX_MESSAGE)))
        return kind, "last", request(draw, es, hidden=t)
    return kind, "last", request(draw, es, hidden=t)


HOSTILE = st.one_of(entry_defects(), payload_defects())


def test_hostile_forward_requests_are_refused(mesh):
    gc.collect()
    rss_before = rss_bytes()
    seen: dict[str, set] = {}

    @FUZZ
    @given(case=HOSTILE)
    def fuzz(case):
        kind, target, req = case
        code = mesh.refused(target, req)
        assert code in REFUSALS, (kind, code)
        if kind == "oversized":
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        seen.setdefault(kind, set()).add(code.name)

    fuzz()
    mesh.assert_serving_and_empty()
    gc.collect()
    assert rss_bytes() - rss_before < RSS_GROWTH_BOUND, (rss_before, rss_bytes())
    assert len(seen) >= 18, sorted(seen)  # most defect kinds were exercised


@pytest.mark.parametrize("target, size", [("last", 8 * 2**20), ("first", 20 * 2**20)])
def test_huge_message_is_resource_exhausted_and_memory_stays_bounded(mesh, target, size):
    gc.collect()
    rss_before = rss_bytes()
    entry = pb.Entry(seq_id=1, start_pos=0, n_tokens=1)
    for _ in range(5):
        req = pb.ForwardRequest(entries=[entry], hidden=pb.Tensor(dtype="float32", shape=[1, HIDDEN], data=bytes(size)))
        assert mesh.refused(target, req) == grpc.StatusCode.RESOURCE_EXHAUSTED
    del req
    gc.collect()
    assert rss_bytes() - rss_before < RSS_GROWTH_BOUND
    mesh.assert_serving_and_empty()


def test_non_finite_hidden_is_refused_with_the_row(mesh):
    arr = np.ones((4, HIDDEN), dtype="<f4")
    arr[2, 5] = np.nan
    req = pb.ForwardRequest(entries=[pb.Entry(seq_id=3, start_pos=0, n_tokens=4)], hidden=tensor(arr))
    try:
        mesh.stubs["last"].Forward(req, timeout=30)
        raise AssertionError("NaN hidden rows were accepted")
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("hidden[2]: ")


def test_wire_path_never_unpickles(mesh, monkeypatch):
    calls: list[str] = []

    def trap(name):
        def refuse(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} called on the wire path")
        return refuse

    class TrapUnpickler:
        def __init__(self, *args, **kwargs):
            trap("pickle.Unpickler")()

    for mod, name in ((pickle, "loads"), (pickle, "load"), (torch, "load"), (np, "load")):
        monkeypatch.setattr(mod, name, trap(f"{mod.__name__}.{name}"))
    monkeypatch.setattr(pickle, "Unpickler", TrapUnpickler)

    @settings(FUZZ, max_examples=100)
    @given(case=HOSTILE)
    def fuzz(case):
        kind, target, req = case
        assert mesh.refused(target, req) in REFUSALS, kind

    fuzz()
    mesh.assert_serving_and_empty()  # the valid path, too, with every unpickler trapped
    assert calls == []


@settings(FUZZ, max_examples=300)
@given(params=st.builds(SamplingParams, max_tokens=st.just(1), temperature=st.floats(0, 100),
                        top_p=st.floats(0, 1, exclude_min=True), top_k=st.integers(0, 2**70),
                        seed=st.integers(0, 2**63 - 1), logprobs=st.integers(0, 20)))
def test_every_valid_sampling_params_crosses_the_wire(params):
    """What the API accepts must reach the last station: no uint32 overflow, no top_p rounded to a refused 0."""
    (entry,) = proto_to_entries(entries_to_proto([WaveEntry(1, 0, 1, params)]))
    s = entry.sample
    assert (s.top_k, s.seed, s.logprobs) == (min(params.top_k, 2**32 - 1), params.seed, params.logprobs)
    assert 0 < s.top_p <= 1 and math.isclose(s.top_p, params.top_p, rel_tol=1e-6, abs_tol=2e-38)
    assert math.isclose(s.temperature, params.temperature, rel_tol=1e-6, abs_tol=2e-38)
