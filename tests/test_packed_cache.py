"""The node's cache of packed GGUF weights: a later station maps what an earlier one packed, with the same bits."""
from __future__ import annotations

import gc
import json
import os
import re
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import mesh.core.model.packed as packed
import mesh.core.model.packed_cache as packed_cache
from mesh.core.compute import on_compute_thread
from mesh.core.config import ModelConfig, StationSpec
from mesh.core.model.gguf_write import write_gguf
from mesh.core.model.kernels import resolve_linear_backend
from mesh.core.model.packed_cache import MAGIC, ORPHAN_S, PackedCache, wait_for_stores
from mesh.core.model.synthetic import write_checkpoint
from mesh.core.params import SamplingParams
from mesh.core.wave import WaveEntry
from station.actor import StationActor
from station.step import Station

pytestmark = pytest.mark.skipif(resolve_linear_backend("auto", torch.device("cpu"), torch.float32) != "packed",
                                reason="the packed native kernels do not build on this machine")
CFG = ModelConfig(arch="llama", vocab_size=512, hidden_size=96, intermediate_size=160, num_hidden_layers=4,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                  rope_theta=10000.0, max_position_embeddings=1024, tie_word_embeddings=True)
PROMPTS = [[1, 17, 300, 45, 99, 7, 250], [5, 9], [400, 3, 77]]


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed-cache")
    return write_gguf(write_checkpoint(root / "tiny", CFG), root / "tiny-Q4_1.gguf", Q.Q4_1)


@pytest.fixture
def packed_layers(monkeypatch):
    """The GGUF layers (their indices, "head" for the tied head) packed in this process from now on."""
    seen: list[str] = []
    fill = packed._fill

    def counting_fill(parts, out):
        for p in parts:
            m = re.search(r"(?:blk|layers)\.(\d+)\.", p.name)
            seen.append(m.group(1) if m else "head")
        return fill(parts, out)
    monkeypatch.setattr(packed, "_fill", counting_fill)
    return seen


def _station(path, layers, cache=""):
    station = Station(path, StationSpec(layers=layers, packed_cache=str(cache)))
    assert wait_for_stores(60)
    return station


def _run(stations: list[Station]) -> torch.Tensor:
    """The prompts' last-row logits through the stations in order (a batched prefill)."""
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    entries = tuple(WaveEntry(i, 0, len(p), greedy) for i, p in enumerate(PROMPTS))
    out = stations[0].forward(entries, token_ids=torch.tensor([t for p in PROMPTS for t in p]),
                              want_logits=stations[0].is_last)
    for st in stations[1:]:
        out = st.forward(entries, hidden=out.hidden, want_logits=st.is_last)
    return out.logits


def test_a_later_station_maps_the_layers_an_earlier_one_packed(q4_gguf, tmp_path, packed_layers):
    cache = tmp_path / "cache"
    reference = _run([_station(q4_gguf, (0, 4))])  # no cache
    first = _station(q4_gguf, (0, 4), cache)
    entries = PackedCache.for_gguf(cache, q4_gguf).directory
    assert sorted(p.name for p in entries.iterdir()) == sorted(
        ["source.json", "lm_head.bin"] + [f"layer{i}.bin" for i in range(4)])
    assert all(p.read_bytes()[:8] == MAGIC for p in entries.glob("*.bin"))
    assert (first.stats().packed_mapped, first.stats().packed_at_load) == (0, 5)  # 4 layers and the head
    packed_layers.clear()
    second = _station(q4_gguf, (0, 4), cache)
    assert packed_layers == []  # every weight mapped, none packed
    assert (second.stats().packed_mapped, second.stats().packed_at_load) == (5, 0)
    assert second.packed_load.mapped == ("layer0", "layer1", "layer2", "layer3", "lm_head")
    assert torch.equal(_run([first]), reference) and torch.equal(_run([second]), reference)


def test_a_resplit_maps_what_is_cached_and_packs_the_rest(q4_gguf, tmp_path, packed_layers):
    cache = tmp_path / "cache"
    reference = _run([_station(q4_gguf, (0, 2)), _station(q4_gguf, (2, 4))])
    _station(q4_gguf, (0, 2), cache)
    packed_layers.clear()
    second = _station(q4_gguf, (1, 4), cache)  # layer 1 cached; 2, 3 and the head not yet
    assert sorted(set(packed_layers)) == ["2", "3", "head"]
    packed_layers.clear()
    first = _station(q4_gguf, (0, 1), cache)
    assert packed_layers == []
    assert torch.equal(_run([first, second]), reference)


def test_an_entry_that_does_not_match_is_packed_again_and_replaced(q4_gguf, tmp_path, packed_layers):
    cache, path = tmp_path / "cache", tmp_path / "model.gguf"
    shutil.copy(q4_gguf, path)
    reference = _run([_station(path, (0, 4), cache)])
    entries = PackedCache.for_gguf(cache, path).directory
    whole = (entries / "layer1.bin").stat().st_size
    with open(entries / "layer1.bin", "r+b") as f:  # cut short
        f.truncate(whole - 100)
    (entries / "layer2.bin").write_bytes(b"XX" + (entries / "layer2.bin").read_bytes()[2:])  # not our magic
    packed_layers.clear()
    assert torch.equal(_run([_station(path, (0, 4), cache)]), reference)
    assert sorted(set(packed_layers)) == ["1", "2"]
    assert (entries / "layer1.bin").stat().st_size == whole and (entries / "layer2.bin").read_bytes()[:8] == MAGIC
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the GGUF changed (as far as the cache knows)
    packed_layers.clear()
    assert torch.equal(_run([_station(path, (0, 4), cache)]), reference)
    assert sorted(set(packed_layers)) == ["0", "1", "2", "3", "head"]
    assert json.loads((entries / "source.json").read_text())["mtime_ns"] == st.st_mtime_ns + 10**9


def test_entries_of_a_gguf_that_is_gone_and_orphans_are_swept_and_nothing_else(q4_gguf, tmp_path):
    cache, gone = tmp_path / "cache", tmp_path / "gone.gguf"
    shutil.copy(q4_gguf, gone)
    _station(gone, (0, 1), cache)
    gone_dir = PackedCache.for_gguf(cache, gone).directory
    gone.unlink()
    (cache / "notes").mkdir()  # not an entry directory: left alone
    (cache / "notes" / "keep.txt").write_text("mine")
    entries = PackedCache.for_gguf(cache, q4_gguf).directory
    entries.mkdir(parents=True)
    orphan, writing = entries / ".layer2.bin.123.456", entries / ".layer3.bin.789.10"  # a dead store's, a live one's
    orphan.write_bytes(b"half")
    writing.write_bytes(b"half")
    os.utime(orphan, (orphan.stat().st_atime - 2 * ORPHAN_S, orphan.stat().st_mtime - 2 * ORPHAN_S))
    _station(q4_gguf, (0, 1), cache)
    assert not gone_dir.exists() and (cache / "notes" / "keep.txt").read_text() == "mine"
    assert (entries / "layer0.bin").is_file() and not orphan.exists() and writing.exists()


def test_a_station_process_says_what_it_mapped(q4_gguf, tmp_path, capfd):
    threads = on_compute_thread(torch.get_num_threads)  # the actor pins its threads: given back below
    spec = StationSpec(layers=(0, 2), packed_cache=str(tmp_path / "cache"))
    try:
        for _ in range(2):
            StationActor(str(q4_gguf), spec).shutdown(0)
            assert wait_for_stores(60)
    finally:
        on_compute_thread(torch.set_num_threads, threads)
        gc.unfreeze()  # a station process keeps what its start froze; this test process need not
    said = [line for line in capfd.readouterr().err.splitlines() if "packed cache" in line]
    assert len(said) == 2 and all(line.startswith("wavemesh station [0, 2): loaded in ") for line in said), said
    assert "0 of 2 layers" in said[0] and "2 of 2 layers" in said[1]
    assert str(PackedCache.for_gguf(tmp_path / "cache", q4_gguf).directory) in said[1]


def test_an_unwritable_cache_leaves_the_station_serving(q4_gguf, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    reference = _run([_station(q4_gguf, (0, 4))])
    assert torch.equal(_run([_station(q4_gguf, (0, 4), blocker / "cache")]), reference)


def test_corrupt_entries_never_raise_and_are_packed_again(q4_gguf, tmp_path, packed_layers):
    """Random damage to an entry's header or length (bounded: 24 cases) falls back to packing, never an error."""
    cache = tmp_path / "cache"
    reference = _run([_station(q4_gguf, (0, 4), cache)])
    entry = PackedCache.for_gguf(cache, q4_gguf).directory / "layer0.bin"
    good = entry.read_bytes()
    rng = np.random.default_rng(7)
    for case in range(24):
        bad = bytearray(good)
        if case % 3 == 0:  # a byte of the magic, the length or the description changed
            at = int(rng.integers(0, 16 + 64))
            bad[at] ^= int(rng.integers(1, 256))
        elif case % 3 == 1:  # cut anywhere, the header included
            bad = bad[:int(rng.integers(0, len(bad)))]
        else:  # garbage of a random length
            bad = bytearray(rng.integers(0, 256, int(rng.integers(0, 4096)), dtype=np.uint8).tobytes())
        entry.write_bytes(bytes(bad))
        packed_layers.clear()
        assert torch.equal(_run([_station(q4_gguf, (0, 4), cache)]), reference), case
        assert packed_layers and set(packed_layers) == {"0"}, case  # packed again ...
        assert entry.read_bytes() == good, case  # ... and the entry rewritten whole


def test_a_store_that_would_nearly_fill_the_disk_writes_nothing(q4_gguf, tmp_path, monkeypatch, capfd):
    cache = tmp_path / "cache"
    total = 100 * 2**30
    free = SimpleNamespace(total=total, used=total - 2**30, free=10 * 2**30 + 1024)  # 10% free and 1 KiB
    monkeypatch.setattr(packed_cache.shutil, "disk_usage", lambda path: free)
    reference = _run([_station(q4_gguf, (0, 4))])
    assert torch.equal(_run([_station(q4_gguf, (0, 4), cache)]), reference)  # serves all the same
    assert list(PackedCache.for_gguf(cache, q4_gguf).directory.glob("*.bin")) == []
    assert "not stored" in capfd.readouterr().err


@pytest.mark.parametrize("qtype,dtype", [(Q.F16, torch.float16), (Q.BF16, torch.bfloat16)])
def test_narrow_tiles_are_cached_and_mapped_as_they_were_packed(tmp_path, qtype, dtype):
    """A GGUF's F16 / BF16 matrices are packed into float16 / bfloat16 tiles (their values exactly); a later station
    maps those tiles from the cache, of the same type, and gives the same logits."""
    ckpt = write_checkpoint(tmp_path / "tiny", CFG, dtype="float16" if qtype == Q.F16 else "bfloat16")
    gguf = write_gguf(ckpt, tmp_path / f"tiny-{qtype.name}.gguf", qtype)
    cache = tmp_path / "cache"
    first = _station(gguf, (0, 4), cache)
    second = _station(gguf, (0, 4), cache)
    assert (second.stats().packed_mapped, second.stats().packed_at_load) == (5, 0)
    for station in (first, second):
        held = {m.weight.dtype for m in station.model.modules() if getattr(m, "weight_layout", "") == "packed"}
        assert held == {dtype}
    assert torch.equal(_run([second]), _run([first]))
