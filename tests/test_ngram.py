"""N-gram prompt lookup (blockspec/speculative/ngram.py), fp32 on CPU: `lookup` on hand-made histories and against a
plain-Python reference; greedy engine output equal to plain decoding in every engine scenario, with every step's
drafts equal to the reference lookup over the request's history (so the device-side history is right after
preemption, prefix-cache hits and chunked prefill); seeded sampling equal to plain seeded sampling; hand-made prompts
on a target whose outputs are known by hand, end to end through LLM.generate and `blockspec generate`."""

from __future__ import annotations

import json
import random

import pytest
import torch

from blockspec.cli import main
from blockspec.config import EngineConfig
from blockspec.engine.outputs import StepTrace
from blockspec.llm import LLM
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.sampling import SamplingParams
from blockspec.speculative.ngram import NgramProposer, lookup
from hf_utils import make_hf_model, save_hf_model
from proposer_utils import (
    K, SCENARIOS, check_seeded_sampling, check_single_requests, run_paths, run_scenario, seeded_params, workload,
)
from proposer_utils import ckpts  # noqa: F401 - a fixture, used by name

NGRAM_MAX = 3


def reference(tokens: list[int], ngram_max: int, k: int) -> tuple[list[int], bool]:
    """Prompt lookup written plainly over `tokens` (ending with the bonus): the longest suffix n <= ngram_max that
    occurred earlier, its most recent occurrence, what followed it repeating with the match's period; else the bonus
    repeated. Returns (drafts, whether a match was found)."""
    start = len(tokens) - 1
    for n in range(ngram_max, 0, -1):
        for j in range(start - n, -1, -1):  # an occurrence that ends before the bonus, the most recent first
            if tokens[j:j + n] == tokens[start - n + 1:]:
                begin = j + n
                return [tokens[begin + i % (start + 1 - begin)] for i in range(k)], True
    return [tokens[-1]] * k, False


def assert_drafts_are_lookups(prompts, outs, ngram_max: int = NGRAM_MAX) -> int:
    """Every step's drafts equal the reference lookup over prompt + outputs up to its bonus; returns how many steps
    drafted from a real match. outs: RequestOutputs, or (token ids, step traces) pairs."""
    matched = 0
    for i, (p, o) in enumerate(zip(prompts, outs)):
        tokens, steps = o if isinstance(o, tuple) else (o.token_ids, o.steps)
        history = p + tokens
        for st in steps:
            want, found = reference(history[:st.position + 1], ngram_max, len(st.draft))
            assert st.draft == want, f"request {i}, bonus at {st.position}: drafts {st.draft}, lookup gives {want}"
            matched += found
    return matched


def table(rows: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows])


# --------------------------------------------------------------------------------------------------------------
# lookup on hand-made histories (the last token of each is the bonus)


@pytest.mark.parametrize("tokens, ngram_max, k, drafts", [
    ([1, 2, 3, 4, 9, 9, 1, 2, 3], 3, 4, [4, 9, 9, 1]),  # the continuation of the earlier occurrence
    ([2, 3, 10, 4, 3, 11, 2, 3], 2, 3, [10, 4, 3]),  # the longest n first: "2 3" beats the later "3"
    ([2, 3, 10, 4, 3, 11, 2, 3], 1, 3, [11, 2, 3]),  # ngram_max bounds n: only "3", its most recent occurrence
    ([1, 2, 5, 1, 2, 6, 1, 2], 3, 5, [6, 1, 2, 6, 1]),  # the most recent occurrence, then periodic
    ([4, 1, 2, 1, 2, 1], 3, 5, [2, 1, 2, 1, 2]),  # the match runs into the current position: period 2
    ([7, 7], 3, 3, [7, 7, 7]),  # period 1
    ([1, 2, 3, 4], 3, 3, [4, 4, 4]),  # no match: the bonus repeated
    ([5], 3, 2, [5, 5]),  # nothing before the bonus
])
def test_lookup_by_hand(tokens, ngram_max, k, drafts):
    assert reference(tokens, ngram_max, k)[0] == drafts  # the reference agrees with the hand-made answer
    got = lookup(table([tokens], len(tokens) + 3), torch.tensor([len(tokens) - 1]), torch.tensor([tokens[-1]]),
                 ngram_max, k)
    assert got.tolist() == [drafts]


@pytest.mark.parametrize("ngram_max", [1, 2, 4])
def test_lookup_batched_equals_the_reference(ngram_max):
    """Random histories over a 3-token alphabet (many matches, many overlaps), of different lengths in one batch,
    with -1 after each bonus as the proposer lays them out."""
    rng = random.Random(ngram_max)
    for _ in range(20):
        rows = [[rng.randrange(3) for _ in range(rng.randint(1, 24))] for _ in range(8)]
        k = rng.randint(1, 7)
        got = lookup(table(rows, 30), torch.tensor([len(r) - 1 for r in rows]), torch.tensor([r[-1] for r in rows]),
                     ngram_max, k)
        assert got.tolist() == [reference(r, ngram_max, k)[0] for r in rows], rows


# --------------------------------------------------------------------------------------------------------------
# the engine: greedy output equals plain decoding


@pytest.fixture(scope="module")
def successor(tmp_path_factory):
    """A target whose greedy next token is the last one + 1 (mod 32): attention and MLP outputs zeroed, one-hot
    embeddings, the lm_head a shifted identity. What it accepts is known by hand."""
    hf = make_hf_model("llama", seed=0, vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
        hf.model.embed_tokens.weight.copy_(torch.eye(32))
        hf.lm_head.weight.copy_(torch.eye(32).roll(1, dims=0))
    path = save_hf_model(hf, tmp_path_factory.mktemp("successor") / "target")
    return load_model(str(path), LoadConfig(device="cpu", with_tokenizer=False)), path


def ngram(ngram_max: int = NGRAM_MAX) -> NgramProposer:
    return NgramProposer(K, ngram_max)


def test_single_requests_equal_plain(ckpts):
    prompts, params = workload(6, seed=7)
    outs = check_single_requests(ckpts.lm, ngram, prompts, params)
    assert assert_drafts_are_lookups(prompts, outs) > 0


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("target", ["random", "successor"])
def test_engine_equals_plain(ckpts, successor, target, scenario):
    lm = ckpts.lm if target == "random" else successor[0]
    prompts, outs = run_scenario(scenario, lm, ngram())
    assert assert_drafts_are_lookups(prompts, outs) > 0
    if target == "successor":  # counting up meets the prompt's own tokens again: drafts get accepted
        assert any(a > 2 for o in outs for a in o.acceptance_lengths)


def test_step_paths_agree(ckpts, successor):
    for lm in (ckpts.lm, successor[0]):
        prompts, params = workload(10, seed=8, vocab=lm.config.vocab_size, max_tokens=(20, 40))
        results = run_paths(lm, ngram, prompts, params)
        assert len({repr(r) for r in results.values()}) == 1, "the step paths disagree"
        assert assert_drafts_are_lookups(prompts, [(t, s) for t, _, s in results["default"]]) > 0


def test_seeded_sampling_equals_plain(successor):
    lm = successor[0]
    prompts, _ = workload(9, seed=9, vocab=32)
    params = seeded_params(9, seed=9)
    outs = check_seeded_sampling(lm, ngram(), prompts, params)
    assert assert_drafts_are_lookups(prompts, outs) > 0


# --------------------------------------------------------------------------------------------------------------
# hand-made prompts on the successor target


def test_hand_made_prompt_drafts_the_earlier_continuation(successor):
    lm, _ = successor
    prompt = [3, 4, 5, 6, 7, 8, 20, 21, 9, 3, 4, 5]
    out = LLM.from_loaded(lm, ngram()).generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True),
                                                use_tqdm=False)[0]
    assert out.token_ids == [6, 7, 8, 9, 10, 11]
    assert out.steps == [
        StepTrace(12, [7, 8, 20, 21], 2),  # "4 5 6" occurred at 1..3: what followed it; 20 is rejected (9)
        StepTrace(15, [3, 4, 5, 6], 0),  # "9" occurred at 8: what followed it
        StepTrace(16, [10, 10, 10, 10], 0),  # "10" never occurred: the bonus repeated
    ]
    assert out.acceptance_lengths == [3, 1, 1]


@pytest.mark.parametrize("ngram_max, first", [(1, StepTrace(9, [30, 5, 6, 30], 0)), (2, StepTrace(9, [7, 8, 9, 6], 3)),
                                              (3, StepTrace(9, [7, 8, 9, 6], 3))])
def test_ngram_max_bounds_the_match(successor, ngram_max, first):
    """The bonus 6 after "... 5": "5 6" occurred at 1..2 (continued by 7 8 9), the single "6" last at 6 (by 30)."""
    lm, _ = successor
    prompt = [4, 5, 6, 7, 8, 9, 6, 30, 5]
    out = LLM.from_loaded(lm, ngram(ngram_max)).generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True),
                                                         use_tqdm=False)[0]
    assert out.token_ids == list(range(6, 14)) and out.steps[0] == first


def test_history_survives_a_prefix_hit(successor):
    """B reuses A's cached prompt blocks (their tokens were written by A's prefill) and drafts from a match there."""
    lm, _ = successor
    llm = LLM.from_loaded(lm, ngram(), engine=EngineConfig(block_size=4))
    a = [3, 4, 5, 6, 7, 8, 9, 10, 20, 21, 22, 23, 24, 25, 26, 27]
    llm.generate([a], SamplingParams(max_tokens=1), use_tqdm=False)
    out = llm.generate([a + [30, 17, 5, 6]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert llm.engine.blocks.prefix_hits == 4
    assert out.token_ids == [7, 8, 9, 10] and out.steps == [StepTrace(20, [8, 9, 10, 20], 3)]


def test_history_survives_preemption(successor):
    """Counting up wraps around to the prompt's own tokens: every draft from then on continues the prompt and is
    accepted, also after the request was preempted and its history recomputed."""
    lm, _ = successor
    prompts = [list(range(3, 32)), list(range(5, 32))]
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    llm = LLM.from_loaded(lm, ngram(),
                          engine=EngineConfig(block_size=2, max_num_seqs=2, enable_prefix_caching=False,
                                              num_kv_blocks=(31 + 60 + K + 1) // 2 + 8))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0 and any(o.num_preemptions for o in outs)
    for p, o in zip(prompts, outs):
        assert o.token_ids == [(p[-1] + 1 + i) % 32 for i in range(60)]
        late = [st for st in o.steps if st.position >= len(p) + p[0]]  # the bonus is back at the prompt's ids
        assert len(late) > 5 and all(st.num_accepted == len(st.draft) == K for st in late), o.steps
    assert assert_drafts_are_lookups(prompts, outs) > 0


def test_generate_command(successor, capsys):
    _, path = successor
    capsys.readouterr()
    rc = main(["generate", "--model", str(path), "--device", "cpu", "--prompt-ids", "4,5,6,7,8,9,6,30,5",
               "--max-tokens", "8", "--speculative-method", "ngram", "--ngram-max", "1",
               "--num-draft-tokens", "4", "--json", "--trace", "--draft-len-schedule", "off"])
    result = json.loads(capsys.readouterr().out)
    assert rc == 0 and result["token_ids"] == list(range(6, 14))
    assert result["steps"][0] == {"position": 9, "draft": [30, 5, 6, 30], "num_accepted": 0}
