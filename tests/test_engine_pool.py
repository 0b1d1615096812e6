"""The batched engine's pool and policies, in fp32 on CPU with tiny models: the pool's bytes per token follow
2 x (L_t*kvh_t*hd_t + L_d*kvh_d*hd_d) x dtype bytes and nothing scales with max_num_seqs x max_model_len;
draft_len_schedule shortens drafts at large batch and speculate=False requests decode plainly, outputs unchanged;
pool-size errors; waiting requests with prefix hits do not block running ones.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from blockspec.config import EngineConfig
from blockspec.engine.decode_step import DecodeStep
from blockspec.errors import BlockspecError
from blockspec.kv.pool import CacheShape, KVPool
from blockspec.llm import LLM

from engine_utils import (
    Run, assert_equal_plain, assert_pool_empty, check_block_accounting, cycle_workload, greedy,
    plain_ref, spec_consistency,
)
from engine_utils import tiny, trained  # noqa: F401 - fixtures, used by name

# --------------------------------------------------------------------------------------------------------------
# 1. memory


def test_pool_bytes_per_token_formula(tiny):
    lm, draft = tiny
    t, d = lm.config, draft.config
    expected = 2 * (t.num_hidden_layers * t.num_key_value_heads * t.head_dim
                    + d.num_hidden_layers * d.num_key_value_heads * d.head_dim) * 4
    assert expected == 2 * (2 * 2 * 8 + 2 * 2 * 16) * 4  # the tiny shapes, written out
    for bs, n in [(1, 37), (3, 11), (16, 5)]:
        llm = LLM.from_loaded(lm, draft, engine=EngineConfig(block_size=bs, num_kv_blocks=n))
        pool = llm.engine.pool
        assert KVPool.bytes_per_token(pool.target_shape, pool.draft_shape, torch.float32) == expected
        assert pool.nbytes() == n * bs * expected
        assert pool.k.shape == (2, n * bs, 2, 8) and pool.draft_k.shape == (2, n * bs, 2, 16)
        plain = LLM.from_loaded(lm, None, engine=EngineConfig(block_size=bs, num_kv_blocks=n)).engine.pool
        assert plain.draft_k is None
        assert plain.nbytes() == n * bs * 2 * (2 * 2 * 8) * 4
    # other dtypes: element size enters linearly
    ts, ds = CacheShape(36, 8, 128), CacheShape(5, 8, 128)
    assert KVPool.bytes_per_token(ts, ds, torch.bfloat16) == 2 * (36 * 8 * 128 + 5 * 8 * 128) * 2
    assert KVPool.bytes_per_token(ts, None, torch.float16) == 2 * 36 * 8 * 128 * 2
    bf = KVPool(3, 16, CacheShape(2, 2, 8), CacheShape(1, 2, 16), torch.bfloat16, torch.device("cpu"))
    assert bf.nbytes() == 3 * 16 * KVPool.bytes_per_token(bf.target_shape, bf.draft_shape, torch.bfloat16)
    # a bf16 draft context under an fp32 target (cpu_bf16_draft): each part at its own element size
    assert KVPool.bytes_per_token(ts, ds, torch.float32, torch.bfloat16) == 2 * (36 * 8 * 128 * 4 + 5 * 8 * 128 * 2)
    mixed = KVPool(3, 16, CacheShape(2, 2, 8), CacheShape(1, 2, 16), torch.float32, torch.device("cpu"), torch.bfloat16)
    assert mixed.k.dtype == torch.float32 and mixed.draft_k.dtype == mixed.draft_v.dtype == torch.bfloat16
    assert mixed.nbytes() == 3 * 16 * KVPool.bytes_per_token(mixed.target_shape, mixed.draft_shape, torch.float32,
                                                             torch.bfloat16)


def _engine_tensor_bytes(engine) -> int:
    """Bytes of every tensor the engine owns besides the models' own weights and buffers (pool, runner, scheduler,
    block manager, sequences): found by walking attributes, lists, dicts."""
    model_tensors = {id(t) for m in (engine.lm.model, engine.proposer.draft.model if engine.proposer else None) if m is not None
                     for t in list(m.parameters()) + list(m.buffers())}
    seen, total, stack = set(), 0, [v for k, v in vars(engine).items() if k not in ("lm", "proposer")]
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
            stack += [v for k, v in vars(x).items() if k not in ("lm", "proposer")]
    return total


def test_memory_does_not_scale_with_max_num_seqs_times_max_model_len(tiny):
    lm, draft = tiny
    sizes = []
    for max_num_seqs in (1, 8, 256):
        llm = LLM.from_loaded(lm, draft,
                              engine=EngineConfig(block_size=16, num_kv_blocks=40, max_num_seqs=max_num_seqs))
        before = _engine_tensor_bytes(llm.engine)
        assert before == llm.engine.pool.nbytes()  # the pool is the only engine-owned tensor storage
        llm.generate([[5, 6, 7], [9] * 40], greedy(6), use_tqdm=False)
        sizes.append((llm.engine.pool.nbytes(), _engine_tensor_bytes(llm.engine)))
    assert sizes[0] == sizes[1] == sizes[2] == (40 * 16 * llm.engine.pool.bytes_per_token(
        llm.engine.pool.target_shape, llm.engine.pool.draft_shape, torch.float32),) * 2
    # the same with max_model_len: a longer context does not grow a fixed pool either
    a = LLM.from_loaded(lm, draft, engine=EngineConfig(num_kv_blocks=40, max_model_len=64)).engine.pool.nbytes()
    b = LLM.from_loaded(lm, draft, engine=EngineConfig(num_kv_blocks=40, max_model_len=512)).engine.pool.nbytes()
    assert a == b
    # without num_kv_blocks the pool is sized by tokens (capped), never max_num_seqs x max_model_len x something else
    llm = LLM.from_loaded(lm, draft, engine=EngineConfig(block_size=16, max_num_seqs=4, max_model_len=100))
    assert llm.engine.pool.num_blocks == -(-(4 * 100) // 16)
    llm = LLM.from_loaded(lm, draft, engine=EngineConfig(block_size=16, max_num_seqs=10**6, kv_cache_tokens=4096))
    assert llm.engine.pool.num_blocks == 4096 // 16


# --------------------------------------------------------------------------------------------------------------
# 2. draft_len_schedule and speculate=False


@pytest.mark.parametrize("schedule", [{1: 7, 4: 2}, {1: 7, 4: 0}])
def test_draft_len_schedule(trained, schedule):
    lm, draft = trained
    K = draft.spec.num_draft_tokens
    prompts, _ = cycle_workload(8, seed=4, max_len=40)
    params = [greedy(12 + 6 * i, ignore_eos=True) for i in range(8)]  # the batch shrinks as requests finish
    llm = LLM.from_loaded(lm, draft,
                          engine=EngineConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=512,
                                              draft_len_schedule=schedule))
    engine = llm.engine
    run = Run(llm)
    ids = [run.add(p, sp) for p, sp in zip(prompts, params)]
    seen_k = Counter()
    schedule_step, steps = engine.scheduler.schedule, []

    def scheduling():  # the scheduler decides K' (the next drafts) for the batch it schedules (admissions included)
        out = schedule_step()
        steps.append((len(engine.scheduler.running), out))
        return out

    engine.scheduler.schedule = scheduling
    while engine.has_unfinished():
        steps.clear()
        run.step()
        for batch, scheduled in steps:
            want = min(K, schedule[max(k for k in schedule if k <= batch)])
            for s in scheduled:
                if not s.is_prefill or s.next_k:
                    assert s.next_k == want, (batch, s.next_k)
                    seen_k[want] += 1
                    # the step proposed them: a request still decoding carries exactly K' drafts
                    assert s.seq.finished or s.seq.drafts.k == want, (batch, s.seq.drafts)
    outs = [run.final[i] for i in ids]
    assert_equal_plain(lm, prompts, params, outs)
    spec_consistency(outs)
    small = schedule[4]
    assert seen_k[small] > 0 and seen_k[7] > 0
    # the traces: all 8 ran together at first, so every request's first verify used the short block
    for o in outs:
        assert len(o.steps[0].draft) == small
        assert {len(st.draft) for st in o.steps} <= {small, 7}
    longest = outs[-1]
    assert len(longest.steps[-1].draft) == 7  # alone at the end: the full block again
    if small == 0:
        assert all(a == 1 for o in outs for a, st in zip(o.acceptance_lengths, o.steps) if not st.draft)


def test_speculate_false_request_decodes_plainly(trained):
    lm, draft = trained
    prompts, params = cycle_workload(6, seed=5, max_len=50)
    llm = LLM.from_loaded(lm, draft, engine=EngineConfig(block_size=4, max_num_batched_tokens=64))
    spec_flags = [True, False, True, False, True, True]
    outs = Run(llm).run(prompts, params, stagger=2, speculate=spec_flags)
    assert_equal_plain(lm, prompts, params, outs)
    for o, flag in zip(outs, spec_flags):
        if flag:
            assert o.acceptance_lengths and max(o.acceptance_lengths) > 1
        else:
            assert all(a == 1 for a in o.acceptance_lengths)
            assert all(not st.draft for st in (o.steps or []))


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
    llm = LLM.from_loaded(lm, None,
                          engine=EngineConfig(block_size=1, num_kv_blocks=40, max_num_seqs=2,
                                              enable_prefix_caching=prefix_caching))
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
    llm = LLM.from_loaded(lm, None,
                          engine=EngineConfig(block_size=4, num_kv_blocks=4, enable_prefix_caching=False))  # 16 tokens
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
    llm = LLM.from_loaded(lm, draft,
                          engine=EngineConfig(block_size=4, num_kv_blocks=need, enable_prefix_caching=False,
                                              max_num_batched_tokens=16))
    outs = Run(llm).run(prompts, params)
    assert_equal_plain(lm, prompts, params, outs)


def test_prompt_of_a_request_finishing_in_prefill_is_cached(tiny):
    lm, _ = tiny
    llm = LLM.from_loaded(lm, None, engine=EngineConfig(block_size=1))
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


def test_a_decode_left_without_budget_keeps_its_drafts(tiny):
    """The token budget runs out inside the running decodes: a request that still fits part of its block verifies
    fewer drafts, and one that gets no rows this step keeps all its drafts for the next."""
    lm, draft = tiny
    llm = LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=3, max_num_batched_tokens=64))
    for p in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        llm.engine.add_request(p, greedy(20, ignore_eos=True))
    while any(s.in_prefill or not s.drafts.k for s in llm.engine.scheduler.running) or not llm.engine.scheduler.running:
        llm.engine.step()
    sched = llm.engine.scheduler
    K = sched.running[0].drafts.k
    sched.max_num_batched_tokens = K + 1 + 2  # the first decode whole, 2 rows of the second, none for the third
    scheduled = sched.schedule()
    assert [s.num_rows for s in scheduled] == [K + 1, 2]
    assert [s.k for s in scheduled] == [K, 1]  # a prefix of its drafts: the rest stay with the request
    assert [s.drafts.k for s in sorted(sched.running, key=lambda s: s.arrival)] == [K, K, K]
