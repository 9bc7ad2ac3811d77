"""How a model's layers are split over stations: what each layer weighs, and the split itself.

`plan_layers` cuts layers 0..L into contiguous ranges minimising the heaviest
station, for any per-layer weights: `layer_weights` (bytes a station holds, the
embedding on the first and the head on the last) or `step_weights` (bytes a
station reads per decode step: the head counts, the embedding does not).
No torch here.
"""
from __future__ import annotations

import itertools

from mesh.core.config import DTYPE_BYTES, SUPPORTED_DTYPES, ModelConfig
from mesh.core.config_checks import is_int, require as _require


def _layer_params(cfg: ModelConfig) -> int:
    d, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if cfg.qkv_bias else 0) + (d if cfg.o_bias else 0)
    return attn + 3 * d * cfg.intermediate_size + 2 * d  # + SwiGLU MLP + two RMSNorms


def station_bytes(cfg: ModelConfig, start: int, end: int, dtype: str) -> int:
    """Parameter bytes of a station holding layers [start, end) (+ embedding at 0, + norm/head at L)."""
    _require(0 <= start < end <= cfg.num_hidden_layers, f"layers: need 0 <= start < end <= "
             f"{cfg.num_hidden_layers}, got [{start}, {end}]")
    _require(dtype in DTYPE_BYTES, f"dtype: expected one of {', '.join(SUPPORTED_DTYPES)}, got {dtype!r}")
    embed = cfg.vocab_size * cfg.hidden_size
    params = (end - start) * _layer_params(cfg) + (embed if start == 0 else 0)
    if end == cfg.num_hidden_layers:  # final norm + head; a tied head shares storage only on the same station
        params += cfg.hidden_size + (0 if cfg.tie_word_embeddings and start == 0 else embed)
    return params * DTYPE_BYTES[dtype]


def layer_weights(cfg: ModelConfig, dtype: str = "float32") -> list[int]:
    """Bytes per layer, with the embedding folded into layer 0 and norm + head into the last layer."""
    return [station_bytes(cfg, i, i + 1, dtype) for i in range(cfg.num_hidden_layers)]


def step_weights(cfg: ModelConfig, dtype: str = "float32") -> list[int]:
    """Bytes each layer reads per decode step, with the final norm + head (read whole every step) folded
    into the last layer and no embedding (a step reads only its rows)."""
    b = DTYPE_BYTES[dtype]
    out = [_layer_params(cfg) * b] * cfg.num_hidden_layers
    out[-1] += (cfg.hidden_size + cfg.vocab_size * cfg.hidden_size) * b
    return out


BALANCES = ("memory", "compute")


def split_weights(cfg: ModelConfig, dtype: str = "float32", balance: str = "memory") -> list[int]:
    """Per-layer weights a count split evens out: layer_weights (memory) or step_weights (compute)."""
    _require(balance in BALANCES, f"stations.balance: expected one of {', '.join(BALANCES)}, got {balance!r}")
    return layer_weights(cfg, dtype) if balance == "memory" else step_weights(cfg, dtype)


def plan_layers(num_layers: int, count: int, weights=None) -> list[tuple[int, int]]:
    """Split layers 0..num_layers into `count` contiguous non-empty ranges.

    Minimises the heaviest station's total weight (per-layer `weights`, e.g. layer_weights(cfg);
    all 1 when None), then, among those plans, the spread (sum of squared station weights).
    """
    _require(is_int(num_layers) and num_layers >= 1, f"num_layers: expected a positive integer, got {num_layers!r}")
    _require(is_int(count) and count >= 1, f"stations.count: expected a positive integer, got {count!r}")
    _require(count <= num_layers, f"stations.count: {count} stations for a model of {num_layers} layers "
             "(each station needs at least one layer)")
    w = [1] * num_layers if weights is None else list(weights)
    _require(len(w) == num_layers and all(x >= 0 for x in w), f"weights: expected {num_layers} non-negative numbers")
    pre = [0, *itertools.accumulate(w)]  # pre[j]: weight of layers [0, j)
    inf = float("inf")

    def solve(cost, combine, limit=inf):
        # best[k][j]: best cost of splitting layers [0, j) into k stations; cut[k][j]: where the last one starts
        best = [[inf] * (num_layers + 1) for _ in range(count + 1)]
        cut = [[0] * (num_layers + 1) for _ in range(count + 1)]
        best[0][0] = 0
        for k in range(1, count + 1):
            for j in range(k, num_layers - (count - k) + 1):
                for i in range(k - 1, j):
                    part = pre[j] - pre[i]
                    if best[k - 1][i] == inf or part > limit:
                        continue
                    c = combine(best[k - 1][i], cost(part))
                    if c < best[k][j]:
                        best[k][j], cut[k][j] = c, i
        ranges, j = [], num_layers
        for k in range(count, 0, -1):
            ranges.append((cut[k][j], j))
            j = cut[k][j]
        return best[count][num_layers], ranges[::-1]

    heaviest, _ = solve(lambda p: p, max)
    return solve(lambda p: p * p, lambda a, b: a + b, heaviest)[1]
