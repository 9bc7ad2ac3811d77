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
    """Intel builds request streamed weights into L1 (WAVEMESH_PREFETCH_T0; with AMX their spread requests from 3 rows,
    WAVEMESH_SPREAD_FROM_3), AMD family-25 builds spread the next block's requests into L2 (WAVEMESH_SPREAD_L2), others
    keep the non-temporal policy; each build is a different library, so a cache shared across machines never loads
    another's."""
    names, flags = {}, {}
    for vendor, family, amx in (("GenuineIntel", "6", False), ("GenuineIntel", "6", True), ("AuthenticAMD", "25", True),
                                ("AuthenticAMD", "26", False)):
        monkeypatch.setattr(native, "_cpu_vendor", lambda v=vendor: v)
        monkeypatch.setattr(native, "_cpu_family", lambda f=family: f)
        monkeypatch.setattr(native, "_cpu_has", lambda flag, a=amx: a and flag == "amx_tile")
        names[vendor, family, amx] = library_name(SOURCES + HEADERS)
        flags[vendor, family, amx] = [f for f in native.build_flags() if f.startswith("-DWAVEMESH")]
    assert flags == {("GenuineIntel", "6", False): ["-DWAVEMESH_PREFETCH_T0"],
                     ("GenuineIntel", "6", True): ["-DWAVEMESH_PREFETCH_T0", "-DWAVEMESH_SPREAD_FROM_3"],
                     ("AuthenticAMD", "25", True): ["-DWAVEMESH_SPREAD_L2"], ("AuthenticAMD", "26", False): []}
    assert len(set(names.values())) == 4
    header = next(h for h in HEADERS if h.name == "register_tile.h").read_text()
    for flag in ("WAVEMESH_PREFETCH_T0", "WAVEMESH_SPREAD_L2"):  # each flag is read where it matters
        assert f"defined(__AVX512F__) && defined({flag})" in header
    start = header.index("defined(WAVEMESH_PREFETCH_T0)")
    intel = header[start:header.index("#elif", start)]
    assert "#if defined(WAVEMESH_SPREAD_FROM_3)\n#define SPREAD_ROWS 3" in intel  # read inside the Intel policy


def test_cpu_flags_are_read_from_cpuinfo(monkeypatch):
    """_cpu_has finds a whole flag in /proc/cpuinfo's flags line, not a prefix of another, and nothing where the file
    cannot be read."""
    monkeypatch.setattr(native, "_cpuinfo", lambda: ("vendor_id\t: GenuineIntel", "flags\t\t: fpu avx512f amx_tile_x"))
    assert native._cpu_has("avx512f") and not native._cpu_has("amx_tile")
    monkeypatch.setattr(native, "_cpuinfo", lambda: ("flags\t\t: fpu amx_tile amx_bf16",))
    assert native._cpu_has("amx_tile")
    monkeypatch.setattr(native, "_cpuinfo", lambda: None)
    assert not native._cpu_has("amx_tile")


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
