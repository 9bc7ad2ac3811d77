"""Matmul kernels for the model's linear layers, chosen from outside the model.

A row's result must not depend on which other rows share its wave: that is what
makes a request's tokens the same alone, batched, re-prefilled on a new route or
replayed after a fault, bit for bit. On x86 CPUs torch's float32 `F.linear` goes
to MKL, whose kernel (and so the order of each dot product's additions) changes
with the row count (measured here, three classes: 1 row; 2, 3, 5-7, 9-11 rows;
4, 8 and 12 or more rows), and a row's last bits differ between them, which
flips a near-tie token now and then. oneDNN's linear uses one
kernel for every row count of 2 and more, whatever the thread count;
`batch_invariant_linear` sends a single row through it as two, so every row
count takes that one kernel. `use_batch_invariant_linears` also hands oneDNN its
weights already in its blocked layout (the dense copy is dropped), which spares
a re-layout of every weight on every call: about 2x faster at 16 rows, and two
rows cost what one did.

`pick_linear("auto")` probes, once per dtype, that oneDNN is present, agrees with
F.linear and is row-count invariant on this machine (dense and blocked weights),
and falls back to F.linear (exact to 1e-4, not bitwise batch-invariant) otherwise.
"""
from __future__ import annotations

from functools import cache
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mesh.core.model.llama import Linear

LINEAR_BACKENDS = ("auto", "aten", "onednn")
LinearKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
PACK_ROWS_HINT = 16  # row count oneDNN lays the weights out for (1 would pick a layout whose bits differ)


def onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] @ w[out, in]^T + b through oneDNN (row-count invariant for T >= 2)."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def batch_invariant_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """onednn_linear whose row results do not depend on T: a single row goes through as two."""
    if x.shape[0] == 1:
        return onednn_linear(x.expand(2, -1).contiguous(), w, b)[:1]  # [1, out]
    return onednn_linear(x, w, b)


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """w [out, in] in oneDNN's blocked layout (an mkldnn tensor of the same shape and dtype)."""
    return torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)


@cache
def _onednn_works(dtype: torch.dtype) -> bool:
    """oneDNN is present, agrees with F.linear and gives a row the same bits at every row count."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(37, 96, generator=g).to(dtype), torch.randn(80, 96, generator=g).to(dtype)
        b = torch.randn(80, generator=g).to(dtype)
        ref = F.linear(x.float(), w.float(), b.float())
        full = batch_invariant_linear(x, w, b)
        if not torch.allclose(full.float(), ref, atol=0.1 if dtype != torch.float32 else 1e-4):
            return False
        packed = pack_weight(w)
        return all(torch.equal(batch_invariant_linear(x[:n], weight, b), full[:n])
                   for n in (1, 2, 3, 5, 16) for weight in (w, packed))
    except (RuntimeError, AttributeError):
        return False


def pick_linear(backend: str, device: torch.device, dtype: torch.dtype) -> LinearKernel | None:
    """The kernel for `backend` ("auto": the batch-invariant oneDNN kernel on CPU when it works), or
    None for F.linear."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend: expected one of {LINEAR_BACKENDS}, got {backend!r}")
    if backend == "aten" or device.type != "cpu":
        return None
    if _onednn_works(dtype):
        return batch_invariant_linear
    if backend == "onednn":
        raise ValueError("linear_backend: onednn is not available (or not row-count invariant) in this torch build")
    return None


def use_batch_invariant_linears(model: nn.Module) -> None:
    """Point every Linear of `model` at batch_invariant_linear, with its weight swapped for the blocked copy
    (a weight shared with the embedding stays dense: the embedding reads it too)."""
    shared = {m.weight.data_ptr() for m in model.modules() if isinstance(m, nn.Embedding)}
    for module in model.modules():
        if isinstance(module, Linear):
            if module.weight.data_ptr() not in shared:
                module.weight = nn.Parameter(pack_weight(module.weight.detach()), requires_grad=False)
            module.kernel = batch_invariant_linear


def use_linear_backend(model: nn.Module, backend: str, device: torch.device, dtype: torch.dtype) -> None:
    """Set up every Linear of `model` for `backend` (see pick_linear): blocked weights and the
    batch-invariant kernel when that is the pick, else the picked kernel as is."""
    kernel = pick_linear(backend, device, dtype)
    if kernel is batch_invariant_linear:
        use_batch_invariant_linears(model)
    else:
        use_linear_kernel(model, kernel)


def use_linear_kernel(model: torch.nn.Module, kernel: LinearKernel | None) -> None:
    """Point every Linear of `model` at `kernel` (None: F.linear)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.kernel = kernel
