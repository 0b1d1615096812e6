"""Streamed outputs carry deltas (issue 38): each output of a request holds what is new since its previous output
(tokens, acceptance lengths, verify steps) and the finished one also the whole record, copied once. A streamed
request of L = 4,096 tokens copies O(L) elements into its outputs in all, where copying the whole history into every
output was ~L^2/2. The deltas concatenate to the finished record, which equals non-streamed generation, with a
drafter too (several tokens per step)."""

from __future__ import annotations

import gc
from dataclasses import fields

import pytest

from blockspec.config import EngineConfig
from blockspec.engine.outputs import RequestOutput, StepTrace
from blockspec.llm import LLM
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.sampling import SamplingParams
from blockspec.speculative.ngram import NgramProposer
from hf_utils import make_hf_model, save_hf_model

L = 4096
PROMPT = [5, 17, 99, 3, 42, 8, 5, 17]
K = 4


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    hf = make_hf_model("llama", seed=3, vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=L + 64)
    path = save_hf_model(hf, tmp_path_factory.mktemp("stream_deltas") / "target")
    return load_model(str(path), LoadConfig(device="cpu", with_tokenizer=False))


def _llm(lm, draft) -> LLM:
    return LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=1, num_kv_blocks=(L + 64) // 16 + 2))


def copied(out: RequestOutput) -> int:
    """Entries the engine copied into `out`: its own lists (the prompt is the request's list, shared by its
    outputs) and, once finished, the whole record."""
    own = sum(len(v) for f in fields(out) if f.name != "prompt_ids" and isinstance(v := getattr(out, f.name), list))
    return own + (len(out.token_ids) + len(out.acceptance_lengths) + len(out.steps) if out.finished else 0)


def held(outs: list[RequestOutput]) -> int:
    """Entries of the distinct lists reachable from `outs`, each counted once (a list shared by several outputs,
    such as the engine's own history, once; a verify step is one entry): whatever an output holds, copied or
    shared, is counted here."""
    seen, todo, n = set(), list(outs), 0
    while todo:
        o = todo.pop()
        if id(o) in seen or isinstance(o, (int, float, str, bytes, type, StepTrace)) or o is None:
            continue
        seen.add(id(o))
        if isinstance(o, list):
            n += len(o)
            todo.extend(x for x in o if not isinstance(x, int))
        elif isinstance(o, (tuple, set, frozenset)):
            todo.extend(o)
        elif isinstance(o, dict):
            todo.extend(o.values())
        elif type(o).__module__.startswith("blockspec"):
            todo.extend(gc.get_referents(o))
    return n


# a plain step is slower on the CPU than an n-gram one of several tokens: the plain request is shorter (same O(L))
@pytest.mark.parametrize("method,length", [("ngram", L), ("plain", 1024)])
def test_streamed_request_copies_linear_in_its_length(lm, method, length):
    def draft():
        return NgramProposer(K, 3) if method == "ngram" else None

    params = SamplingParams(max_tokens=length, ignore_eos=True)
    outs = list(_llm(lm, draft()).stream([PROMPT], params))
    final = outs[-1]
    assert final.finished and not any(o.finished for o in outs[:-1])
    # the deltas concatenate to the finished record, which equals non-streamed generation's
    (ref,) = _llm(lm, draft()).generate([PROMPT], params, use_tqdm=False)
    assert [t for o in outs for t in o.new_token_ids] == final.token_ids == ref.token_ids
    assert [a for o in outs for a in o.new_acceptance_lengths] == final.acceptance_lengths == ref.acceptance_lengths
    assert [s for o in outs for s in o.new_steps] == final.steps == ref.steps
    assert len(final.token_ids) == length and all(o.prompt_ids == PROMPT for o in outs)
    steps = len(final.steps)
    if method == "plain":
        assert steps == 0 and final.mean_acceptance_length is None and len(outs) == length
    else:  # several tokens per delta, every one after the prefill's from a verify step
        assert sum(final.acceptance_lengths) == length - 1 and len(outs) == steps + 1 and steps < length / 2
        assert max(len(o.new_token_ids) for o in outs) == K + 1
        assert final.mean_acceptance_length == pytest.approx((length - 1) / steps)
    # O(L) copied: each delta once and the whole record once, at the finish (the history into every output: ~L^2/2)
    assert sum(copied(o) for o in outs) == 2 * (length + 2 * steps) <= 6 * length
    # and nothing else hidden in them: all the outputs together hold O(L) entries, the history they share included
    assert 2 * (length + 2 * steps) < held(outs) <= 3 * (length + 2 * steps) + len(PROMPT)
    # a streamed output still reads the record up to itself (copied on read), whatever the engine appended since
    n_tok = n_steps = 0
    for i, o in enumerate(outs):
        n_tok, n_steps = n_tok + len(o.new_token_ids), n_steps + len(o.new_steps)
        if i % 97 == 0:
            assert o.token_ids == final.token_ids[:n_tok] and o.steps == final.steps[:n_steps]
            assert o.acceptance_lengths == (lengths := final.acceptance_lengths[:n_steps])
            assert o.mean_acceptance_length == (sum(lengths) / n_steps if n_steps else None)
