"""What machine a benchmark ran on: CPU model, cores, torch threads and version, load, GPU, memory bandwidth."""
from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

import torch


def describe_machine() -> dict[str, object]:
    """CPU model, cores, torch threads and version, the 1-minute load average, and the GPU when there is one."""
    cpu = platform.processor() or "unknown"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info: dict[str, object] = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                               "torch": torch.__version__,
                               "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def bandwidth_gb_s(device: str = "cpu", mib: int = 256, repeats: int = 7) -> float:
    """Memory bandwidth in GB/s: median time of dst.copy_(src) on a `mib` MiB float32 tensor (read + write).

    A memory-bound step (one request decoding) moves with it: on the 2-core CI machines it was seen
    anywhere from 44 to 78 GB/s, so benchmarks print it beside their ratios."""
    src = torch.rand(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / statistics.median(times[1:]) / 1e9


def cpu_seconds_by_role() -> dict[str, float]:
    """CPU seconds (user + system) used so far by this process ("driver"), by Ray worker processes ("ray
    workers": their command line starts with `ray::`, station actors among them), and by every other
    process on the machine ("other": Ray's daemons and the rest). Linux /proc; zeros elsewhere."""
    seconds = {"driver": 0.0, "ray workers": 0.0, "other": 0.0}
    proc = Path("/proc")
    if not proc.is_dir():
        return seconds
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = _stat_fields(entry)
            command = (entry / "cmdline").read_bytes()
        except OSError:  # the process ended meanwhile
            continue
        role = ("driver" if int(entry.name) == os.getpid() else
                "ray workers" if command.startswith(b"ray::") else "other")
        seconds[role] += _cpu_seconds(fields)
    return seconds


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system, every thread) process `pid` has used so far; NaN without /proc or the process."""
    try:
        fields = _stat_fields(Path(f"/proc/{pid}"))
    except OSError:
        return float("nan")
    return _cpu_seconds(fields)


def minor_faults() -> int:
    """Minor page faults of this process so far (each a first touch of a fresh page); 0 without /proc."""
    try:
        return int(_stat_fields(Path("/proc/self"))[7])
    except OSError:
        return 0


def _cpu_seconds(fields: list[str]) -> float:
    """utime + stime of a process's `_stat_fields`, in seconds."""
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stat_fields(proc_dir: Path) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name: [0] is field 3 (state), [7] minflt, [11] utime."""
    return (proc_dir / "stat").read_text().rsplit(")", 1)[1].split()
