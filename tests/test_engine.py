"""The batched engine (continuous batching, chunked prefill, paged KV shared by target and draft context, prefix
cache, preemption, draft-length schedule) against the single-request references, in fp32 on CPU with tiny models.

- Greedy outputs of a batch equal per-request plain `generate`, token for token, for 32 requests of mixed prompt
  (1..300) and output lengths, arriving at once or staggered, KV block sizes 1/3/16, chunked prefill forced by a small
  token budget, with no drafter, a random drafter and a trained drafter (acceptance > 1 inside a batch).
- With DFlash, per-request acceptance lengths and step traces equal the single-request `spec_generate`.
- Preemption (pool too small) and prefix-cache hits leave outputs and acceptance lengths unchanged.
- The pool's bytes per token follow 2 x (L_t*kvh_t*hd_t + L_d*kvh_d*hd_d) x dtype bytes; nothing scales with
  max_num_seqs x max_model_len.
- draft_len_schedule shortens drafts at large batch; speculate=False requests decode plainly; outputs unchanged.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from blockspec.config import SpeculativeConfig
from blockspec.engine.decode_step import DecodeStep
from blockspec.engine.sequence import SeqStatus
from blockspec.errors import BlockspecError
from blockspec.generate import generate
from blockspec.kv.pool import CacheShape, KVPool
from blockspec.llm import LLM
from blockspec.loading.draft_loader import load_draft
from blockspec.loading.loader import load_model
from blockspec.sampling import SamplingParams
from blockspec.spec.single import spec_generate
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
            assert 1 <= a <= st["num_accepted"] + 1 <= len(st["draft"]) + 1


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
    lm = load_model(str(root / "target"), device="cpu", with_tokenizer=False)
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


# --------------------------------------------------------------------------------------------------------------
# 1. batched greedy == per-request greedy


BUDGET = {1: 24, 3: 40, 16: 64}


@pytest.mark.parametrize("stagger", [None, 3], ids=["at-once", "staggered"])
@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("with_draft", [False, True], ids=["plain", "dflash-random"])
def test_batched_greedy_equals_plain(tiny, workload, with_draft, block_size, stagger):
    lm, draft = tiny
    prompts, params = workload
    llm = LLM.from_loaded(lm, draft if with_draft else None, block_size=block_size, max_num_seqs=32,
                          max_num_batched_tokens=BUDGET[block_size], num_kv_blocks=7000 // block_size)
    run = Run(llm)
    outs = run.run(prompts, params, stagger=stagger)
    assert_equal_plain(lm, prompts, params, outs)
    assert run.max_running >= 4  # it really batched
    if with_draft:
        spec_consistency(outs)
        assert all(o.acceptance_lengths or len(o.token_ids) == 1 for o in outs)
    else:  # no drafter: every decode step emits exactly one token
        assert all(set(o.acceptance_lengths) <= {1} for o in outs)
        assert all(not st["draft"] for o in outs for st in o.steps)
    assert llm.engine.scheduler.num_preemptions == 0


CACHE_PARAMS = [pytest.param(False, id="no-prefix-cache"), pytest.param(True, id="prefix-cache")]


@pytest.mark.parametrize("prefix_caching", CACHE_PARAMS)
@pytest.mark.parametrize("stagger", [None, 2], ids=["at-once", "staggered"])
def test_trained_drafter_accepts_inside_a_batch_with_chunked_prefill(trained, stagger, prefix_caching):
    """Tiny token budget (decodes are truncated and prefill is chunked), trained drafter: still lossless, and several
    requests accept long runs in the same step. The cycle prompts share blocks, so the prefix cache hits."""
    lm, draft = trained
    prompts, params = cycle_workload(16, seed=1)
    llm = LLM.from_loaded(lm, draft, block_size=4, max_num_seqs=16, max_num_batched_tokens=24, num_kv_blocks=1200,
                          enable_prefix_caching=prefix_caching)
    run = Run(llm)
    outs = run.run(prompts, params, stagger=stagger)
    assert_equal_plain(lm, prompts, params, outs)
    spec_consistency(outs)
    assert run.batch_accept >= 3, run.batch_accept
    taus = [o.mean_acceptance_length for o in outs if o.acceptance_lengths]
    assert sum(taus) / len(taus) > 2.0, taus


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_acceptance_lengths_equal_single_request_spec(trained, block_size):
    """When the budget never truncates a verify block (max_num_seqs x (K+1) <= budget), every request's acceptance
    lengths and step trace equal the single-request reference loop; prefill is still chunked (budget 40)."""
    lm, draft = trained
    prompts, params = cycle_workload(12, seed=2)
    K = draft.spec.num_draft_tokens
    llm = LLM.from_loaded(lm, draft, block_size=block_size, max_num_seqs=4, max_num_batched_tokens=4 * (K + 1) + 8,
                          num_kv_blocks=4000 // block_size)
    outs = Run(llm).run(prompts, params, stagger=1)
    assert_equal_spec(lm, draft, prompts, params, outs)
    assert_equal_plain(lm, prompts, params, outs)
    assert max(max(o.acceptance_lengths) for o in outs) == K + 1


def test_stream_deltas_and_generate_order(tiny, workload):
    lm, draft = tiny
    prompts, params = workload[0][:8], workload[1][:8]
    llm = LLM.from_loaded(lm, draft, block_size=8, max_num_batched_tokens=48, enable_prefix_caching=False)
    got: dict[str, list[int]] = {}
    finals = {}
    for o in llm.stream(prompts, params):
        got.setdefault(o.request_id, []).extend(o.new_token_ids)
        if o.finished:
            finals[o.request_id] = o
    assert len(finals) == 8 and all(got[r] == o.token_ids for r, o in finals.items())
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_equal_plain(lm, prompts, params, outs)
    assert_pool_empty(llm.engine)


# --------------------------------------------------------------------------------------------------------------
# 2. preemption


@pytest.mark.parametrize("prefix_caching", CACHE_PARAMS)
@pytest.mark.parametrize("with_draft", [False, True], ids=["plain", "dflash-random"])
def test_preemption_keeps_outputs(tiny, workload, with_draft, prefix_caching):
    """Recomputing a preempted request restores its own committed blocks from the prefix cache when it is on."""
    lm, draft = tiny
    prompts, params = workload
    # the largest request needs ceil((300 + 24 + 8) / 4) = 83 blocks; all 32 together need far more than 100
    llm = LLM.from_loaded(lm, draft if with_draft else None, block_size=4, max_num_seqs=32,
                          max_num_batched_tokens=64, num_kv_blocks=100, enable_prefix_caching=prefix_caching)
    outs = Run(llm).run(prompts, params, stagger=4)
    assert llm.engine.scheduler.num_preemptions > 0
    assert any(o.num_preemptions > 0 for o in outs)
    assert_equal_plain(lm, prompts, params, outs)
    if with_draft:
        spec_consistency(outs)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_keeps_acceptance_lengths(trained, prefix_caching):
    """Preempted requests are recomputed and continue with the same drafts (the pool is so tight that their freed
    blocks are reused at once: no prefix hits here even with the cache on)."""
    lm, draft = trained
    prompts, params = cycle_workload(10, seed=3, max_len=60, max_tokens=(30, 60))
    K = draft.spec.num_draft_tokens
    llm = LLM.from_loaded(lm, draft, block_size=4, max_num_seqs=6, max_num_batched_tokens=6 * (K + 1),
                          num_kv_blocks=60, enable_prefix_caching=prefix_caching)
    outs = Run(llm).run(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_equal_spec(lm, draft, prompts, params, outs)


# --------------------------------------------------------------------------------------------------------------
# 3. prefix cache


def test_prefix_cache_hit_keeps_outputs_and_acceptance(trained):
    lm, draft = trained
    prefix = cycle_seq(CYCLE_A, 3, 41)
    a = prefix + cycle_seq(CYCLE_A, 44, 3)
    b = prefix + cycle_seq(CYCLE_A, 44, 7)  # shares 41 tokens (5 full blocks) with a
    sp = greedy(32, ignore_eos=True)
    cached = LLM.from_loaded(lm, draft, block_size=8, max_num_batched_tokens=256)
    plain = LLM.from_loaded(lm, draft, block_size=8, max_num_batched_tokens=256, enable_prefix_caching=False)
    bm = cached.engine.blocks

    first = cached.generate([a], sp, use_tqdm=False)[0]
    hits = bm.prefix_hits
    second = cached.generate([b], sp, use_tqdm=False)[0]
    assert bm.prefix_hits - hits >= 41 // 8  # every full block of the shared prefix came from the cache
    # a's own generated tokens are cached too: continuing a's full text hits blocks written by verify steps
    hits = bm.prefix_hits
    cont = a + first.token_ids
    third = cached.generate([cont], sp, use_tqdm=False)[0]
    assert bm.prefix_hits - hits >= (len(cont) - 1) // 8 - 1
    again = cached.generate([a], sp, use_tqdm=False)[0]  # the very same prompt again

    for prompt, out in [(a, first), (b, second), (cont, third), (a, again)]:
        ref = plain.generate([prompt], sp, use_tqdm=False)[0]
        assert out.token_ids == ref.token_ids == plain_ref(lm, prompt, sp)[0]
        assert out.acceptance_lengths == ref.acceptance_lengths == spec_ref(lm, draft, prompt, sp)[2]
        assert out.mean_acceptance_length > 2.5, out.acceptance_lengths  # the drafts are meaningful
    assert plain.engine.blocks.prefix_hits == 0
    assert_pool_empty(cached.engine)
    assert_pool_empty(plain.engine)


def test_prefix_shared_with_a_running_request(trained):
    """b arrives while a (same long prefix) is still decoding: b maps a's committed blocks (ref count 2)."""
    lm, draft = trained
    prefix = cycle_seq(CYCLE_B, 5, 64)
    a, b = prefix + [CYCLE_B[9]], prefix + cycle_seq(CYCLE_B, 9, 6)
    sp = greedy(48, ignore_eos=True)
    llm = LLM.from_loaded(lm, draft, block_size=4, max_num_batched_tokens=96)
    run = Run(llm)
    ra = run.add(a, sp)
    run.step()
    run.step()
    hits = llm.engine.blocks.prefix_hits
    rb = run.add(b, sp)
    run.step()  # check_block_accounting sees the shared blocks held twice, each a cached block
    assert llm.engine.blocks.prefix_hits - hits >= 64 // 4
    assert max(llm.engine.blocks.ref) == 2
    while llm.engine.has_unfinished():
        run.step()
    assert_pool_empty(llm.engine)
    assert_equal_spec(lm, draft, [a, b], [sp, sp], [run.final[ra], run.final[rb]])


# --------------------------------------------------------------------------------------------------------------
# 5. memory


def test_pool_bytes_per_token_formula(tiny):
    lm, draft = tiny
    t, d = lm.config, draft.config
    expected = 2 * (t.num_hidden_layers * t.num_key_value_heads * t.head_dim
                    + d.num_hidden_layers * d.num_key_value_heads * d.head_dim) * 4
    assert expected == 2 * (2 * 2 * 8 + 2 * 2 * 16) * 4  # the tiny shapes, written out
    for bs, n in [(1, 37), (3, 11), (16, 5)]:
        llm = LLM.from_loaded(lm, draft, block_size=bs, num_kv_blocks=n)
        pool = llm.engine.pool
        assert KVPool.bytes_per_token(pool.target_shape, pool.draft_shape, torch.float32) == expected
        assert pool.nbytes() == n * bs * expected
        assert pool.k.shape == (2, n * bs, 2, 8) and pool.draft_k.shape == (2, n * bs, 2, 16)
        plain = LLM.from_loaded(lm, None, block_size=bs, num_kv_blocks=n).engine.pool
        assert plain.draft_k is None
        assert plain.nbytes() == n * bs * 2 * (2 * 2 * 8) * 4
    # other dtypes: element size enters linearly
    ts, ds = CacheShape(36, 8, 128), CacheShape(5, 8, 128)
    assert KVPool.bytes_per_token(ts, ds, torch.bfloat16) == 2 * (36 * 8 * 128 + 5 * 8 * 128) * 2
    assert KVPool.bytes_per_token(ts, None, torch.float16) == 2 * 36 * 8 * 128 * 2
    bf = KVPool(3, 16, CacheShape(2, 2, 8), CacheShape(1, 2, 16), torch.bfloat16, torch.device("cpu"))
    assert bf.nbytes() == 3 * 16 * KVPool.bytes_per_token(bf.target_shape, bf.draft_shape, torch.bfloat16)


def _engine_tensor_bytes(engine) -> int:
    """Bytes of every tensor the engine owns besides the models' own weights and buffers (pool, runner, scheduler,
    block manager, sequences): found by walking attributes, lists, dicts."""
    model_tensors = {id(t) for m in (engine.lm.model, engine.draft.model if engine.draft else None) if m is not None
                     for t in list(m.parameters()) + list(m.buffers())}
    seen, total, stack = set(), 0, [v for k, v in vars(engine).items() if k not in ("lm", "draft")]
    while stack:
        x = stack.pop()
        if id(x) in seen or x is None or isinstance(x, (int, float, str, bool, torch.nn.Module, DecodeStep)):
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            if id(x) not in model_tensors:
                total += x.numel() * x.element_size()
        elif isinstance(x, dict):
            stack += list(x.values())
        elif isinstance(x, (list, tuple, set, frozenset)) or type(x).__name__ == "deque":
            stack += list(x)
        elif hasattr(x, "__dict__"):
            stack += [v for k, v in vars(x).items() if k not in ("lm", "draft")]
    return total


def test_memory_does_not_scale_with_max_num_seqs_times_max_model_len(tiny):
    lm, draft = tiny
    sizes = []
    for max_num_seqs in (1, 8, 256):
        llm = LLM.from_loaded(lm, draft, block_size=16, num_kv_blocks=40, max_num_seqs=max_num_seqs)
        before = _engine_tensor_bytes(llm.engine)
        assert before == llm.engine.pool.nbytes()  # the pool is the only engine-owned tensor storage
        llm.generate([[5, 6, 7], [9] * 40], greedy(6), use_tqdm=False)
        sizes.append((llm.engine.pool.nbytes(), _engine_tensor_bytes(llm.engine)))
    assert sizes[0] == sizes[1] == sizes[2] == (40 * 16 * llm.engine.pool.bytes_per_token(
        llm.engine.pool.target_shape, llm.engine.pool.draft_shape, torch.float32),) * 2
    # the same with max_model_len: a longer context does not grow a fixed pool either
    a = LLM.from_loaded(lm, draft, num_kv_blocks=40, max_model_len=64).engine.pool.nbytes()
    b = LLM.from_loaded(lm, draft, num_kv_blocks=40, max_model_len=512).engine.pool.nbytes()
    assert a == b
    # without num_kv_blocks the pool is sized by tokens (capped), never max_num_seqs x max_model_len x something else
    llm = LLM.from_loaded(lm, draft, block_size=16, max_num_seqs=4, max_model_len=100)
    assert llm.engine.pool.num_blocks == -(-(4 * 100) // 16)
    llm = LLM.from_loaded(lm, draft, block_size=16, max_num_seqs=10**6, kv_cache_tokens=4096)
    assert llm.engine.pool.num_blocks == 4096 // 16


# --------------------------------------------------------------------------------------------------------------
# 6. draft_len_schedule and speculate=False


@pytest.mark.parametrize("schedule", [{1: 7, 4: 2}, {1: 7, 4: 0}])
def test_draft_len_schedule(trained, schedule):
    lm, draft = trained
    K = draft.spec.num_draft_tokens
    prompts, _ = cycle_workload(8, seed=4, max_len=40)
    params = [greedy(12 + 6 * i, ignore_eos=True) for i in range(8)]  # the batch shrinks as requests finish
    llm = LLM.from_loaded(lm, draft, block_size=4, max_num_seqs=8, max_num_batched_tokens=512,
                          draft_len_schedule=schedule)
    engine = llm.engine
    run = Run(llm)
    ids = [run.add(p, sp) for p, sp in zip(prompts, params)]
    seen_k = Counter()
    while engine.has_unfinished():
        run.step()
        batch = len(engine.scheduler.running)
        want = min(K, schedule[max(k for k in schedule if k <= batch)]) if batch else None
        for s in engine.scheduler.running:
            if not s.in_prefill:
                assert len(s.drafts) == want, (batch, s.drafts)
                seen_k[want] += 1
    outs = [run.final[i] for i in ids]
    assert_equal_plain(lm, prompts, params, outs)
    spec_consistency(outs)
    small = schedule[4]
    assert seen_k[small] > 0 and seen_k[7] > 0
    # the traces: all 8 ran together at first, so every request's first verify used the short block
    for o in outs:
        assert len(o.steps[0]["draft"]) == small
        assert {len(st["draft"]) for st in o.steps} <= {small, 7}
    longest = outs[-1]
    assert len(longest.steps[-1]["draft"]) == 7  # alone at the end: the full block again
    if small == 0:
        assert all(a == 1 for o in outs for a, st in zip(o.acceptance_lengths, o.steps) if not st["draft"])


def test_speculate_false_request_decodes_plainly(trained):
    lm, draft = trained
    prompts, params = cycle_workload(6, seed=5, max_len=50)
    llm = LLM.from_loaded(lm, draft, block_size=4, max_num_batched_tokens=64)
    spec_flags = [True, False, True, False, True, True]
    outs = Run(llm).run(prompts, params, stagger=2, speculate=spec_flags)
    assert_equal_plain(lm, prompts, params, outs)
    for o, flag in zip(outs, spec_flags):
        if flag:
            assert o.acceptance_lengths and max(o.acceptance_lengths) > 1
        else:
            assert all(a == 1 for a in o.acceptance_lengths)
            assert all(not st["draft"] for st in (o.steps or []))


# --------------------------------------------------------------------------------------------------------------
# scheduler corner cases


def _drive(engine, max_steps: int) -> bool:
    """Steps until nothing is left; False if it is still unfinished after max_steps."""
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return True
        engine.step()
        check_block_accounting(engine)
    return not engine.has_unfinished()


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_waiting_request_with_prefix_hits_does_not_block_a_running_one(tiny, prefix_caching):
    """a (running) needs 35 of the 40 blocks; b waits with a 20-token cached prefix and a 10-token rest that does not
    fit yet. b must simply wait for a."""
    lm, _ = tiny
    llm = LLM.from_loaded(lm, None, block_size=1, num_kv_blocks=40, max_num_seqs=2,
                          enable_prefix_caching=prefix_caching)
    e = llm.engine
    shared = list(range(3, 23))
    llm.generate([shared], greedy(3, ignore_eos=True), use_tqdm=False)  # its 20 prompt blocks are now cached
    pa, pb = list(range(40, 55)), shared + list(range(60, 70))
    sa, sb = greedy(20, ignore_eos=True), greedy(2, ignore_eos=True)
    ra, rb = e.add_request(pa, sa), e.add_request(pb, sb)
    outs = {}
    for _ in range(200):
        if not e.has_unfinished():
            break
        for o in e.step():
            outs[o.request_id] = o
        check_block_accounting(e)
    assert not e.has_unfinished(), f"no progress: {e.scheduler.num_preemptions} preemptions"
    assert outs[ra].token_ids == plain_ref(lm, pa, sa)[0] and outs[rb].token_ids == plain_ref(lm, pb, sb)[0]
    assert_pool_empty(e)


@pytest.mark.parametrize("prompt_len,max_tokens", [(5, 30), (30, 2)])
def test_pool_too_small_for_one_request_is_an_error(tiny, prompt_len, max_tokens):
    lm, _ = tiny
    llm = LLM.from_loaded(lm, None, block_size=4, num_kv_blocks=4, enable_prefix_caching=False)  # 16 tokens
    try:
        llm.engine.add_request(list(range(3, 3 + prompt_len)), greedy(max_tokens, ignore_eos=True))
        finished = _drive(llm.engine, 300)
    except (BlockspecError, RuntimeError) as e:  # an error naming the pool, at add_request or while stepping
        assert "pool" in str(e).lower() or "block" in str(e).lower(), e
        return
    pytest.fail("the request " + ("finished in a pool smaller than it needs" if finished
                                  else "neither finishes nor fails (livelock)"))


def test_pool_exactly_large_enough_for_one_request(tiny):
    """The smallest pool that holds one request (prompt + outputs + verify window) serves many, one at a time."""
    lm, draft = tiny
    prompts = [[7] * 30, [8] * 3, list(range(50, 70))]
    params = [greedy(10, ignore_eos=True)] * 3
    need = -(-(30 + 10 + 8) // 4)  # blocks of 4 tokens for the largest request and its K+1 verify window
    llm = LLM.from_loaded(lm, draft, block_size=4, num_kv_blocks=need, enable_prefix_caching=False,
                          max_num_batched_tokens=16)
    outs = Run(llm).run(prompts, params)
    assert_equal_plain(lm, prompts, params, outs)


def test_prompt_of_a_request_finishing_in_prefill_is_cached(tiny):
    lm, _ = tiny
    llm = LLM.from_loaded(lm, None, block_size=1)
    prompt = list(range(3, 40))
    llm.generate([prompt], greedy(1), use_tqdm=False)
    hits = llm.engine.blocks.prefix_hits
    out = llm.generate([prompt], greedy(4, ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == plain_ref(lm, prompt, greedy(4, ignore_eos=True))[0]
    assert llm.engine.blocks.prefix_hits - hits == len(prompt) - 1


def test_llm_generate_speculate_off(tiny):
    lm, draft = tiny
    prompts = [[5, 6, 7], list(range(10, 30))]
    params = greedy(12, ignore_eos=True)
    llm = LLM.from_loaded(lm, draft)
    off = llm.generate(prompts, params, use_tqdm=False, speculate=False)
    on = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in off] == [o.token_ids for o in on]
    assert all(o.acceptance_lengths == [] for o in off) and all(o.acceptance_lengths for o in on)
