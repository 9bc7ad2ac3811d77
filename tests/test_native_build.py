"""The native kernels' cache key covers every file the compiler reads, so an edited header builds afresh; and they
are compiled once per machine, never per wave shape."""
from __future__ import annotations

import re
import shutil

import pytest
import torch

import mesh.core.model.native as native
from mesh.core.config import StationSpec
from mesh.core.model.kernels import resolve_linear_backend
from mesh.core.model.native import HEADERS, SOURCES, kernel_dir, library_name
from mesh.core.params import SamplingParams
from mesh.core.wave import WaveEntry
from station.step import Station


def test_every_included_header_is_part_of_the_key():
    included = {m for src in SOURCES for m in re.findall(r'#include "([^"]+)"', src.read_text())}
    assert included and included <= {h.name for h in HEADERS}


def test_an_edited_header_names_another_library(tmp_path):
    for p in SOURCES + HEADERS:
        shutil.copy(p, tmp_path / p.name)
    files = tuple(tmp_path / p.name for p in SOURCES + HEADERS)
    before = library_name(files)
    header = tmp_path / HEADERS[0].name
    text = header.read_text()
    header.write_text(text + "\n/* edited */\n")
    assert library_name(files) != before
    header.write_text(text)
    assert library_name(files) == before  # the bytes alone name it: the edit undone, the same library


def test_the_cpu_vendor_chooses_the_request_policy_and_names_its_library(monkeypatch):
    """Intel builds request streamed weights into L1 (WAVEMESH_PREFETCH_T0), AMD family-25 builds spread the next
    block's requests into L2 (WAVEMESH_SPREAD_L2), others keep the non-temporal policy; each build is a different
    library, so a cache shared across machines never loads another's."""
    names, flags = {}, {}
    for vendor, family in (("GenuineIntel", "6"), ("AuthenticAMD", "25"), ("AuthenticAMD", "26")):
        monkeypatch.setattr(native, "_cpu_vendor", lambda v=vendor: v)
        monkeypatch.setattr(native, "_cpu_family", lambda f=family: f)
        names[vendor, family] = library_name(SOURCES + HEADERS)
        flags[vendor, family] = [f for f in native.build_flags() if f.startswith("-DWAVEMESH")]
    assert flags == {("GenuineIntel", "6"): ["-DWAVEMESH_PREFETCH_T0"],
                     ("AuthenticAMD", "25"): ["-DWAVEMESH_SPREAD_L2"], ("AuthenticAMD", "26"): []}
    assert len(set(names.values())) == 3
    header = next(h for h in HEADERS if h.name == "register_tile.h").read_text()
    for flag in ("WAVEMESH_PREFETCH_T0", "WAVEMESH_SPREAD_L2"):  # each flag is read where it matters
        assert f"defined(__AVX512F__) && defined({flag})" in header


@pytest.mark.skipif(resolve_linear_backend("auto", torch.device("cpu"), torch.float32) != "packed",
                    reason="the packed native kernels do not run here")
def test_waves_of_every_row_count_compile_nothing(tiny_llama, monkeypatch):
    """A station serving waves of 1 to 64 rows (prompt chunks and decode rows mixed) builds no kernel and writes
    no new library: the one compile per machine happens before serving, whatever the wave shapes."""
    station = Station(tiny_llama, StationSpec(layers=(0, 6)))  # the library is built (or found) here
    builds = []
    monkeypatch.setattr(native, "build_library", lambda *a, **k: builds.append(a))
    before = sorted(p.name for p in kernel_dir().iterdir())
    greedy = SamplingParams(max_tokens=64, temperature=0.0)
    held = {1: 0}
    for rows in range(1, 65):  # seq 1 decodes a row each wave; seq rows+1 brings a prompt of rows - 1 ids
        prompt = (WaveEntry(rows + 1, 0, rows - 1, greedy),) if rows > 1 else ()
        entries = (WaveEntry(1, held[1], 1, greedy),) + prompt
        out = station.forward(entries, token_ids=torch.randint(0, station.config.vocab_size, (rows,)))
        assert len(out.samples) == len(entries)
        held[1] += 1
        if rows > 1:
            station.release([rows + 1])
    station.release([1])
    native.load_native.cache_clear()  # a fresh lookup still finds the library built before serving
    assert native.load_native()[0] is not None
    assert builds == [] and sorted(p.name for p in kernel_dir().iterdir()) == before
