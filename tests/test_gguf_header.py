"""The fast GGUF header reader and dequantizer: the `gguf` package's values bit for bit, one parse per unchanged file."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from mesh.core.model.gguf_dequant import dequantize_f32
from mesh.core.model.gguf_file import SUPPORTED_TYPES, GGUFCheckpoint, GGUFError
from mesh.core.model.gguf_header import GGUFHeader, StringArray, read_header

TOKENS = [f"tok{i}" for i in range(300)] + ["héllo", "☃", ""]
QUANTIZED = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1)


def _write(path, name: str = "tiny"):
    """A GGUF with a value of every kind the header holds and one small tensor of each quantizable type."""
    rng = np.random.default_rng(1)
    w = GGUFWriter(path, "llama")
    w.add_name(name)
    w.add_block_count(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_bool("test.flag", True)
    w.add_int8("test.i8", -3)
    w.add_uint16("test.u16", 65535)
    w.add_int64("test.i64", -(2**40))
    w.add_uint64("test.u64", 2**63 + 5)
    w.add_float64("test.f64", 0.1)
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.floats", [0.5, 1.25])
    w.add_token_list(TOKENS)
    w.add_token_types([1] * len(TOKENS))
    w.add_token_merges(["t o", "o k"])
    w.add_chat_template("{{ messages }}")
    for qtype in QUANTIZED:
        data = rng.standard_normal((4, 64)).astype(np.float32)
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(f"t.{qtype.name}", data.astype(np.float16 if qtype == Q.F16 else np.float32))
        else:
            w.add_tensor(f"t.{qtype.name}", quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_header_reads_every_value_and_tensor_as_the_gguf_package_does(tmp_path):
    path = _write(tmp_path / "a.gguf")
    ours, ref = GGUFHeader(path), GGUFReader(path)
    names = [f.name for f in ref.fields.values() if not f.name.startswith("GGUF.")]
    assert sorted(names) == sorted(ours.fields) and len(names) > 15
    for name in names:
        want, got = ref.fields[name].contents(), ours.value(name)
        assert got == want and type(got) is type(want), name
        if isinstance(want, list) and want:
            assert type(got[0]) is type(want[0]), name
    assert isinstance(ours.fields["tokenizer.ggml.tokens"], StringArray)  # walked, not decoded, until asked
    assert ours.length("tokenizer.ggml.tokens") == len(TOKENS) and ours.length("test.ints") == 3
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for mine, theirs in zip(ours.tensors, ref.tensors):
        assert (mine.tensor_type, mine.shape, mine.data_offset, mine.n_bytes) == \
            (theirs.tensor_type, tuple(theirs.shape.tolist()), theirs.data_offset, theirs.n_bytes), mine.name
        assert np.array_equal(ours.tensor_bytes(mine).reshape(-1), np.asarray(theirs.data).view(np.uint8).reshape(-1))
        assert np.array_equal(dequantize_f32(ours.tensor_bytes(mine), mine.tensor_type),
                              dequantize(np.asarray(theirs.data), theirs.tensor_type)), mine.name


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda q: q.name)
def test_dequantized_bits_equal_the_gguf_package(qtype):
    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(int(qtype)).integers(0, 256, (6, 3 * size), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):  # random bytes hold NaN and inf scales: same bits either way
        ours, ref = dequantize_f32(raw, qtype), np.asarray(dequantize(raw, qtype), dtype=np.float32)
    assert ours.dtype == np.float32 and ours.shape == ref.shape == (6, 3 * block) and ours.flags.writeable
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))


def test_a_header_is_parsed_once_while_the_file_is_unchanged(tmp_path):
    path = _write(tmp_path / "m.gguf")
    first = read_header(path)
    assert read_header(tmp_path / "." / "m.gguf") is first  # the same file by another spelling
    _write(path, name="a longer name than before")
    again = read_header(path)
    assert again is not first and again.value("general.name") == "a longer name than before"


def test_a_header_cut_inside_the_vocabulary_is_refused(tmp_path):
    path = _write(tmp_path / "whole.gguf")
    tokens = GGUFHeader(path).fields["tokenizer.ggml.tokens"]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:tokens.offset + 40])
    with pytest.raises(GGUFError, match=r"cut\.gguf: not a complete GGUF file .*truncated"):
        GGUFCheckpoint(cut)
    with pytest.raises(GGUFError, match=r"not a GGUF file"):
        GGUFCheckpoint(_bytes(tmp_path / "text.gguf", b"hello, not a model at all" * 4))


def test_a_quantized_row_that_is_not_whole_blocks_is_refused_on_open(tmp_path):
    data = bytearray(_write(tmp_path / "whole.gguf").read_bytes())
    dims = data.index(b"t.Q8_0") + len(b"t.Q8_0") + 4  # after the name: n_dims (u32), then the row length (u64)
    data[dims:dims + 8] = (48).to_bytes(8, "little")
    with pytest.raises(GGUFError, match=r"rows\.gguf: .*tensor t\.Q8_0: rows of 48 values are not whole Q8_0 blocks"):
        GGUFCheckpoint(_bytes(tmp_path / "rows.gguf", bytes(data)))


def test_a_tensor_of_more_than_four_dimensions_is_refused_on_open(tmp_path):
    data = bytearray(_write(tmp_path / "whole.gguf").read_bytes())
    n_dims = data.index(b"t.Q8_0") + len(b"t.Q8_0")  # after the name: n_dims (u32)
    data[n_dims:n_dims + 4] = (9).to_bytes(4, "little")
    with pytest.raises(GGUFError, match=r"dims\.gguf: .*tensor t\.Q8_0: 9 dimensions \(GGUF tensors have at most 4\)"):
        GGUFCheckpoint(_bytes(tmp_path / "dims.gguf", bytes(data)))


def _bytes(path, data: bytes):
    path.write_bytes(data)
    return path


def test_value_types_cover_the_format():
    from mesh.core.model.gguf_header import _SCALARS

    assert set(_SCALARS) | {GGUFValueType.STRING, GGUFValueType.ARRAY} == set(GGUFValueType)
