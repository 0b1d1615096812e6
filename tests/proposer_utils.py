"""Shared by the tests of the ngram and draft-model proposers (test_ngram.py, test_draft_model.py): tiny random
checkpoints, a workload of prompts that repeat phrases, and the engine scenarios every proposer must pass with greedy
outputs equal to plain decoding token for token (engine_utils.Run drives the engine and checks the block accounting
after every step). Each scenario also asserts that it really exercised what it is named after."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from blockspec.config import EngineConfig
from blockspec.engine.outputs import RequestOutput
from blockspec.llm import LLM
from blockspec.loading.loader import LoadConfig, LoadedModel, load_model
from blockspec.sampling import SamplingParams
from blockspec.speculative.proposer import Proposer
from engine_utils import Run, assert_equal_plain, plain_ref, spec_consistency
from hf_utils import make_hf_model, save_hf_model
from oracles import generate
from path_log import PathLog

VOCAB = 128
K = 4
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)


@dataclass
class Checkpoints:
    lm: LoadedModel  # the target, loaded
    target: Path
    other: Path  # an unrelated random causal LM with the target's vocabulary (another architecture and shape)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> Checkpoints:
    root = tmp_path_factory.mktemp("proposers")
    save_hf_model(make_hf_model("llama", seed=3, **TINY), root / "target")
    # 3 layers, 1 KV head of dim 12: the proposer pages get a shape of their own, unlike the target's
    save_hf_model(make_hf_model("qwen2", seed=7, **{**TINY, "hidden_size": 48, "num_hidden_layers": 3,
                                                      "num_key_value_heads": 1}), root / "other")
    lm = load_model(str(root / "target"), LoadConfig(device="cpu", with_tokenizer=False))
    return Checkpoints(lm, root / "target", root / "other")


def phrase_prompt(rng: random.Random, vocab: int, max_len: int) -> list[int]:
    """Random tokens around a phrase that occurs twice, the second time cut short: prompt lookup finds it. The
    phrase counts up (consecutive ids), so a target that counts on (test_ngram.py) accepts its continuation."""
    word = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731 - ids 0..2 are pad/bos/eos
    first = rng.randrange(3, vocab)
    phrase = [3 + (first - 3 + i) % (vocab - 3) for i in range(rng.randint(2, 8))]
    p = word(rng.randint(0, max_len // 3)) + phrase + word(rng.randint(0, 6)) + phrase[: rng.randint(1, len(phrase))]
    return p[-max_len:]


def workload(n: int, seed: int, vocab: int = VOCAB, max_len: int = 40,
             max_tokens: tuple[int, int] = (6, 30)) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [phrase_prompt(rng, vocab, max_len) for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(*max_tokens), ignore_eos=i % 3 != 0) for i in range(n)]
    return prompts, params


def shared_prefix_workload(n: int, seed: int, vocab: int = VOCAB) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts that share a 24-token base (whole blocks for the prefix cache) and end with a piece of it."""
    rng = random.Random(seed)
    base = (phrase_prompt(rng, vocab, 24) + [rng.randrange(3, vocab) for _ in range(24)])[:24]
    prompts = []
    for _ in range(n):
        a = rng.randrange(20)
        middle = [rng.randrange(3, vocab) for _ in range(rng.randint(0, 5))]
        prompts.append(base + middle + base[a:a + rng.randint(1, 4)])
    return prompts, [SamplingParams(max_tokens=rng.randint(6, 24), ignore_eos=True) for _ in range(n)]


def pool_blocks(prompts, params, block_size: int, slack: float) -> int:
    """The largest single request (prompt + outputs + a verify window) times 1 + slack: too small for all at once."""
    need = max(math.ceil((len(p) + sp.max_tokens + K + 1) / block_size) + 1 for p, sp in zip(prompts, params))
    return int(need * (1 + slack))


def _prefill_chunks(engine) -> list[int]:
    """Records, per scheduled prefill, whether it left part of the prompt for a later step (chunked prefill)."""
    partial: list[int] = []
    real = engine.scheduler.schedule

    def schedule():
        scheduled = real()
        partial.extend(s.seq.num_computed + s.num_rows < s.seq.prefill_len for s in scheduled if s.is_prefill)
        return scheduled

    engine.scheduler.schedule = schedule
    return partial


SCENARIOS = ["staggered", "preemption", "prefix_cache", "prefix_cache_small_pool", "chunked_prefill", "context_end"]


def run_scenario(name: str, lm: LoadedModel, proposer: Proposer) -> tuple[list[list[int]], list[RequestOutput]]:
    """Runs one scenario with the proposer, asserts it did what it is named after and that every output equals
    plain single-request decoding (tests/oracles.py) token for token; returns (prompts, outputs) for trace checks."""
    vocab = lm.config.vocab_size
    stagger = None
    if name == "staggered":  # one request joins after every step, next to the decoding ones
        prompts, params = workload(10, seed=1, vocab=vocab)
        engine = dict(max_num_seqs=4, block_size=4)
        stagger = 1
    elif name == "preemption":  # recompute: the newest running request gives its blocks back
        prompts, params = workload(8, seed=2, vocab=vocab, max_tokens=(16, 30))
        engine = dict(block_size=2, max_num_seqs=8, enable_prefix_caching=False,
                      num_kv_blocks=pool_blocks(prompts, params, 2, 0.5))
    elif name.startswith("prefix_cache"):
        prompts, params = shared_prefix_workload(8, seed=3, vocab=vocab)
        small = name.endswith("small_pool")
        engine = dict(block_size=4, max_num_seqs=8 if small else 3)
        if small:  # cached blocks outlive a preemption and are hit again by the recompute
            engine["num_kv_blocks"] = pool_blocks(prompts, params, 4, 1.0)
        stagger = None if small else 2
    elif name == "chunked_prefill":  # prompts longer than the step's token budget
        prompts, params = workload(6, seed=4, vocab=vocab, max_len=60)
        prompts = [p + p[: 60 - len(p)] for p in prompts]
        engine = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=12)
        stagger = 2
    elif name == "context_end":  # drafts are clipped where the context ends
        prompts, params = workload(6, seed=5, vocab=vocab, max_len=35, max_tokens=(40, 40))
        engine = dict(block_size=4, max_model_len=40)
    else:
        raise ValueError(name)
    llm = LLM.from_loaded(lm, proposer, engine=EngineConfig(**engine))
    partial = _prefill_chunks(llm.engine)
    run = Run(llm)
    outs = run.run(prompts, params, stagger=stagger)
    if name == "context_end":
        params = [SamplingParams(max_tokens=40 - len(p), ignore_eos=sp.ignore_eos) for p, sp in zip(prompts, params)]
    assert_equal_plain(lm, prompts, params, outs)
    spec_consistency(outs)
    e = llm.engine
    preempted = e.scheduler.num_preemptions > 0 and any(o.num_preemptions for o in outs)
    hits = e.blocks.prefix_hits > 0
    checks = {"staggered": run.max_running >= 3, "preemption": preempted, "prefix_cache": hits,
              "prefix_cache_small_pool": preempted and hits, "chunked_prefill": any(partial),
              "context_end": any(0 < len(st.draft) < K for o in outs for st in o.steps)}
    assert checks[name], f"the scenario {name} did not exercise what it is named after"
    return prompts, outs


# overlap on the CPU too, as on CUDA (the engine's CPU default: off)
CONFIGS = {"default": dict(overlap=True), "no_overlap": dict(overlap=False),
           "split_mixed_steps": dict(split_mixed_steps=True, overlap=True),
           "enforce_eager": dict(enforce_eager=True, overlap=True), "varlen_only": dict(step_path="varlen", overlap=True)}


def run_paths(lm: LoadedModel, make_proposer: Callable[[], Proposer], prompts, params) -> dict[str, list]:
    """The same staggered workload through each step path: the decode step where every request decodes (default,
    enforce_eager), also for the decoding part of mixed steps (split_mixed_steps), never (varlen only). Returns
    (tokens, acceptance lengths, step traces) per config; asserts each path really ran and that outputs equal plain."""
    results = {}
    for name, extra in CONFIGS.items():
        llm = LLM.from_loaded(lm, make_proposer(),
                              engine=EngineConfig(max_num_seqs=6, block_size=4, max_num_batched_tokens=48, **extra))
        log = PathLog()  # per engine step: (path, requests, K) of each path it took
        llm.engine.observe(log)
        outs = Run(llm).run(prompts, params, stagger=2)
        assert_equal_plain(lm, prompts, params, outs)
        spec_consistency(outs)
        steps, calls = log.steps, log.calls
        decoded = [c for c in calls if c[0] == "decode"]
        if name == "varlen_only":
            assert not decoded
        else:
            assert any(b > 1 and k > 0 for _, b, k in decoded), calls
        mixed = [s for s in steps if len(s) == 2]
        assert bool(mixed) == (name == "split_mixed_steps"), mixed
        assert (llm.engine.num_overlapped_steps > 0) == (name not in ("no_overlap", "varlen_only")), name
        assert any(c[0] == "varlen" for c in calls)
        results[name] = [(o.token_ids, o.acceptance_lengths, o.steps) for o in outs]
    return results


def seeded_params(n: int, seed: int) -> list[SamplingParams]:
    """Seeded sampling at temperature 1 with top_k / top_p (every third request greedy)."""
    rng = random.Random(seed)
    return [SamplingParams(max_tokens=rng.randint(10, 30), ignore_eos=True) if i % 3 == 2 else
            SamplingParams(temperature=1.0, top_k=rng.choice([3, 5]), top_p=rng.choice([0.9, 0.95]),
                           seed=1000 + i, max_tokens=rng.randint(10, 30), ignore_eos=True) for i in range(n)]


def check_seeded_sampling(lm: LoadedModel, proposer: Proposer, prompts, params) -> list[RequestOutput]:
    """Argmax drafts: every emitted token is the target's own seeded sample at its position, so speculative output
    equals plain seeded output (the dense oracle, and the same engine with speculate=False)."""
    llm = LLM.from_loaded(lm, proposer, engine=EngineConfig(max_num_seqs=4, block_size=4))
    spec = llm.generate(prompts, params, use_tqdm=False)
    off = llm.generate(prompts, params, use_tqdm=False, speculate=False)
    for i, (p, sp, o) in enumerate(zip(prompts, params, spec)):
        plain = generate(lm, p, sp).token_ids
        assert o.token_ids == plain, f"request {i}: seeded speculative output != plain seeded output"
        assert off[i].token_ids == plain and not off[i].acceptance_lengths
    sampled = [o for o, sp in zip(spec, params) if not sp.greedy]
    assert any(a > 1 for o in sampled for a in o.acceptance_lengths), "no draft was accepted under sampling"
    return spec


def check_single_requests(lm: LoadedModel, make_proposer: Callable[[], Proposer], prompts, params) -> list:
    """One request at a time through LLM.generate: equal to the dense oracle's plain decoding."""
    outs = []
    for p, sp in zip(prompts, params):
        out = LLM.from_loaded(lm, make_proposer(),
                              engine=EngineConfig(max_num_seqs=1)).generate([p], sp, use_tqdm=False)[0]
        assert (out.token_ids, out.finish_reason) == plain_ref(lm, p, sp)
        outs.append(out)
    spec_consistency(outs)
    return outs
