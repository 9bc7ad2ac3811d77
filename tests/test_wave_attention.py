"""The torch path's wave attention (bf16, CUDA): a decode row's result does not depend on its company,
whether the wave is that one group of rows (attended in place) or holds other rows too (gathered, scattered)."""
from __future__ import annotations

import torch

from mesh.core.config import ModelConfig, StationSpec
from mesh.core.wave import WaveEntry
from station.kv import KVPool
from station.wave_attention import WaveAttention


def _rows(cfg: ModelConfig, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q [n, H, D], k and v [n, KVH, D] in bfloat16."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, cfg.num_attention_heads, cfg.head_dim, generator=g)
    k, v = (torch.randn(n, cfg.num_key_value_heads, cfg.head_dim, generator=g) for _ in range(2))
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def _attend(kv: KVPool, cfg: ModelConfig, entries: tuple[WaveEntry, ...], q, k, v) -> torch.Tensor:
    with kv.growing(entries):
        return WaveAttention(kv, 0, entries, torch.device("cpu"), None).attend(0, q, k, v)


def test_decode_rows_alone_in_their_group_match_the_same_rows_among_others(tiny_llama):
    cfg = ModelConfig.from_dir(tiny_llama)
    kv = KVPool(cfg, StationSpec(layers=(0, 1), dtype="bfloat16"))
    prompts = (20, 23, 27, 30)  # one KV block count at the next position: one decode group
    for seq, n in enumerate(prompts):
        _attend(kv, cfg, (WaveEntry(seq, 0, n),), *_rows(cfg, n, seq))
    decodes = tuple(WaveEntry(seq, n, 1) for seq, n in enumerate(prompts))
    q, k, v = _rows(cfg, len(decodes), 100)
    alone = _attend(kv, cfg, decodes, q, k, v)  # [4, H, D]: the wave is this group, attended in place
    assert alone.shape == q.shape
    for seq, n in enumerate(prompts):
        kv.truncate(seq, n)
    longer = WaveEntry(9, 0, 70)  # a prompt chunk ahead of them: their rows move and are gathered
    _attend(kv, cfg, (WaveEntry(8, 0, 40),), *_rows(cfg, 40, 8))
    other = WaveEntry(8, 40, 1)  # and a decode row of another block count: a second group
    cq, ck, cv = _rows(cfg, 71, 200)
    mixed = _attend(kv, cfg, (longer, *decodes, other), torch.cat([cq[:70], q, cq[70:]]),
                    torch.cat([ck[:70], k, ck[70:]]), torch.cat([cv[:70], v, cv[70:]]))
    assert torch.equal(mixed[70:74], alone)
    # and the in-place result is the attention itself: row 0 against its 21 keys, computed directly
    keys, values = (t[0][kv.table(0)[:2]].transpose(0, 1).flatten(1, 2)[:, :21].float() for t in (kv.k, kv.v))
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    qf = q[0].float().view(cfg.num_key_value_heads, group, -1)  # [KVH, G, D]
    probs = torch.softmax(qf @ keys.transpose(1, 2) * cfg.head_dim**-0.5, dim=-1)  # [KVH, G, 21]
    want = (probs @ values).reshape(cfg.num_attention_heads, -1)
    torch.testing.assert_close(alone[0].float(), want, atol=3e-2, rtol=3e-2)
