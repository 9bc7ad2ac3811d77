"""A contiguous layer range of a Llama-family decoder (Llama 2/3, Mistral, Qwen2).

Parameter names are the Hugging Face names with ABSOLUTE layer indices
(`model.layers.17.self_attn.q_proj.weight`), so a range loads its own keys by
name. The range holds `model.embed_tokens` when it starts at layer 0 and
`model.norm` + `lm_head` when it ends at the last layer.

The model knows nothing of stations, KV layout or the network: attention hands
its q/k/v rows to an `AttentionContext`, which owns the cache and the ragged
per-sequence structure of the wave. Rows are flat: a wave of T rows is [T, d].
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from mesh.core.config import ModelConfig, RopeScaling


class AttentionContext(Protocol):
    """Stores this wave's keys/values and attends each row to its own sequence."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] (rotated) -> attention output [T, H, D]."""
        ...


def rope_inv_freq(cfg: ModelConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """Inverse RoPE frequencies [D/2] in float32, with the config's scaling applied."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    rs: RopeScaling = cfg.rope_scaling
    if rs.rope_type == "linear":
        inv = inv / rs.factor
    elif rs.rope_type == "llama3":
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D] for absolute `positions` [T], computed in float32 then cast."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


class RopeTable:
    """cos, sin [N, D] float32 for every position in [0, N), made by `rope_cos_sin` over them all and grown (at
    least doubled) when a wave reaches past N: a wave's tables are then one row gather instead of six small ops
    (~0.09 ms of a decode step's Python after its 15 ms native call; bench/out/core_quota_s59.txt part 9), with the
    same bits: each element is the same float32 product and the same cos / sin whatever the tensor's shape."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int) -> None:
        self._inv_freq, self._max = inv_freq, max_positions
        self._table = torch.empty(2, 0, 2 * inv_freq.numel())  # [2, N, D]: cos, then sin

    def rows(self, positions: torch.Tensor, furthest: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] float32 (contiguous) for int64 `positions` [T], each in [0, max_positions); `furthest`:
        their largest where the caller knows it (else read from them: one more op on every step)."""
        need = (int(positions.max()) if furthest is None else furthest) + 1 if positions.numel() else 0
        if need > self._table.shape[1]:
            n = min(max(need, 2 * self._table.shape[1], 256), max(need, self._max))
            self._table = torch.stack(rope_cos_sin(self._inv_freq, torch.arange(n), torch.float32))
        both = self._table.index_select(1, positions)  # [2, T, D]
        return both[0], both[1]


@dataclass(frozen=True, slots=True)
class RopeRows:
    """One wave's rotary tables, made once per wave: cos and sin [T, D] as a rope kernel takes them, and for torch's
    own ops cos [T, 1, D] and sin with its first half negated [T, 1, D]. Rotating x is then x * cos + swap(x) *
    sin_signed, where swap exchanges x's halves: the bits of the reference's x * cos + rotate_half(x) * sin, whose
    -x2 * s1 equals x2 * -s1 exactly, in 4 calls a tensor instead of 9."""

    cos: torch.Tensor  # [T, D]
    sin: torch.Tensor  # [T, D]
    cos_heads: torch.Tensor  # [T, 1, D]
    sin_signed: torch.Tensor  # [T, 1, D]

    @classmethod
    def of(cls, cos: torch.Tensor, sin: torch.Tensor) -> RopeRows:
        """The tables of cos/sin [T, D] (rope_cos_sin)."""
        half = sin.shape[-1] // 2
        return cls(cos, sin, cos[:, None, :], torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None, :])

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated by each row's position."""
        return x * self.cos_heads + torch.roll(x, x.shape[-1] // 2, dims=-1) * self.sin_signed


class Linear(nn.Linear):
    """nn.Linear whose matmul kernel is chosen from outside (mesh.core.model.kernels); F.linear by default."""

    kernel = None  # Callable[[x, weight, bias], out] | None
    # what `weight` holds: "dense" [out, in], "packed" float32/bfloat16/float16 tiles, "q8_0"/"q4_0"/"q4_1" blocks
    weight_layout = "dense"
    quant_rows = None  # the GGUF blocks a loader kept for the packed path (mesh.core.model.quant_linear), until packed

    def reset_parameters(self) -> None:
        """Nothing: a model is built on meta and every weight assigned from a checkpoint, so nn.Linear's random
        initialization (kaiming_uniform_ even on meta: ~a sixth of a small GGUF station's load) is skipped."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]."""
        if self.kernel is None:
            return F.linear(x, self.weight, self.bias)
        return self.kernel(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like the reference (or by a kernel chosen from outside)."""

    kernel = None  # Callable[[x, weight, eps], out] | None

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, d] -> normalised [T, d] in x's dtype."""
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention over a ragged wave; KV lives in the context."""

    rope_kernel = None  # Callable[[q, k, cos, sin], (q, k)] rotating in place | None (RopeRows.rotate)

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d = cfg.hidden_size
        self.q_proj = Linear(d, self.heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = Linear(d, self.kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = Linear(d, self.kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.heads * self.head_dim, d, bias=cfg.o_bias)
        self.qkv_proj: Linear | None = None  # [q | k | v] in one Linear, set from outside (mesh.core.model.kernels)

    def forward(self, x: torch.Tensor, rope: RopeRows, ctx: AttentionContext) -> torch.Tensor:
        """x [T, d] -> [T, d]."""
        return self.output(ctx.attend(self.layer, *self.project(x, rope)))

    def project(self, x: torch.Tensor, rope: RopeRows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, d] -> q [T, H, D], k and v [T, KVH, D], q and k rotated: what attention takes."""
        t = x.shape[0]
        if self.qkv_proj is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = self.qkv_proj(x).split([self.q_proj.out_features, self.k_proj.out_features,
                                              self.v_proj.out_features], dim=1)  # views of one [T, (H+2KVH)*D]
        q = q.view(t, self.heads, self.head_dim)  # [T, H, D]
        k = k.view(t, self.kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.view(t, self.kv_heads, self.head_dim)  # [T, KVH, D]
        if self.rope_kernel is None:
            q, k = rope.rotate(q), rope.rotate(k)
        else:
            q, k = self.rope_kernel(q, k, rope.cos, rope.sin)
        return q, k, v

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """Attention's result out [T, H, D] -> [T, d]."""
        return self.o_proj(out.reshape(out.shape[0], self.heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    act_kernel = None  # Callable[[gate_up [T, 2I]], silu(gate) * up [T, I]] | None (F.silu), with gate_up_proj

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj: Linear | None = None  # [gate | up] in one Linear, set from outside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, d] -> [T, d]."""
        if self.gate_up_proj is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if self.act_kernel is not None:
            return self.down_proj(self.act_kernel(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=1)  # [T, I] each, views of one [T, 2I]
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block with residuals."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope: RopeRows, ctx: AttentionContext) -> torch.Tensor:
        """x [T, d] -> [T, d]."""
        return self.after_attention(x, ctx.attend(self.self_attn.layer, *self.before_attention(x, rope)))

    def before_attention(self, x: torch.Tensor, rope: RopeRows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer up to attention: x [T, d] -> q, k, v (Attention.project of the normed rows)."""
        return self.self_attn.project(self.input_layernorm(x), rope)

    def after_attention(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The layer from attention's result out [T, H, D] on, x [T, d] its input -> [T, d]."""
        x = x + self.self_attn.output(out)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    """The `model.` prefix of the HF names: embed_tokens, layers.{i}, norm."""

    def __init__(self, cfg: ModelConfig, start: int, end: int) -> None:
        super().__init__()
        if start == 0:
            # given its weight, nn.Embedding skips its random initialization (normal_, which on meta imports
            # torch._dynamo: 1.4-1.9 s of a fresh station's first load); the checkpoint's is assigned next
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                             _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i) for i in range(start, end)})
        if end == cfg.num_hidden_layers:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaRange(nn.Module):
    """Layers [start, end) of a Llama-family model, with embedding / head at the ends."""

    def __init__(self, cfg: ModelConfig, start: int, end: int) -> None:
        super().__init__()
        if not 0 <= start < end <= cfg.num_hidden_layers:
            raise ValueError(f"layer range [{start}, {end}) outside the model's {cfg.num_hidden_layers} layers")
        self.cfg, self.start, self.end = cfg, start, end
        self.model = _Body(cfg, start, end)
        if self.is_last:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.inv_freq = rope_inv_freq(cfg, device="cpu")  # [D/2], a plain tensor: not a checkpoint key

    @property
    def is_first(self) -> bool:
        """Holds the token embedding."""
        return self.start == 0

    @property
    def is_last(self) -> bool:
        """Holds the final norm and lm_head."""
        return self.end == self.cfg.num_hidden_layers

    def embed(self, token_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """token_ids [T] -> hidden [T, d] (written into `out` [T, d] where given)."""
        table = self.model.embed_tokens
        if type(table) is nn.Embedding and (out is None or out.dtype == table.weight.dtype):  # the rows, gathered
            return torch.index_select(table.weight, 0, token_ids, out=out)
        rows = table(token_ids)  # [T, d]
        return rows if out is None else out.copy_(rows)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """Run every held layer: hidden [T, d] at absolute positions [T] -> hidden [T, d] (pre-norm)."""
        rope = RopeRows.of(*rope_cos_sin(self.inv_freq, positions, hidden.dtype))
        for layer in self.model.layers.values():
            hidden = layer(hidden, rope, ctx)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + lm_head on selected rows: hidden [R, d] -> logits [R, V] in float32."""
        return self.lm_head(self.model.norm(hidden)).float()
