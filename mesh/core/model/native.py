"""The station's own C kernels (mesh/core/model/csrc/*.c), compiled once per machine and loaded with ctypes.

The library is built with the system C compiler (`cc -O3 -march=native -fopenmp`; on an Intel CPU
-DWAVEMESH_PREFETCH_T0, with AMX also -DWAVEMESH_SPREAD_FROM_3, on an AMD family-25 CPU -DWAVEMESH_SPREAD_L2) into
~/.cache/wavemesh/kernels (or a per-user temporary folder where the home is not writable), under a name that hashes
the sources and headers, the flags and the CPU model, so a changed source, another compiler flag or another machine
builds afresh and concurrent stations never read a half-written file (written to a temporary name, then renamed). It
links the same OpenMP runtime torch already loaded (libgomp.so.1), so its threads are torch's threads. Where no
compiler or no AVX2/FMA is present, `load_native` answers None and the reason, and the station uses torch's kernels
instead.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

SOURCES = tuple(sorted((Path(__file__).parent / "csrc").glob("*.c")))
HEADERS = tuple(sorted((Path(__file__).parent / "csrc").glob("*.h")))  # included by the sources: part of the key
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


@cache
def _cpuinfo() -> tuple[str, ...] | None:
    """/proc/cpuinfo's lines, read once per process (None where it cannot be read)."""
    try:
        return tuple(Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return None


def _cpuinfo_lines(*prefixes: str) -> list[str] | None:
    """The first /proc/cpuinfo line starting with each prefix ("" where none does), or None where it cannot be read."""
    lines = _cpuinfo()
    if lines is None:
        return None
    return [next((line for line in lines if line.startswith(p)), "") for p in prefixes]


def _cpuinfo_field(name: str) -> str:
    """The value of /proc/cpuinfo's first `name` line, or "" where there is none or it cannot be read."""
    found = _cpuinfo_lines(name)
    return found[0].partition(":")[2].strip() if found else ""


def _cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD"), or ""."""
    return _cpuinfo_field("vendor_id")


def _cpu_family() -> str:
    """/proc/cpuinfo's cpu family ("25" on AMD Zen 3 / Zen 4 parts), or ""."""
    return _cpuinfo_field("cpu family")


def _cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo's flags name `flag` (amx_tile: an Intel part from Sapphire Rapids on)."""
    return flag in _cpuinfo_field("flags").split()


def build_flags() -> tuple[str, ...]:
    """CFLAGS and what this CPU chooses in the sources (csrc/register_tile.h): on Intel, streamed weights are
    requested into L1, never as non-temporal (WAVEMESH_PREFETCH_T0), and on an Intel part with AMX waves of 3 rows or
    more spread their requests for the next weights over the row tiles (WAVEMESH_SPREAD_FROM_3; without AMX, from 9
    rows); on AMD family 25, waves of 7 rows or more request the next weights into L2, their requests spread over
    the row tiles, and 1-6 rows request none (WAVEMESH_SPREAD_L2; an AVX2-only part of that family, Zen 3, never
    reads it)."""
    vendor = _cpu_vendor()
    if vendor == "GenuineIntel":
        return CFLAGS + ("-DWAVEMESH_PREFETCH_T0",) + (("-DWAVEMESH_SPREAD_FROM_3",) if _cpu_has("amx_tile") else ())
    if vendor == "AuthenticAMD" and _cpu_family() == "25":
        return CFLAGS + ("-DWAVEMESH_SPREAD_L2",)
    return CFLAGS


def kernel_dir() -> Path:
    """Where compiled kernels are kept: the user's cache, else a per-user temporary folder."""
    home = Path.home() / ".cache" / "wavemesh" / "kernels"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"wavemesh-kernels-{os.getuid()}"


def _cpu_model() -> str:
    """The CPU's model name and feature flags (what -march=native compiles for)."""
    found = _cpuinfo_lines("model name", "flags")
    return "".join(found or ()) or platform.processor()


def build_library(compiler: str, target: Path, sources: tuple[Path, ...] = SOURCES) -> None:
    """Compile `sources` (default: the station's kernels) with build_flags() into the shared library `target`, written
    under a temporary name and then renamed, so a concurrent reader never sees half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *build_flags(), *map(str, sources), "-o", tmp, "-lm"], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
SIGNATURES = {  # every exported function's argument types (all return void)
    "packed_linear_f32": [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _INT],
    "packed_linear_any": [_PTR, _I64, _I64, _I64, _PTR, _INT, _I64, _PTR, _PTR, _INT],
    "quant_repack": [_PTR, _PTR, _PTR, _INT, _I64, _INT, _PTR, _INT],
    "gguf_skip_strings": [_PTR, _I64, _I64, _I64, _PTR],
    "quant_linear_f32": [_PTR, _I64, _I64, _I64, _PTR, _INT, _I64, _PTR, _PTR, _INT],
    "rmsnorm_f32": [_PTR, _I64, _I64, _I64, _PTR, _F32, _PTR, _INT],
    "rope_f32": [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _INT],
    "paged_attention_f32": [_PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR,
                            _PTR, _I64, _F32, _PTR, _INT],
    "silu_mul_f32": [_PTR, _I64, _I64, _PTR, _INT],
    "fused_layers_f32": [_PTR, _I64, _I64, _I64, _PTR, _F32, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _I64,
                         _I64, _PTR, _PTR, _PTR, _I64, _F32, _PTR, _INT],
    "fused_table_fields": [_PTR],
}


def library_name(files: tuple[Path, ...]) -> str:
    """The compiled library's file name: a hash of every source and header, the flags and the CPU model."""
    key = hashlib.sha256(b"".join(p.read_bytes() for p in files) + " ".join(build_flags()).encode()
                         + _cpu_model().encode())
    return f"wavemesh-native-{key.hexdigest()[:16]}.so"


@cache
def load_native() -> tuple[ctypes.CDLL | None, str]:
    """(the compiled library, "") or (None, why not): built on first use, then reused from the cache."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None, f"the native kernels are written for x86-64 (this is {platform.machine()})"
    compiler = shutil.which("cc") or shutil.which("gcc")
    target = kernel_dir() / library_name(SOURCES + HEADERS)
    try:
        if not target.exists():
            if compiler is None:
                return None, "no C compiler (cc or gcc) to build the native kernels"
            build_library(compiler, target)
        lib = ctypes.CDLL(str(target))
    except subprocess.CalledProcessError as e:
        return None, f"building the native kernels failed: {e.stderr.strip()[-300:]}"
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"the native kernels could not be built or loaded: {e}"
    for name, args in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    return lib, ""
