"""HF transformers on the same weights as our target (the step benchmark's reference): per-step decode time and
greedy tokens with the top-2 logit gap at each step (to tell near-tie flips from real divergence)."""

from __future__ import annotations

import time

import torch


def hf_twin(target_cfg: dict, target: torch.nn.Module):
    """A transformers Qwen3ForCausalLM holding our target's weights (our fused q/k/v and gate/up unpacked)."""
    import transformers as tf

    cfg = tf.Qwen3Config(**{k: v for k, v in target_cfg.items() if k not in ("architectures", "dtype")})
    with torch.device("meta"):
        hf = tf.Qwen3ForCausalLM(cfg)
    hf = hf.to_empty(device="cuda").to(torch.bfloat16).eval()
    q_size = cfg.num_attention_heads * cfg.head_dim
    kv_size = cfg.num_key_value_heads * cfg.head_dim
    sd = {"model.embed_tokens.weight": target.embed_tokens.weight, "model.norm.weight": target.norm.weight,
          "lm_head.weight": target.lm_head.weight}
    for i, layer in enumerate(target.layers):
        q, k, v = layer.self_attn.qkv_proj.weight.split([q_size, kv_size, kv_size])
        g, u = layer.mlp.gate_up_proj.weight.chunk(2)
        pre = f"model.layers.{i}."
        sd.update({
            pre + "self_attn.q_proj.weight": q, pre + "self_attn.k_proj.weight": k, pre + "self_attn.v_proj.weight": v,
            pre + "self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
            pre + "self_attn.q_norm.weight": layer.self_attn.q_norm.weight,
            pre + "self_attn.k_norm.weight": layer.self_attn.k_norm.weight,
            pre + "mlp.gate_proj.weight": g, pre + "mlp.up_proj.weight": u,
            pre + "mlp.down_proj.weight": layer.mlp.down_proj.weight,
            pre + "input_layernorm.weight": layer.input_layernorm.weight,
            pre + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
        })
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    hf.model.rotary_emb.to("cuda")
    return hf


@torch.inference_mode()
def hf_ar_step_ms(hf, prompt_len: int = 1024, n: int = 32) -> float:
    """Per decode step of `generate` at batch 1 (prefill subtracted: n-token run minus 1-token run)."""
    ids = torch.randint(0, hf.config.vocab_size, (1, prompt_len), device="cuda")

    def run(k: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    run(4)
    return (run(n) - run(1)) / (n - 1) * 1e3


@torch.inference_mode()
def hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and, per step, the gap between HF's top-1 and top-2 logits."""
    out = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                      output_scores=True, return_dict_in_generate=True)
    gaps = [float((lambda t: t[0] - t[1])(s[0].float().topk(2).values)) for s in out.scores]
    return out.sequences[0, len(prompt):].tolist(), gaps
