"""What machine a benchmark ran on: CPU model, cores, torch threads and version, load, GPU."""
from __future__ import annotations

import os
import platform
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
