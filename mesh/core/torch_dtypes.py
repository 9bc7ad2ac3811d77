"""The torch side of the one dtype table: `mesh.core.config.DTYPE_BYTES` names -> torch dtypes.

config.py keeps the names and their sizes without torch (the YAML schema and `mesh status` import it);
this module maps the same names to torch, for the loader, the KV cache and the wire.
"""
from __future__ import annotations

import torch

from mesh.core.config import DTYPE_BYTES

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_BYTES}  # station dtypes
WIRE_DTYPES: dict[str, torch.dtype] = {**TORCH_DTYPES, "int32": torch.int32, "int64": torch.int64}  # + token ids
