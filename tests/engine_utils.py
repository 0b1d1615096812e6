"""Shared by the engine tests: tiny models, workloads, the per-request references (memoized), a step-by-step driver
that checks block accounting after every step, and pool checks."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from blockspec.engine.sequence import SeqStatus
from oracles import generate
from blockspec.llm import LLM
from blockspec.loading.draft_loader import load_draft
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.sampling import SamplingParams
from oracles import spec_generate
from dflash_utils import make_zlab_draft
from hf_utils import make_hf_model, save_hf_model
from trained_pair import CYCLE_A, CYCLE_B, cycle_seq, trained_pair

RANDOM_VOCAB = 128
RANDOM_MASK = 127

# --------------------------------------------------------------------------------------------------------------
# helpers


def check_block_accounting(engine) -> None:
    """Every block's reference count equals the number of live block tables holding it; the free list is exactly
    the blocks nobody holds; a block is shared only if it is a committed, hashed (prefix-cache) block."""
    bm, sched = engine.blocks, engine.scheduler
    live = list(sched.running) + list(sched.waiting)
    held = Counter(b for s in live for b in s.block_table)
    for s in live:
        assert len(set(s.block_table)) == len(s.block_table), (s.request_id, s.block_table)
        assert len(s.block_table) * bm.block_size >= s.num_computed, (s.request_id, s.num_computed)
        assert not s.finished
    for s in sched.running:
        assert s.status == SeqStatus.RUNNING
    for s in sched.waiting:
        assert s.status == SeqStatus.WAITING
    assert len(bm.ref) == engine.pool.num_blocks
    refs = {b: r for b, r in enumerate(bm.ref) if r != 0}
    assert refs == dict(held), "reference counts differ from the blocks held by live sequences"
    assert set(bm.free) == set(range(len(bm.ref))) - set(refs), "the free list is not exactly the unheld blocks"
    assert len(bm.free) == len(bm.ref) - len(refs)
    for b, n in held.items():
        if n > 1:
            assert b in bm.hash_of, f"block {b} is shared by {n} sequences but is not a cached block"


def assert_pool_empty(engine) -> None:
    bm = engine.blocks
    assert not engine.has_unfinished()
    assert bm.num_free == engine.pool.num_blocks
    assert all(r == 0 for r in bm.ref)
    assert not engine.seqs  # every finished request was handed back and forgotten


class Run:
    """Drive an engine step by step: add requests (at once or a few per step), check the block accounting after
    every step, collect streamed deltas and final outputs."""

    def __init__(self, llm: LLM) -> None:
        self.llm, self.engine = llm, llm.engine
        self.final: dict[str, object] = {}
        self.streamed: dict[str, list[int]] = {}
        self.acc_seen: dict[str, int] = {}
        self.max_running = 0
        self.batch_accept = 0  # most requests that each accepted >= 1 draft in the same step
        self.steps = 0

    def add(self, prompt, params, speculate: bool = True) -> str:
        return self.engine.add_request(list(prompt), params, speculate=speculate)

    def step(self) -> None:
        outs = self.engine.step()
        self.steps += 1
        assert self.steps < 5000, "the engine does not make progress"
        check_block_accounting(self.engine)
        self.max_running = max(self.max_running, len(self.engine.scheduler.running))
        accepting = 0
        for o in outs:
            assert o.request_id not in self.final, f"{o.request_id}: output after the final one"
            self.streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
            assert o.token_ids == self.streamed[o.request_id]
            new_acc = o.acceptance_lengths[self.acc_seen.get(o.request_id, 0):]
            self.acc_seen[o.request_id] = len(o.acceptance_lengths)
            accepting += any(a > 1 for a in new_acc)
            if o.finished:
                self.final[o.request_id] = o
        self.batch_accept = max(self.batch_accept, accepting)

    def run(self, prompts, params, stagger: int | None = None, speculate=None) -> list:
        """stagger=None: all requests before the first step; else `stagger` more after every step."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        speculate = speculate or [True] * len(prompts)
        todo = list(zip(prompts, params, speculate))
        first = len(todo) if stagger is None else max(1, stagger)
        ids = [self.add(*todo.pop(0)) for _ in range(min(first, len(todo)))]
        while todo or self.engine.has_unfinished():
            self.step()
            for _ in range(min(stagger or 0, len(todo))):
                ids.append(self.add(*todo.pop(0)))
        assert_pool_empty(self.engine)
        return [self.final[i] for i in ids]


def one_device_and_tp2(lm, draft, prompts, params) -> tuple[list, list]:
    """(token ids, acceptance lengths) of each prompt through one device (the loaded pair) and through
    LLM(tensor_parallel_size=2) on the CPU (gloo ranks loading the same target and drafter directories)."""
    want = [(o.token_ids, o.acceptance_lengths)
            for o in LLM.from_loaded(lm, draft).generate(prompts, params, use_tqdm=False)]
    tp = LLM(str(lm.source.path), speculative={"draft_model": str(draft.source)}, load=LoadConfig(device="cpu"),
             engine=EngineConfig(tensor_parallel_size=2))
    try:
        got = [(o.token_ids, o.acceptance_lengths) for o in tp.generate(prompts, params, use_tqdm=False)]
    finally:
        tp.close()
    return want, got


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **kw)


def _key(params: SamplingParams):
    return (params.temperature, params.top_k, params.top_p, params.seed, params.max_tokens,
            tuple(params.stop_token_ids), params.ignore_eos)


_memo: dict = {}


def plain_ref(lm, prompt, params):
    """(token ids, finish reason) of plain single-request generation (memoized)."""
    key = ("plain", id(lm), tuple(prompt), _key(params))
    if key not in _memo:
        out = generate(lm, list(prompt), params)
        _memo[key] = (list(out.token_ids), out.finish_reason)
    return _memo[key]


def spec_ref(lm, draft, prompt, params):
    """(token ids, finish reason, acceptance lengths, step trace reprs) of single-request spec_generate (memoized)."""
    key = ("spec", id(lm), id(draft), tuple(prompt), _key(params))
    if key not in _memo:
        out = spec_generate(lm, draft, list(prompt), params)
        _memo[key] = (list(out.token_ids), out.finish_reason, list(out.acceptance_lengths), list(map(repr, out.steps)))
    return _memo[key]


def assert_equal_plain(lm, prompts, params, outs) -> None:
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp, o) in enumerate(zip(prompts, params, outs)):
        ids, reason = plain_ref(lm, p, sp)
        assert o.token_ids == ids, f"request {i} (prompt len {len(p)}): batched != plain"
        assert o.finish_reason == reason, (i, o.finish_reason, reason)
        assert o.prompt_ids == list(p)


def assert_equal_spec(lm, draft, prompts, params, outs) -> None:
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp, o) in enumerate(zip(prompts, params, outs)):
        ids, reason, acc, steps = spec_ref(lm, draft, p, sp)
        assert o.token_ids == ids, f"request {i}: batched != spec_generate"
        assert o.finish_reason == reason
        assert o.acceptance_lengths == acc, f"request {i} (prompt len {len(p)}): acceptance lengths differ"
        assert list(map(repr, o.steps)) == steps, f"request {i}: step traces differ"


def spec_consistency(outs) -> None:
    """Each speculative request: the first token comes from the prefill, every other one from a verify step."""
    for o in outs:
        assert sum(o.acceptance_lengths) == len(o.token_ids) - 1
        assert len(o.steps) == len(o.acceptance_lengths)
        for st, a in zip(o.steps, o.acceptance_lengths):
            assert 1 <= a <= st.num_accepted + 1 <= len(st.draft) + 1


# --------------------------------------------------------------------------------------------------------------
# models


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny llama (hidden 32, 2 layers, 512 positions) and a random 2-layer DFlash drafter (block 8)."""
    root = tmp_path_factory.mktemp("engine_tiny")
    hf = make_hf_model("llama", seed=3, vocab_size=RANDOM_VOCAB, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    save_hf_model(hf, root / "target")
    make_zlab_draft(hf.config, root / "draft", layers=2, block_size=8, target_layer_ids=[0, 1],
                    mask_token_id=RANDOM_MASK, seed=1)
    lm = load_model(str(root / "target"), LoadConfig(device="cpu", with_tokenizer=False))
    draft = load_draft(SpeculativeConfig(draft_model=str(root / "draft")), lm)
    assert draft.spec.num_draft_tokens == 7
    return lm, draft


@pytest.fixture(scope="module")
def trained():
    pair = trained_pair()
    return pair.lm, pair.draft


def mixed_workload(lm, n: int = 32, seed: int = 0):
    """n requests: prompt lengths 1..300 (both ends included), outputs 1..24 tokens, some with stop tokens that
    really occur in the output, some honouring the model's eos."""
    rng = random.Random(seed)
    lengths = [1, 300, 2, 3, 5, 8, 13, 16, 17, 31, 33, 48, 64, 100, 127, 129, 200, 255, 299]
    lengths += [rng.randint(1, 300) for _ in range(n - len(lengths))]
    rng.shuffle(lengths)
    prompts, params = [], []
    for i, n_tok in enumerate(lengths):
        prompt = [rng.randrange(RANDOM_VOCAB) for _ in range(n_tok)]
        mt = [1, 2, 24][i] if i < 3 else rng.randint(1, 24)
        sp = greedy(mt, ignore_eos=i % 3 != 0)
        if i % 4 == 1 and mt > 3:  # a stop token taken from the request's own output
            free_run, _ = plain_ref(lm, prompt, greedy(mt, ignore_eos=True))
            sp = greedy(mt, ignore_eos=True, stop_token_ids=[free_run[rng.randint(1, mt - 1)]])
        prompts.append(prompt)
        params.append(sp)
    return prompts, params


@pytest.fixture(scope="module")
def workload(tiny):
    lm, _ = tiny
    prompts, params = mixed_workload(lm)
    reasons = Counter(plain_ref(lm, p, sp)[1] for p, sp in zip(prompts, params))
    assert reasons["stop"] >= 3 and reasons["length"] >= 10, reasons  # the stop path really runs
    return prompts, params


def cycle_workload(n: int, seed: int, max_len: int = 150, max_tokens=(20, 48)):
    """Prompts the trained pair is good at (cycles from any offset, 1..max_len tokens), some with a random head
    (rejections first, then long accepted runs), and a couple of random-token prompts."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        cyc = (CYCLE_A, CYCLE_B)[i % 2]
        length = [1, 2, max_len][i] if i < 3 else rng.randint(1, max_len)
        p = cycle_seq(cyc, rng.randrange(len(cyc)), length)
        if i % 5 == 3:
            head = [rng.randrange(60) for _ in range(rng.randint(1, 6))]
            p = head + p[: max(1, length - len(head))]
        if i % 7 == 6:
            p = [rng.randrange(60) for _ in range(length)]
        prompts.append(p)
    params = [greedy(rng.randint(*max_tokens), ignore_eos=True) for _ in range(n)]
    return prompts, params
