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

The packed kernel (`packed_linear`, mesh.core.model.packed) is row-count invariant by construction and reads the
weights at memory speed; it is float32 only; `auto` picks it for float32 on CPU after the same probe, else oneDNN,
else F.linear.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mesh.core.model.llama import MLP, Attention, Linear, RMSNorm
from mesh.core.model.native import load_native
from mesh.core.model.packed import PackedLoad, pack_rows, pad_bias, packed_linear, use_packed_linears
from mesh.core.model.packed_cache import PackedCache

LINEAR_BACKENDS = ("auto", "aten", "onednn", "packed")
BATCH_INVARIANT_BACKENDS = ("packed", "onednn")  # a row's bits do not depend on the other rows of its wave
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


@cache
def _packed_works() -> bool:
    """The packed kernel builds, agrees with F.linear and gives a row the same bits at every row count."""
    lib, _ = load_native()
    if lib is None:
        return False
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(37, 96, generator=g), torch.randn(80, 96, generator=g), torch.randn(80, generator=g)
    full = packed_linear(x, pack_rows([w]), pad_bias(b), 80)
    if not torch.allclose(full, F.linear(x, w, b), atol=1e-4):
        return False
    return all(torch.equal(packed_linear(x[:n], pack_rows([w]), pad_bias(b), 80), full[:n]) for n in (1, 2, 3, 5, 16))


def resolve_linear_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend `backend` means here: "packed", "onednn" or "aten" ("auto": the fastest batch-invariant
    kernel that passes its probe, else F.linear); an explicit backend that cannot run is a ValueError."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend: expected one of {LINEAR_BACKENDS}, got {backend!r}")
    if backend == "aten" or device.type != "cpu":
        return "aten"
    if backend in ("auto", "packed") and dtype == torch.float32 and _packed_works():
        return "packed"
    if backend == "packed":
        why = load_native()[1] or ("it is float32 only" if dtype != torch.float32 else "its probe failed")
        raise ValueError(f"linear_backend: packed cannot run here ({why})")
    if backend in ("auto", "onednn") and _onednn_works(dtype):
        return "onednn"
    if backend == "onednn":
        raise ValueError("linear_backend: onednn is not available (or not row-count invariant) in this torch build")
    return "aten"


def native_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [T, d] float32 rows by csrc/layer_ops.c (one fixed order per row)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], x.shape[1], dtype=torch.float32)  # [T, d]
    load_native()[0].rmsnorm_f32(x.data_ptr(), x.shape[0], x.stride(0), x.shape[1], w.data_ptr(), eps,
                                 out.data_ptr(), torch.get_num_threads())
    return out


def native_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q [T, H, D] and k [T, KVH, D] (float32, each row's heads side by side) in place by cos/sin [T, D]."""
    lib, threads = load_native()[0], torch.get_num_threads()
    for x in (q, k):
        if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            raise ValueError("native_rope: expected each row's heads side by side")
        lib.rope_f32(x.data_ptr(), x.shape[0], x.stride(0), x.shape[1], x.shape[2], cos.data_ptr(), sin.data_ptr(),
                     threads)
    return q, k


def native_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [T, 2I] float32 (gate, then up) -> [T, I] by csrc/layer_ops.c."""
    t, two_i = gate_up.shape
    gate_up = gate_up.contiguous()
    out = torch.empty(t, two_i // 2, dtype=torch.float32)  # [T, I]
    load_native()[0].silu_mul_f32(gate_up.data_ptr(), t, two_i // 2, out.data_ptr(), torch.get_num_threads())
    return out


def use_native_layer_ops(model: nn.Module) -> None:
    """Point every RMSNorm, every attention's RoPE and every fused MLP's activation of `model` at the native
    float32 kernels."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.kernel = native_rmsnorm
        elif isinstance(module, Attention):
            module.rope_kernel = native_rope
        elif isinstance(module, MLP) and module.gate_up_proj is not None:
            module.act_kernel = native_silu_mul


def use_batch_invariant_linears(model: nn.Module) -> None:
    """Point every Linear of `model` at batch_invariant_linear, with its weight swapped for the blocked copy
    (a weight shared with the embedding stays dense: the embedding reads it too)."""
    shared = {m.weight.data_ptr() for m in model.modules() if isinstance(m, nn.Embedding)}
    for module in model.modules():
        if isinstance(module, Linear):
            if module.weight.data_ptr() not in shared:
                module.weight = nn.Parameter(pack_weight(module.weight.detach()), requires_grad=False)
            module.kernel = batch_invariant_linear


@dataclass(frozen=True, slots=True)
class LinearSetup:
    """What use_linear_backend did: the backend used, and for "packed" where the packed weights came from."""

    backend: str
    packed: PackedLoad | None = None


def use_linear_backend(model: nn.Module, backend: str, device: torch.device, dtype: torch.dtype,
                       packed_cache: PackedCache | None = None, huge_pages: bool = True) -> LinearSetup:
    """Set up every Linear of `model` for `backend` (see resolve_linear_backend). "packed" also moves the norms
    and RoPE to the native kernels (the attention context is the station's), and maps or stores the packed weights
    in `packed_cache` where given, the others packed into memory in huge pages where `huge_pages` asks
    (use_packed_linears)."""
    used = resolve_linear_backend(backend, device, dtype)
    if used != "packed" and any(isinstance(m, Linear) and m.quant_rows is not None for m in model.modules()):
        raise ValueError(f"linear_backend: {used} cannot run weights kept quantized (only packed can)")
    if used == "packed":
        packed = use_packed_linears(model, packed_cache, huge_pages)
        use_native_layer_ops(model)
        return LinearSetup(used, packed)
    if used == "onednn":
        use_batch_invariant_linears(model)
    else:
        use_linear_kernel(model, None)
    return LinearSetup(used)


def use_linear_kernel(model: torch.nn.Module, kernel: LinearKernel | None) -> None:
    """Point every Linear of `model` at `kernel` (None: F.linear)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.kernel = kernel
