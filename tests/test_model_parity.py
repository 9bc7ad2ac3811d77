"""Golden tests: a full-model station against Hugging Face transformers on the same checkpoint."""
from __future__ import annotations

import pytest
import torch

from mesh.core.config import StationSpec
from mesh.core.params import SamplingParams
from mesh.core.wave import WaveEntry
from station.step import Station

transformers = pytest.importorskip("transformers")

PROMPT = [1, 17, 300, 45, 99, 7, 250, 11, 64, 3]
STEPS = 32


def _hf(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "llama-bf16"])
def test_logits_and_greedy_tokens_match_transformers(model_dirs, tiny_llama_bf16, arch):
    """llama-bf16: a checkpoint stored in bfloat16, read as float32 by both (the station holds it in bfloat16
    tiles)."""
    model_dir = tiny_llama_bf16 if arch == "llama-bf16" else model_dirs[arch]
    hf = _hf(model_dir)
    st = Station(model_dir, StationSpec(layers=(0, hf.config.num_hidden_layers)))
    greedy = SamplingParams(max_tokens=STEPS)
    out = st.forward((WaveEntry(0, 0, len(PROMPT), greedy),), token_ids=torch.tensor(PROMPT), want_logits=True)
    ours_logits, tokens = [out.logits[0]], [out.samples[0].token_id]
    for _ in range(STEPS - 1):
        pos = len(PROMPT) + len(tokens) - 1
        out = st.forward((WaveEntry(0, pos, 1, greedy),), token_ids=torch.tensor([tokens[-1]]), want_logits=True)
        ours_logits.append(out.logits[0])
        tokens.append(out.samples[0].token_id)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT + tokens[:-1]])).logits[0, len(PROMPT) - 1:]  # [STEPS, V]
        gen = hf.generate(torch.tensor([PROMPT]), max_new_tokens=STEPS, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    diff = (torch.stack(ours_logits) - ref).abs().max().item()
    assert diff < 1e-4, f"{arch}: max abs logit difference {diff}"
    assert tokens == gen
    assert len(set(tokens)) > 4, f"{arch}: greedy output collapsed: {tokens}"


def test_arch_features_are_exercised(model_dirs):
    """The fixtures really carry the features the parity test is meant to cover."""
    import json
    llama = json.loads((model_dirs["llama"] / "config.json").read_text())
    qwen = json.loads((model_dirs["qwen2"] / "config.json").read_text())
    assert llama["num_key_value_heads"] < llama["num_attention_heads"]
    assert llama["rope_scaling"]["rope_type"] == "llama3"
    assert qwen["tie_word_embeddings"] is True
    st = Station(model_dirs["qwen2"], StationSpec(layers=(0, 6), linear_backend="aten"))  # aten: weights as loaded
    assert st.model.model.layers["0"].self_attn.q_proj.bias is not None
    assert st.model.lm_head.weight.data_ptr() == st.model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("backend", ["aten", "auto", "onednn", "packed"])
def test_linear_backends_agree(tiny_llama, backend):
    """Every matmul kernel gives logits within 1e-4 of F.linear's, and auto picks the packed kernel on float32."""
    from mesh.core.model.kernels import resolve_linear_backend

    st = Station(tiny_llama, StationSpec(layers=(0, 6), linear_backend=backend))
    assert st.linear_backend == resolve_linear_backend(backend, torch.device("cpu"), torch.float32)
    assert st.linear_backend == ("packed" if backend == "auto" else backend)
    ref = Station(tiny_llama, StationSpec(layers=(0, 6), linear_backend="aten"))
    entry = (WaveEntry(0, 0, len(PROMPT), SamplingParams()),)
    a = st.forward(entry, token_ids=torch.tensor(PROMPT), want_logits=True).logits
    b = ref.forward(entry, token_ids=torch.tensor(PROMPT), want_logits=True).logits
    assert (a - b).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="linear_backend"):
        resolve_linear_backend("blas", torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_rows_give_the_bits_of_transformers_rotation(tiny_llama, dtype):
    """The torch path's rotation (RopeRows: swapped halves times a sign-folded sin) against transformers' own
    apply_rotary_pos_emb on the same cos/sin: equal bit for bit, in float32 and bfloat16."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from mesh.core.config import ModelConfig
    from mesh.core.model.llama import RopeRows, rope_cos_sin, rope_inv_freq

    cfg = ModelConfig.from_dir(tiny_llama)
    g = torch.Generator().manual_seed(3)
    t = 37
    q = torch.randn(t, cfg.num_attention_heads, cfg.head_dim, generator=g).to(dtype)  # [T, H, D]
    k = torch.randn(t, cfg.num_key_value_heads, cfg.head_dim, generator=g).to(dtype)  # [T, KVH, D]
    cos, sin = rope_cos_sin(rope_inv_freq(cfg), torch.arange(100, 100 + t), dtype)  # [T, D] each
    rope = RopeRows.of(cos, sin)
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.equal(rope.rotate(q), ref_q[0].transpose(0, 1))
    assert torch.equal(rope.rotate(k), ref_k[0].transpose(0, 1))
