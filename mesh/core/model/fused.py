"""A range's decoder layers in one native call (csrc/fused_layer.c), set up from outside the model.

On the packed path (mesh.core.model.kernels; float32, bfloat16 or float16 tiles, or GGUF blocks kept quantized)
each layer otherwise costs some twenty Python calls and small torch ops around its C kernels. `fuse_layers`
collects every layer's weights once into a table of addresses and formats; `FusedLayers.run` then hands a whole
wave to C, which loops over the layers calling the same kernels on the same inputs in the same order, so a row's
bits are the per-op path's. A model whose layers are not all on these kernels (another backend, or a weight in
another format) gets None, and keeps the per-op path.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from mesh.core.model.kernels import native_rmsnorm, native_rope, native_silu_mul
from mesh.core.model.llama import DecoderLayer, Linear, LlamaRange, RopeTable
from mesh.core.model.native import load_native
from mesh.core.model.packed import PACK_TILE, PACKED_DTYPES, PACKED_FORMATS, packed_linear
from mesh.core.model.quant_linear import KERNEL_CODES, quant_linear

FIELDS = ("input_norm", "post_norm", "qkv_weight", "qkv_bias", "o_weight", "o_bias", "gate_up_weight",
          "down_weight", "qkv_format", "o_format", "gate_up_format", "down_format", "q_weight", "k_weight",
          "v_weight", "q_bias", "k_bias", "v_bias", "q_format", "k_format",
          "v_format")  # one row of the weights table, in csrc/fused_layer.c's order (q, k, v: where not fused)
QUANT_FORMAT = 3  # fused_layer.c: a linear's format from here on is QUANT_FORMAT + quant_linear.c's type code
TIMED_PARTS = ("linears", "attention", "other")  # what `run(..., seconds=)` accumulates, in order


def weight_format(linear: Linear | None) -> int | None:
    """The format code fused_layer.c runs the Linear's weight in: PACKED_FORMATS' for packed tiles [tiles, K, 64]
    (float32, bfloat16 or float16) on packed_linear, QUANT_FORMAT + its type's code for GGUF blocks repacked for
    quant_linear; None for any other kernel or weight."""
    if linear is None or not isinstance(linear.kernel, partial):
        return None
    w = linear.weight
    if linear.kernel.func is packed_linear and w.dtype in PACKED_DTYPES and w.dim() == 3 and w.shape[2] == PACK_TILE \
            and w.is_contiguous():
        return PACKED_FORMATS[w.dtype]
    if linear.kernel.func is quant_linear and w.dtype == torch.uint8 and w.dim() == 1 and w.is_contiguous():
        return QUANT_FORMAT + KERNEL_CODES[linear.kernel.keywords["qtype"]]
    return None


def _linears(layer: DecoderLayer) -> tuple[Linear, ...]:
    """The layer's linears as fused_layer.c runs them: q/k/v fused (or, where they could not share one weight, q,
    k and v), o, gate/up fused, down."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = (attn.qkv_proj,) if attn.qkv_proj is not None else (attn.q_proj, attn.k_proj, attn.v_proj)
    return (*qkv, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)


def _fusable(layer: DecoderLayer) -> bool:
    """The layer's every op has the native kernel fused_layer.c calls, each of its linears a weight it runs."""
    attn, mlp = layer.self_attn, layer.mlp
    return (layer.input_layernorm.kernel is native_rmsnorm and layer.post_attention_layernorm.kernel is native_rmsnorm
            and attn.rope_kernel is native_rope and mlp.act_kernel is native_silu_mul
            and all(weight_format(m) is not None for m in _linears(layer))
            and mlp.gate_up_proj is not None and mlp.gate_up_proj.bias is None and mlp.down_proj.bias is None)


def _row(layer: DecoderLayer) -> list[int]:
    """The layer's row of the weights table (FIELDS)."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = attn.qkv_proj  # None where q, k and v run apart
    apart = (None,) * 3 if qkv is not None else (attn.q_proj, attn.k_proj, attn.v_proj)
    return ([_address(t) for t in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight, _weight(qkv),
                                   _bias(qkv), attn.o_proj.weight, attn.o_proj.bias, mlp.gate_up_proj.weight,
                                   mlp.down_proj.weight)]
            + [weight_format(m) or 0 for m in (qkv, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            + [_address(_weight(m)) for m in apart] + [_address(_bias(m)) for m in apart]
            + [weight_format(m) or 0 for m in apart])


def _weight(linear: Linear | None) -> torch.Tensor | None:
    return None if linear is None else linear.weight


def _bias(linear: Linear | None) -> torch.Tensor | None:
    return None if linear is None else linear.bias


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class FusedLayers:
    """Every decoder layer of one LlamaRange as one native call per wave (see the module docstring)."""

    def __init__(self, model: LlamaRange) -> None:
        cfg = model.cfg
        self.model = model  # holds the weights the table points at
        self.rope = RopeTable(model.inv_freq, cfg.max_position_embeddings)  # a wave's cos / sin rows, gathered
        rows = [_row(layer) for layer in model.model.layers.values()]
        self.weights = torch.tensor(rows, dtype=torch.int64)  # [L, len(FIELDS)] addresses and formats
        self.shape = (cfg.hidden_size, len(rows), cfg.rms_norm_eps, cfg.num_attention_heads,
                      cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size)
        self.lib = load_native()[0]
        fields = torch.zeros(1, dtype=torch.int64)
        self.lib.fused_table_fields(fields.data_ptr())
        if fields.item() != len(FIELDS):
            raise RuntimeError(f"the native fused layers read rows of {fields.item()} fields, this code writes "
                               f"{len(FIELDS)}: the library and the Python code are of different revisions")

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
            block_tokens: int, tables: torch.Tensor, row_table: torch.Tensor, row_pos: torch.Tensor, window: int,
            seconds: torch.Tensor | None = None, out: torch.Tensor | None = None,
            furthest: int | None = None) -> torch.Tensor:
        """hidden [T, d] float32 at positions [T] through every layer -> new hidden [T, d] (the input is kept, unless
        it is `out`).

        k_pool/v_pool [layers, blocks, KVH, BT, D]: the range's paged cache; tables/row_table/row_pos/window as
        csrc/paged_attention.c's paged_attention_f32 (int64). seconds: a float64 [3] that gains TIMED_PARTS, or None.
        out: a contiguous float32 [T, d] the new hidden is computed in (`hidden` itself: updated in place; else
        hidden is copied there first), None: a new tensor. furthest: the largest position, where the caller knows
        it (spares reading it from `positions`)."""
        d, layers, eps, heads, kv_heads, head_dim, inter = self.shape
        if hidden.dtype != torch.float32 or hidden.dim() != 2 or hidden.shape[1] != d:
            raise ValueError(f"FusedLayers.run: expected float32 hidden [T, {d}], got {hidden.dtype} "
                             f"{list(hidden.shape)}")
        if k_pool.shape[0] != layers or not (k_pool.is_contiguous() and v_pool.is_contiguous()):
            raise ValueError(f"FusedLayers.run: expected contiguous K/V pools of {layers} layers")
        if seconds is not None and (seconds.dtype != torch.float64 or seconds.numel() != len(TIMED_PARTS)):
            raise ValueError(f"FusedLayers.run: seconds must be float64 [{len(TIMED_PARTS)}]")
        x = self._work_rows(hidden, out)  # [T, d], updated in place by the layers
        cos, sin = self.rope.rows(positions, furthest)  # [T, D] each, the model's rope_cos_sin bits
        self.lib.fused_layers_f32(x.data_ptr(), x.shape[0], d, layers, self.weights.data_ptr(), eps, heads, kv_heads,
                                  head_dim, inter, cos.data_ptr(), sin.data_ptr(), k_pool.data_ptr(),
                                  v_pool.data_ptr(), k_pool.stride(0), block_tokens, tables.data_ptr(),
                                  row_table.data_ptr(), row_pos.data_ptr(), window, head_dim ** -0.5,
                                  None if seconds is None else seconds.data_ptr(), torch.get_num_threads())
        return x

    @staticmethod
    def _work_rows(hidden: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """The tensor the layers update in place: `out` holding hidden's rows, or a copy of hidden."""
        if out is None:
            return hidden.clone(memory_format=torch.contiguous_format)
        if out.dtype != torch.float32 or out.shape != hidden.shape or not out.is_contiguous():
            raise ValueError(f"FusedLayers.run: out must be a contiguous float32 {list(hidden.shape)}, got "
                             f"{out.dtype} {list(out.shape)}")
        if out is not hidden:
            out.copy_(hidden)
        return out


def fuse_layers(model: nn.Module) -> FusedLayers | None:
    """FusedLayers for `model` when every layer runs the packed (or quantized) kernels, else None (the per-op
    path)."""
    if not isinstance(model, LlamaRange) or load_native()[0] is None:
        return None
    if not all(_fusable(layer) for layer in model.model.layers.values()):
        return None
    return FusedLayers(model)
