"""mesh.core.wire: tensor/entry/sample round trips and every validation failure naming its field."""
from __future__ import annotations

import inspect
import pickle

import pytest
import torch

from mesh.core import wire, wire_tensor
from mesh.core.params import SamplingParams
from mesh.core.proto import station_pb2 as pb
from mesh.core.wave import SampledToken, WaveEntry
from mesh.core.wire import WireError

DTYPES = ["float32", "bfloat16", "float16", "int32", "int64"]
LIMITS = dict(hidden_size=8, dtype="bfloat16", vocab_size=100, max_entries=4, max_rows=16)


def _tensor(dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype.startswith("int"):
        return torch.randint(-(2**30), 2**30, shape, dtype=wire_tensor.DTYPES[dtype])
    return torch.randn(shape).to(wire_tensor.DTYPES[dtype])


def _entries() -> tuple[WaveEntry, ...]:
    greedy = SamplingParams(max_tokens=1)
    return (WaveEntry(7, 0, 3), WaveEntry(9, 12, 1, greedy), WaveEntry(2**40, 5, 2))


def _raises(field: str):
    """pytest.raises(WireError) whose message starts with `field`."""
    return pytest.raises(WireError, match="^" + field.replace("[", r"\[").replace("]", r"\]").replace(".", r"\."))


# ---- tensors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0,), (5,), (3, 4), (2, 0, 3), (2, 3, 4), ()])
def test_tensor_round_trip(dtype: str, shape: tuple[int, ...]) -> None:
    t = _tensor(dtype, shape)
    msg = wire_tensor.tensor_to_proto(t)
    assert msg.dtype == dtype and tuple(msg.shape) == shape
    assert len(msg.data) == t.numel() * t.element_size()
    back = wire_tensor.proto_to_tensor(pb.Tensor.FromString(msg.SerializeToString()))
    assert back.dtype == t.dtype and back.shape == t.shape
    assert torch.equal(back, t)
    back.add_(1)  # writable and owns its memory
    assert back.is_contiguous()


def test_one_dtype_table_behind_config_loader_and_wire() -> None:
    """The station dtypes are config's names, with config's byte sizes, in the loader and on the wire."""
    from mesh.core.config import DTYPE_BYTES, SUPPORTED_DTYPES
    from mesh.core.model.loader import TORCH_DTYPES

    assert tuple(TORCH_DTYPES) == SUPPORTED_DTYPES
    assert {name: dt.itemsize for name, dt in TORCH_DTYPES.items()} == DTYPE_BYTES
    assert set(wire_tensor.DTYPES) == set(SUPPORTED_DTYPES) | {"int32", "int64"}
    assert all(wire_tensor.DTYPES[name] is dt for name, dt in TORCH_DTYPES.items())
    assert all(wire_tensor.dtype_itemsize(name) == size for name, size in DTYPE_BYTES.items())


def test_tensor_non_contiguous_and_little_endian() -> None:
    t = torch.arange(12, dtype=torch.int32).reshape(3, 4).t()  # [4, 3], not contiguous
    msg = wire_tensor.tensor_to_proto(t)
    assert torch.equal(wire_tensor.proto_to_tensor(msg), t)
    assert wire_tensor.tensor_to_proto(torch.tensor([1], dtype=torch.int32)).data == b"\x01\x00\x00\x00"
    assert wire_tensor.tensor_to_proto(torch.tensor([1.0], dtype=torch.bfloat16)).data == b"\x80\x3f"


def test_tensor_decoded_does_not_alias_message() -> None:
    msg = wire_tensor.tensor_to_proto(torch.zeros(4))
    a = wire_tensor.proto_to_tensor(msg)
    a.fill_(3.0)
    assert torch.equal(wire_tensor.proto_to_tensor(msg), torch.zeros(4))


def test_tensor_unsupported_dtype() -> None:
    with _raises("tensor.dtype"):
        wire_tensor.tensor_to_proto(torch.zeros(2, dtype=torch.float64))


def test_tensor_validation_errors() -> None:
    good = wire_tensor.tensor_to_proto(torch.zeros(2, 3))
    with _raises("tensor.dtype"):
        wire_tensor.proto_to_tensor(pb.Tensor(dtype="float64", shape=[2], data=bytes(16)))
    with _raises("hidden.dtype"):
        wire_tensor.proto_to_tensor(good, expect_dtype="bfloat16", field="hidden")
    with _raises("tensor.shape[1]"):
        wire_tensor.proto_to_tensor(pb.Tensor(dtype="float32", shape=[2, -3], data=b""))
    with _raises("tensor.data"):
        wire_tensor.proto_to_tensor(pb.Tensor(dtype="float32", shape=[2, 3], data=bytes(20)))
    with _raises("tensor.data"):
        wire_tensor.proto_to_tensor(pb.Tensor(dtype="float32", shape=[2, 3], data=bytes(28)))
    with _raises("tensor.shape"):
        wire_tensor.proto_to_tensor(good, expect_shape=(2, 3, 1))
    with _raises("tensor.shape[0]"):
        wire_tensor.proto_to_tensor(good, expect_shape=(4, None))
    assert wire_tensor.proto_to_tensor(good, expect_shape=(None, 3)).shape == (2, 3)
    with _raises("tensor"):
        wire_tensor.proto_to_tensor(good, max_bytes=23)
    assert wire_tensor.proto_to_tensor(good, max_bytes=24).shape == (2, 3)
    with _raises("tensor.shape"):
        wire_tensor.proto_to_tensor(pb.Tensor(dtype="int64", shape=[1] * 9, data=bytes(8)))


def test_tensor_huge_dims() -> None:
    big = 2**62
    # the product overflows int64: refused before any allocation, even with a zero dim
    with _raises("tensor.shape"):
        wire_tensor.proto_to_tensor(pb.Tensor(dtype="float32", shape=[big, big, 0], data=b""))
    with _raises("tensor.shape"):
        wire_tensor.proto_to_tensor(pb.Tensor(dtype="float32", shape=[big, big], data=bytes(8)))
    # fits in int64 but exceeds the byte budget / the payload
    with _raises("tensor"):
        wire_tensor.proto_to_tensor(pb.Tensor(dtype="float32", shape=[2**20, 2**20], data=bytes(8)), max_bytes=2**30)
    with _raises("tensor.data"):
        wire_tensor.proto_to_tensor(pb.Tensor(dtype="bfloat16", shape=[2**31, 2**20], data=bytes(8)))


# ---- entries -----------------------------------------------------------------------------------

def test_entries_round_trip() -> None:
    sp = SamplingParams(max_tokens=1, temperature=0.7, top_p=0.9, top_k=40, seed=2**63 - 1, logprobs=5)
    entries = _entries() + (WaveEntry(11, 3, 4, sp),)
    msgs = wire.entries_to_proto(entries)
    assert not msgs[0].HasField("sample") and msgs[1].HasField("sample")
    assert wire.proto_to_entries(msgs) == entries  # 0.7 / 0.9 survive float32 exactly


def test_entries_encode_errors() -> None:
    with _raises("entries[0]"):
        wire.entries_to_proto([(1, 0, 1)])
    with _raises("entries[1]"):
        wire.entries_to_proto([WaveEntry(1, 0, 1), WaveEntry(2, 2**32, 1)])


@pytest.mark.parametrize("field,value,expect", [
    ("top_p", 0.0, "entries[1].sample.top_p"),
    ("top_p", 1.5, "entries[1].sample.top_p"),
    ("temperature", -1.0, "entries[1].sample.temperature"),
    ("temperature", float("nan"), "entries[1].sample.temperature"),
    ("temperature", float("inf"), "entries[1].sample.temperature"),
    ("seed", 2**63, "entries[1].sample.seed"),
    ("logprobs", 21, "entries[1].sample.logprobs"),
])
def test_entries_bad_sampling(field: str, value: object, expect: str) -> None:
    msgs = wire.entries_to_proto(_entries())
    setattr(msgs[1].sample, field, value)
    with _raises(expect):
        wire.proto_to_entries(msgs)


def test_entries_bad_rows_and_duplicates() -> None:
    msgs = wire.entries_to_proto(_entries())
    msgs[2].n_tokens = 0
    with _raises("entries[2].n_tokens"):
        wire.proto_to_entries(msgs)
    msgs = wire.entries_to_proto(_entries())
    msgs[2].seq_id = 7
    with pytest.raises(WireError, match=r"^entries\[2\]\.seq_id: 7 already appears at entries\[0\]"):
        wire.proto_to_entries(msgs)


# ---- samples -----------------------------------------------------------------------------------

def test_samples_round_trip() -> None:
    samples = [None, SampledToken(5), SampledToken(6, -0.25, ((6, -0.25), (1, -1.5))), SampledToken(0, -0.0)]
    msg = pb.Samples.FromString(wire.samples_to_proto(samples).SerializeToString())
    assert wire.proto_to_samples(msg, n_entries=4, vocab_size=10) == samples
    assert wire.proto_to_samples(pb.Samples()) == []


def test_samples_errors() -> None:
    msg = wire.samples_to_proto([SampledToken(5, -0.5, ((5, -0.5),)), None])
    with _raises("samples"):
        wire.proto_to_samples(msg, n_entries=3)
    with _raises("samples[0].token_id"):
        wire.proto_to_samples(msg, vocab_size=5)
    bad = pb.Samples(); bad.CopyFrom(msg); bad.samples[0].top[0].token_id = 99
    with _raises("samples[0].top[0].token_id"):
        wire.proto_to_samples(bad, vocab_size=10)
    bad = pb.Samples(); bad.CopyFrom(msg); bad.samples[0].logprob = float("nan")
    with _raises("samples[0].logprob"):
        wire.proto_to_samples(bad)
    bad = pb.Samples(); bad.CopyFrom(msg); bad.samples[0].top[0].logprob = 0.5
    with pytest.raises(WireError, match=r"^samples\[0\]\.top\[0\]\.logprob: must be a log-probability <= 0, got 0\.5$"):
        wire.proto_to_samples(bad)
    bad = pb.Samples(); bad.CopyFrom(msg); bad.samples[1].logprob = -1.0
    with _raises("samples[1]"):
        wire.proto_to_samples(bad)
    with _raises("samples[0]"):
        wire.samples_to_proto([SampledToken(2**40)])


# ---- forward -----------------------------------------------------------------------------------

def test_forward_round_trip_token_ids() -> None:
    entries = _entries()
    req = wire.encode_forward(42, entries, [1, 2, 3, 99, 0, 5], None)
    req = pb.ForwardRequest.FromString(req.SerializeToString())
    wave_id, got, ids, hidden = wire.decode_forward(req, **LIMITS)
    assert (wave_id, got, hidden) == (42, entries, None)
    assert ids.dtype == torch.int64 and ids.tolist() == [1, 2, 3, 99, 0, 5]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_forward_round_trip_hidden(dtype: str) -> None:
    h = _tensor(dtype, (6, 8))
    req = pb.ForwardRequest.FromString(wire.encode_forward(1, _entries(), None, h).SerializeToString())
    wave_id, entries, ids, hidden = wire.decode_forward(req, **{**LIMITS, "dtype": dtype})
    assert wave_id == 1 and entries == _entries() and ids is None and torch.equal(hidden, h)


def test_encode_forward_errors() -> None:
    h = torch.zeros(6, 8, dtype=torch.bfloat16)
    with _raises("payload"):
        wire.encode_forward(1, _entries(), None, None)
    with _raises("payload"):
        wire.encode_forward(1, _entries(), [0] * 6, h)
    with _raises("token_ids.ids"):
        wire.encode_forward(1, _entries(), [0] * 5, None)
    with _raises("token_ids.ids"):
        wire.encode_forward(1, _entries(), [0, 0, 0, 0, 0, 2**31], None)
    with _raises("hidden.shape"):
        wire.encode_forward(1, _entries(), None, h[:5])


def _hidden_req(dtype: str = "bfloat16", rows: int = 6, width: int = 8) -> pb.ForwardRequest:
    req = wire.encode_forward(3, _entries(), None, torch.zeros(6, 8, dtype=torch.bfloat16))
    req.hidden.CopyFrom(wire_tensor.tensor_to_proto(torch.zeros(rows, width, dtype=wire_tensor.DTYPES[dtype])))
    return req


def test_decode_forward_errors() -> None:
    with _raises("hidden.dtype"):
        wire.decode_forward(_hidden_req("float32"), **LIMITS)
    with _raises("hidden.shape[0]"):  # rows mismatch
        wire.decode_forward(_hidden_req(rows=5), **LIMITS)
    with _raises("hidden.shape[1]"):
        wire.decode_forward(_hidden_req(width=7), **LIMITS)
    req = _hidden_req(); req.hidden.data = req.hidden.data[:-2]
    with _raises("hidden.data"):
        wire.decode_forward(req, **LIMITS)
    req = _hidden_req(); req.hidden.shape[:] = [6, 8, 1]
    with _raises("hidden.shape"):
        wire.decode_forward(req, **LIMITS)

    req = wire.encode_forward(3, _entries(), [1] * 6, None)
    req.token_ids.ids[4] = 100
    with _raises("token_ids.ids[4]"):
        wire.decode_forward(req, **LIMITS)
    req.token_ids.ids[4] = -1
    with _raises("token_ids.ids[4]"):
        wire.decode_forward(req, **LIMITS)
    req.token_ids.ids.append(1)
    with _raises("token_ids.ids"):  # rows mismatch
        wire.decode_forward(req, **LIMITS)

    req = wire.encode_forward(3, _entries(), [1] * 6, None)
    req.ClearField("token_ids")
    with _raises("payload"):
        wire.decode_forward(req, **LIMITS)
    req.entries[1].seq_id = req.entries[0].seq_id
    with _raises("entries[1].seq_id"):
        wire.decode_forward(req, **LIMITS)
    with _raises("entries"):
        wire.decode_forward(pb.ForwardRequest(token_ids=pb.TokenIds(ids=[1])), **LIMITS)
    with _raises("entries"):
        wire.decode_forward(wire.encode_forward(3, _entries(), [1] * 6, None), **{**LIMITS, "max_entries": 2})
    with _raises("entries"):
        wire.decode_forward(wire.encode_forward(3, _entries(), [1] * 6, None), **{**LIMITS, "max_rows": 5})
    req = wire.encode_forward(3, _entries(), [1] * 6, None)
    req.entries[1].sample.top_p = 2.0
    with _raises("entries[1].sample.top_p"):
        wire.decode_forward(req, **LIMITS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_decode_forward_refuses_non_finite_rows_and_takes_the_largest_finite(dtype: str) -> None:
    torch_dtype = wire_tensor.DTYPES[dtype]
    largest = torch.finfo(torch_dtype).max
    req = _hidden_req(dtype)
    req.hidden.CopyFrom(wire_tensor.tensor_to_proto(torch.full((6, 8), largest, dtype=torch_dtype)))
    _, _, _, hidden = wire.decode_forward(req, **{**LIMITS, "dtype": dtype})  # every value at the top of the range
    assert bool((hidden == largest).all())
    for row, values in ((0, [float("nan")]), (3, [float("inf")]), (5, [float("-inf")]),
                        (2, [float("inf"), float("-inf")])):  # both infinities in one row
        h = torch.full((6, 8), -largest, dtype=torch_dtype)
        for col, v in enumerate(values):
            h[row, col] = v
        req.hidden.CopyFrom(wire_tensor.tensor_to_proto(h))
        with _raises(f"hidden[{row}]"):
            wire.decode_forward(req, **{**LIMITS, "dtype": dtype})


def test_all_finite_on_every_float_width() -> None:
    huge = torch.full((4, 4), torch.finfo(torch.float64).max, dtype=torch.float64)
    assert wire_tensor.all_finite(huge)
    huge[1, 2] = float("nan")
    assert not wire_tensor.all_finite(huge)
    assert wire_tensor.all_finite(torch.arange(5)) and wire_tensor.all_finite(torch.empty(0, 8))
    assert wire_tensor.all_finite(torch.full((3, 5), -1e-40)[:, 1:4])  # subnormal, not contiguous
    assert not wire_tensor.all_finite(torch.tensor([1.0, float("-inf")], dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_all_finite_agrees_with_torch_on_every_16_bit_pattern(dtype) -> None:
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)  # all 65536 patterns
    finite = torch.isfinite(every.float()).tolist()
    assert sum(not f for f in finite) == (256 if dtype == torch.bfloat16 else 2048)  # +-inf and every NaN
    rows = torch.full((3, 8), 1.5, dtype=dtype)
    for i, want in enumerate(finite):
        rows[1, 5] = every[i]  # one pattern among finite rows
        assert wire_tensor.all_finite(rows) is want, (dtype, hex(i - (1 << 15) & 0xFFFF))


@pytest.mark.parametrize("bits_dtype,dtype,patterns", [
    (torch.int32, torch.float32, {0x7F7FFFFF: True, 0x7F800000: False, 0x7F800001: False, 0x7FFFFFFF: False,
                                  0xFF7FFFFF: True, 0xFF800000: False, 0xFF800001: False, 0xFFFFFFFF: False,
                                  0x80000000: True, 0x00000001: True, 0x80000001: True}),
    (torch.int64, torch.float64, {0x7FEFFFFFFFFFFFFF: True, 0x7FF0000000000000: False, 0x7FFFFFFFFFFFFFFF: False,
                                  0xFFEFFFFFFFFFFFFF: True, 0xFFF0000000000000: False, 0xFFFFFFFFFFFFFFFF: False,
                                  0xFFF8000000000000: False, 0x8000000000000000: True})])
def test_all_finite_at_the_edges_of_the_wider_floats(bits_dtype, dtype, patterns) -> None:
    width = torch.iinfo(bits_dtype).bits
    for pattern, want in patterns.items():
        signed = pattern - (1 << width) if pattern >> (width - 1) else pattern
        rows = torch.full((2, 4), -2.0, dtype=dtype)
        rows.view(bits_dtype)[1, 2] = signed
        assert wire_tensor.all_finite(rows) is want, hex(pattern)


def test_entries_sharing_sampling_values_share_one_object_and_others_keep_theirs() -> None:
    greedy, hot = SamplingParams(max_tokens=1), SamplingParams(max_tokens=1, temperature=0.7, top_p=0.9, seed=3)
    sent = tuple(WaveEntry(i, 4, 1, greedy if i % 2 else hot) for i in range(6))
    got = wire.proto_to_entries(wire.entries_to_proto(sent))
    assert got == sent
    assert got[1].sample is got[3].sample and got[0].sample is got[2].sample and got[0].sample is not got[1].sample


def test_decoded_entries_are_the_checked_kind_and_stay_frozen() -> None:
    sent = _entries()
    for got, want in zip(wire.proto_to_entries(wire.entries_to_proto(sent)), sent):
        assert type(got) is WaveEntry and got == want and hash(got) == hash(want) and got.end_pos == want.end_pos
        with pytest.raises(AttributeError):  # dataclasses.FrozenInstanceError
            got.start_pos = 99  # type: ignore[misc]


def test_entries_encoded_into_a_request_match_the_list() -> None:
    req = pb.ForwardRequest(wave_id=5)
    assert wire.entries_to_proto(_entries(), into=req.entries) is req.entries
    assert list(req.entries) == wire.entries_to_proto(_entries())
    with _raises("entries[1]"):
        wire.entries_to_proto([WaveEntry(1, 0, 1), WaveEntry(2, 2**32, 1)], into=pb.ForwardRequest().entries)


def test_decoded_samplings_are_kept_across_waves_and_bounded() -> None:
    hot = SamplingParams(max_tokens=1, temperature=0.7, top_p=0.9, seed=11)
    first = wire.proto_to_entries(wire.entries_to_proto([WaveEntry(1, 0, 1, hot)]))[0].sample
    again = wire.proto_to_entries(wire.entries_to_proto([WaveEntry(2, 5, 1, hot)]))[0].sample
    assert first == again and first is again  # the second wave did not decode it again
    msgs = wire.entries_to_proto([WaveEntry(1, 0, 1, hot)])
    msgs[0].sample.top_p = 1.5  # a bad value is refused every time, never kept
    for _ in range(2):
        with _raises("entries[0].sample.top_p"):
            wire.proto_to_entries(msgs)
    for seed in range(3 * wire._SAMPLINGS_KEPT):
        sp = SamplingParams(max_tokens=1, temperature=0.5, seed=seed)
        assert wire.proto_to_entries(wire.entries_to_proto([WaveEntry(1, 0, 1, sp)]))[0].sample == \
            SamplingParams(max_tokens=1, temperature=0.5, seed=seed)
        assert len(wire._samplings) <= wire._SAMPLINGS_KEPT


def test_sampled_token_ids_checks_what_the_next_step_feeds() -> None:
    msg = wire.samples_to_proto([SampledToken(5), SampledToken(0, -0.5), SampledToken(99)])
    assert wire.sampled_token_ids(msg, n_entries=3, vocab_size=100) == [5, 0, 99]
    with pytest.raises(WireError, match="expected 4"):
        wire.sampled_token_ids(msg, n_entries=4, vocab_size=100)
    with pytest.raises(WireError, match="token id 99 is outside the vocabulary"):
        wire.sampled_token_ids(msg, n_entries=3, vocab_size=99)
    msg.samples[1].token_id = -3
    with pytest.raises(WireError, match="token id -3 is outside the vocabulary"):
        wire.sampled_token_ids(msg, n_entries=3, vocab_size=100)
    absent = wire.samples_to_proto([SampledToken(5), None])
    with pytest.raises(WireError, match="without a token"):
        wire.sampled_token_ids(absent, n_entries=2, vocab_size=100)


# ---- no object deserialization ----------------------------------------------------------------

def test_wire_never_unpickles(monkeypatch: pytest.MonkeyPatch) -> None:
    src = inspect.getsource(wire)
    assert "pickle" not in src and "torch.load" not in src and "torch.save" not in src

    def refuse(*_a, **_k):
        raise AssertionError("mesh.core.wire must not deserialize Python objects")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    h = torch.randn(6, 8).to(torch.bfloat16)
    req = pb.ForwardRequest.FromString(wire.encode_forward(5, _entries(), None, h).SerializeToString())
    _, _, _, hidden = wire.decode_forward(req, **LIMITS)
    assert torch.equal(hidden, h)
    samples = [SampledToken(3, -0.5), None]
    assert wire.proto_to_samples(pb.Samples.FromString(wire.samples_to_proto(samples).SerializeToString())) == samples
