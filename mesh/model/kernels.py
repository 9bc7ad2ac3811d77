"""Matmul kernels for the model's linear layers, chosen from outside the model.

On x86 CPUs torch's float32 `F.linear` goes to a BLAS whose kernels can be slow on
some processors; oneDNN's linear (what torch's own compiler emits for CPU) reads
the same weights faster there. `pick_linear` probes it once and falls back to
`F.linear` when it is missing or disagrees. F.linear stays the default: its
results do not change with the thread count, while oneDNN's multi-threaded
reductions do, which can flip a near-tie token between differently threaded routes.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from mesh.model.llama import Linear

LINEAR_BACKENDS = ("auto", "aten", "onednn")
LinearKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] @ w[out, in]^T + b through oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _onednn_works(dtype: torch.dtype) -> bool:
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(3, 64, generator=g).to(dtype), torch.randn(32, 64, generator=g).to(dtype)
        b = torch.randn(32, generator=g).to(dtype)
        ref = F.linear(x.float(), w.float(), b.float())
        return torch.allclose(onednn_linear(x, w, b).float(), ref, atol=0.1 if dtype != torch.float32 else 1e-4)
    except (RuntimeError, AttributeError):
        return False


def pick_linear(backend: str, device: torch.device, dtype: torch.dtype) -> LinearKernel | None:
    """The kernel for `backend` ("auto": oneDNN on CPU when it works), or None for F.linear."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend: expected one of {LINEAR_BACKENDS}, got {backend!r}")
    if backend == "aten" or device.type != "cpu":
        return None
    if _onednn_works(dtype):
        return onednn_linear
    if backend == "onednn":
        raise ValueError("linear_backend: onednn is not available in this torch build")
    return None


def use_linear_kernel(model: torch.nn.Module, kernel: LinearKernel | None) -> None:
    """Point every Linear of `model` at `kernel` (None: F.linear)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.kernel = kernel
