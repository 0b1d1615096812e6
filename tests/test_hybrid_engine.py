"""Hybrid targets (Qwen3.5 / Qwen3.6: Gated DeltaNet + gated attention, dense and MoE) in the batched engine, fp32 on
the CPU: per-sequence recurrent state slots beside the paged KV, verify blocks rolled back by replay
(models/hybrid_state.py, engine/recurrent.py).

- Greedy DFlash, DFlash 2, n-gram and draft-model speculative decoding equal plain decoding (a model-level oracle,
  tests/hybrid_utils.plain_generate) token for token through the engine: staggered requests, preemption in a tiny
  KV pool, chunked prefill continuing from the slot, overlap on and off, the decode step, the varlen step and mixed
  steps split between them; steps that accept some but not all drafts (0 < n < K) really happen (trained pairs:
  tests/hybrid_utils.trained_hybrid_pair).
- Engine-level rollback: after every step of a speculative engine, every linear layer's conv window and delta-rule
  state in each request's slot equal those of plain decoding of the same committed tokens (within 1e-6).
- Sampled speculative decoding on a hybrid target passes tests/test_spec_sampling.py's distribution test.
- Plain decoding through `blockspec generate` and LLM(...); prefix caching off for hybrids in one stderr line; a
  hybrid draft model and tensor parallelism on a hybrid target refused in one line.
- On a GPU (skipped without one): the captured decode step == eager == the CPU engine, plain, DFlash and n-gram."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch

from blockspec.cli import main
from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.recurrent import PREFIX_CACHING_OFF
from blockspec.errors import ConfigError
from blockspec.llm import LLM
from blockspec.loading.draft_loader import load_draft
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.sampling import SamplingParams, processed_probs
from blockspec.speculative.dflash import DFlashProposer
from blockspec.speculative.draft_model import DraftModelProposer
from blockspec.speculative.ngram import NgramProposer
from dense_cache import DenseCausalAttention, DenseKVCache
from dflash_utils import make_zlab_draft
from engine_utils import Run, spec_consistency
from hybrid_utils import (
    CYCLE_C, CYCLE_D, FULL, LIN, PagedRunner, make_hf, plain_generate, save, trained_hybrid_pair,
)
from stats_utils import assert_fits
from trained_pair import cycle_seq

CPU = LoadConfig(device="cpu", with_tokenizer=False)


def workload(n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of the trained pairs' cycles from any offset (some with a random head, some random tokens) and, every
    other one, a cycle fragment, junk, then the fragment's start again: prompt lookup drafts the fragment and the
    junk, the target continues the cycle."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        cyc = (CYCLE_C, CYCLE_D)[i % 2]
        p = cycle_seq(cyc, rng.randrange(len(cyc)), [1, 2, 60][i] if i < 3 else rng.randint(1, 60))
        if i % 2 == 0:
            frag = cycle_seq(cyc, rng.randrange(len(cyc)), rng.randint(6, 12))
            p = frag + [rng.randrange(50, 60) for _ in range(rng.randint(1, 4))] + frag[:rng.randint(2, 4)]
        elif i % 5 == 3:
            p = [rng.randrange(60) for _ in range(rng.randint(1, 6))] + p
        elif i % 7 == 6:
            p = [rng.randrange(60) for _ in range(len(p))]
        prompts.append(p)
    return prompts, [SamplingParams(max_tokens=rng.randint(16, 40), ignore_eos=True) for _ in range(n)]


class SlotRun(Run):
    """Run, also checking the recurrent-state slots after every step: each running request holds its own slot,
    no waiting one holds any, and the free list is exactly the rest."""

    def step(self) -> None:
        super().step()
        sched = self.engine.scheduler
        held = [s.state_slot for s in sched.running]
        assert all(s >= 0 for s in held) and len(set(held)) == len(held), held
        assert all(s.state_slot == -1 for s in sched.waiting)
        assert sorted(held + sched.state_slots.free) == list(range(sched.state_slots.num_slots))


METHODS = ["dflash", "dflash2", "ngram", "draft-model"]
# name -> (engine config, stagger)
SCENARIOS = {
    "staggered": (dict(max_num_seqs=5, block_size=4, overlap=True), 1),
    "varlen": (dict(max_num_seqs=5, block_size=4, step_path="varlen", overlap=False), 2),
    "no_overlap": (dict(max_num_seqs=4, block_size=8, overlap=False), None),
    "split_mixed": (dict(max_num_seqs=6, block_size=4, split_mixed_steps=True, overlap=True), 1),
    "chunked_prefill": (dict(max_num_seqs=4, block_size=4, max_num_batched_tokens=12, overlap=True), 2),
    "preemption": (dict(max_num_seqs=8, block_size=2, overlap=True), None),  # num_kv_blocks set below
    "context_end": (dict(max_num_seqs=4, block_size=4, max_model_len=40, overlap=True), 2),  # drafts clipped
}


def proposer(pair, method: str):
    makers = {"dflash": lambda: DFlashProposer(pair.draft), "dflash2": lambda: DFlashProposer(pair.draft2),
              "ngram": lambda: NgramProposer(7, 3), "draft-model": lambda: DraftModelProposer(pair.draft_model, 4)}
    return makers[method]()


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def pair(request):
    return trained_hybrid_pair(request.param)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("method", METHODS)
def test_greedy_speculation_equals_plain_decoding(pair, method, scenario):
    prompts, params = workload(12, seed=1)
    engine, stagger = SCENARIOS[scenario]
    prop = proposer(pair, method)
    K = prop.num_draft_tokens
    if scenario == "preemption":  # room for the largest request and a half: the newest are preempted, recomputed
        need = max(-(-(len(p) + sp.max_tokens + K + 1) // 2) + 1 for p, sp in zip(prompts, params))
        engine = {**engine, "num_kv_blocks": int(need * 1.5)}
    if scenario == "context_end":  # the prompts' ends within K of the context's: fewer drafts, then none
        prompts = [p[-30:] for p in prompts]
        params = [SamplingParams(max_tokens=40, ignore_eos=True) for _ in prompts]
    llm = LLM.from_loaded(pair.lm, prop, engine=EngineConfig(**engine))
    e = llm.engine
    assert not e.config.enable_prefix_caching
    outs = SlotRun(llm).run(prompts, params, stagger=stagger)
    for i, (p, sp, o) in enumerate(zip(prompts, params, outs)):
        if scenario == "context_end":  # the engine's context is 40 tokens
            sp = SamplingParams(max_tokens=40 - len(p), ignore_eos=True)
        assert (o.token_ids, o.finish_reason) == plain_generate(pair.lm, p, sp), f"request {i}: spec != plain"
    spec_consistency(outs)
    assert e.scheduler.state_slots.num_free == e.config.max_num_seqs  # every slot given back
    stats = e.stats()
    steps = [st for o in outs for st in o.steps if st.draft]
    assert steps and any(st.num_accepted > 0 for st in steps)
    if method != "draft-model":  # drafts rolled back after some but not all of them were accepted
        assert any(0 < st.num_accepted < len(st.draft) for st in steps), scenario
    if scenario == "varlen":
        assert stats.num_decode_steps == 0 and stats.num_overlapped_steps == 0
    else:
        assert stats.num_decode_steps > 0 and stats.num_varlen_steps > 0
        if not engine["overlap"]:
            assert stats.num_overlapped_steps == 0
        elif scenario not in ("preemption", "context_end"):  # no room to chain; K' differing per request
            assert stats.num_overlapped_steps > 0, stats
    if scenario == "preemption":
        assert e.scheduler.num_preemptions > 0 and any(o.num_preemptions for o in outs)
    if scenario == "context_end":
        assert any(0 < len(st.draft) < K for st in steps)


# ---- the state itself: rollback at the engine level ------------------------------------------------------------


@pytest.mark.parametrize("step_path", ["auto", "varlen"])
def test_engine_state_after_each_step_is_plain_decoding_state(step_path):
    """After every step of a DFlash engine (verify K + 1 rows, accept n: the state rolled back by replay), each
    running request's slot holds, in every linear layer, the conv window and delta-rule state of plain decoding of
    its committed tokens (the prompt in one forward, then one row at a time), within 1e-6 of the state's scale (the
    projections round a K + 1-row block and a 1-row step apart by an ulp; the replay itself is exact:
    tests/test_qwen3_5.py)."""
    pair = trained_hybrid_pair(False)
    lm = pair.lm
    llm = LLM.from_loaded(lm, pair.draft, engine=EngineConfig(max_num_seqs=4, block_size=4, overlap=False,
                                                              step_path=step_path))
    eng = llm.engine
    state = eng.models.state
    prompts, _ = workload(4, seed=3)
    ids = [eng.add_request(p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in prompts]
    refs = {rid: (PagedRunner(lm.model, 1, 128), [0]) for rid in ids}  # the reference and how many tokens it has
    partial = compared = 0
    worst = 0.0
    while eng.has_unfinished():
        eng.step()
        for rid, prompt in zip(ids, prompts):
            seq = eng.seqs.get(rid)
            if seq is None or seq.finished or seq.in_prefill:
                continue
            runner, fed = refs[rid]
            tokens = seq.tokens[:seq.num_computed]  # what the target has absorbed: prompt, bonuses, accepted drafts
            if fed[0] == 0:
                runner.forward([(0, tokens[:len(prompt)])])
                fed[0] = len(prompt)
            for t in tokens[fed[0]:]:
                runner.forward([(0, [t])])
            fed[0] = len(tokens)
            for live, ref in ((state.conv[:, seq.state_slot], runner.state.conv[:, 0]),
                              (state.ssm[:, seq.state_slot], runner.state.ssm[:, 0])):
                err = (live - ref).abs().max().item() / max(1.0, ref.abs().max().item())
                worst = max(worst, err)
                assert err <= 1e-6, (rid, seq.num_computed, err)
            compared += 1
            last = seq.trace[-1] if seq.trace else None
            partial += last is not None and 0 < last.num_accepted < len(last.draft)
    assert compared > 20 and partial > 0, (compared, partial)


def test_state_memory_is_reported():
    pair = trained_hybrid_pair(False)
    eng = LLM.from_loaded(pair.lm, pair.draft, engine=EngineConfig(max_num_seqs=3)).engine
    shape, K = pair.lm.model.recurrent_shape(), pair.draft.spec.num_draft_tokens
    want = 4 * shape.bytes_per_slot(torch.float32) + 3 * (K + 1) * shape.bytes_per_kept_row(torch.float32)
    assert eng.limits().recurrent_state_bytes == want == eng.models.state.nbytes()
    assert eng.pool.k.shape[0] == pair.lm.model.num_kv_layers == 1  # the pool: full-attention layers only
    plain = LLM.from_loaded(pair.lm, None, engine=EngineConfig(max_num_seqs=3)).engine
    assert plain.models.state.x_rows.numel() == 0  # no verify blocks, no replay scratch


# ---- sampled speculative decoding: the target's own distribution -------------------------------------------------

V, MASK, PROMPT, N_TOKENS, N_SAMPLES = 8, 6, [1, 3, 5], 3, 1500
SAMPLED = dict(temperature=0.9, top_k=6, top_p=0.9)


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    """A tiny hybrid target over 8 tokens with a peaked head (drafts get accepted) and a random DFlash drafter
    tapping a linear (1) and the full-attention (3) layer, argmax and probabilistic."""
    root = tmp_path_factory.mktemp("hybrid_sampling")
    hf = make_hf(4, vocab_size=V)
    with torch.no_grad():
        hf.lm_head.weight.mul_(6.0)
    save(hf, root / "target")
    # seeds chosen so that drafts are accepted in many steps
    make_zlab_draft(hf.config, root / "draft", layers=1, block_size=4, target_layer_ids=[1, 3], mask_token_id=MASK,
                    seed=1)
    lm = load_model(str(root / "target"), CPU)
    drafts = {p: load_draft(SpeculativeConfig(draft_model=str(root / "draft"), num_draft_tokens=3,
                                              probabilistic_drafting=p), lm) for p in (False, True)}
    return lm, drafts


def exact_joint(lm, n: int) -> dict[tuple[int, ...], float]:
    """P(first n generated tokens) by enumeration: every prefix's next-token distribution from a whole-sequence
    forward (state=None: one sequence from position 0)."""
    cfg = lm.config
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for prefix, pr in joint.items():
            seq, pos = PROMPT + list(prefix), torch.arange(len(PROMPT) + len(prefix))
            cache = DenseKVCache.allocate(lm.model.num_kv_layers, len(seq), cfg.num_key_value_heads, cfg.head_dim,
                                          torch.float32, torch.device("cpu"))
            with torch.no_grad():
                logits = lm.model(torch.tensor(seq), pos, DenseCausalAttention(cache, pos, len(seq)),
                                  logit_rows=torch.tensor([len(seq) - 1])).logits
            probs = processed_probs(logits, **SAMPLED)[0].double()
            nxt.update((prefix + (t,), pr * float(probs[t])) for t in range(V) if probs[t] > 0)
        joint = nxt
    return joint


@pytest.mark.parametrize("probabilistic", [False, True], ids=["argmax_drafts", "probabilistic_drafts"])
def test_sampled_speculation_matches_the_target_distribution(peaked, probabilistic):
    lm, drafts = peaked
    llm = LLM.from_loaded(lm, drafts[probabilistic], engine=EngineConfig(max_num_seqs=64))
    params = [SamplingParams(seed=i, max_tokens=N_TOKENS, ignore_eos=True, **SAMPLED) for i in range(N_SAMPLES)]
    outs = llm.generate([PROMPT] * N_SAMPLES, params, use_tqdm=False)
    counts = Counter(tuple(o.token_ids) for o in outs)
    accepted = Counter(st.num_accepted for o in outs for st in o.steps)
    steps = sum(accepted.values())
    # acceptance is exercised: drafts accepted in many steps, runs of two or more in some (the state rolled back
    # after 0, 1, 2 and 3 accepted drafts)
    assert steps - accepted[0] > 0.12 * steps and accepted[2] + accepted[3] > 0.02 * steps, accepted
    assert all(accepted[n] for n in range(4)), accepted
    assert_fits(counts, exact_joint(lm, N_TOKENS), f"hybrid spec sampling, probabilistic={probabilistic}")


# ---- plain decoding through the commands; refusals --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save(make_hf(0), tmp_path_factory.mktemp("hybrid_cli") / "m")


def test_generate_and_llm_plain_decoding(tiny_dir, capfd):
    """`blockspec generate --model <hybrid>` and LLM(<hybrid>) decode as the model-level oracle and as transformers'
    greedy generate; the engine says once that prefix caching is off."""
    lm = load_model(str(tiny_dir), CPU)
    prompt, sp = [4, 5, 6, 7], SamplingParams(max_tokens=12)
    want, _ = plain_generate(lm, prompt, sp)
    hf = make_hf(0)
    hf_ids = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=2,
                         pad_token_id=0)[0, len(prompt):].tolist()
    assert want == hf_ids
    capfd.readouterr()
    assert main(["generate", "--model", str(tiny_dir), "--prompt-ids", "4,5,6,7", "--max-tokens", "12",
                 "--json"]) == 0
    out = capfd.readouterr()
    assert json.loads(out.out)["token_ids"] == want
    assert [l for l in out.err.splitlines() if "prefix caching" in l] == [PREFIX_CACHING_OFF]
    llm = LLM(str(tiny_dir), load=CPU, engine=EngineConfig(max_num_seqs=2))
    got = llm.generate([prompt, prompt[:2]], sp, use_tqdm=False)
    assert got[0].token_ids == want and got[1].token_ids == plain_generate(lm, prompt[:2], sp)[0]


def test_hybrid_draft_model_and_tensor_parallelism_are_refused(tiny_dir):
    lm = load_model(str(tiny_dir), CPU)
    with pytest.raises(ConfigError, match="a hybrid model .* is not supported as a draft model") as e:
        DraftModelProposer(lm, 4)
    assert "\n" not in str(e.value) and e.value.field == "draft_model"
    with pytest.raises(ConfigError, match="tensor parallelism does not support hybrid targets") as e:
        LLM.from_loaded(lm, None, engine=EngineConfig(tensor_parallel_size=2))
    assert e.value.field == "tensor_parallel_size"


def test_layer_pattern_of_its_own(tmp_path):
    """A hybrid whose first layer is full attention and whose last is linear, DFlash drafting from both kinds:
    greedy speculative output equals plain through both step paths (a random drafter: the state is rolled back at
    almost every step)."""
    hf = make_hf(6, num_hidden_layers=5, layer_types=[FULL, LIN, LIN, FULL, LIN], linear_conv_kernel_dim=2)
    save(hf, tmp_path / "t")
    make_zlab_draft(hf.config, tmp_path / "d", block_size=4, target_layer_ids=[0, 2, 4], seed=2)
    lm = load_model(str(tmp_path / "t"), CPU)
    draft = load_draft(SpeculativeConfig(draft_model=str(tmp_path / "d")), lm)
    g = random.Random(0)
    prompts = [[g.randrange(3, 128) for _ in range(n)] for n in (1, 9, 23, 40)]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    for path in ("auto", "varlen"):
        llm = LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=3, block_size=4, step_path=path))
        outs = SlotRun(llm).run(prompts, sp, stagger=1)
        assert [o.token_ids for o in outs] == [plain_generate(lm, p, sp)[0] for p in prompts], path


# ---- CUDA: the hybrid step inside the captured decode step ------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["plain", "dflash", "ngram"])
def test_gpu_captured_equals_eager_equals_cpu(method):
    """The trained dense pair in fp32 on CUDA (torch reference of the delta rule, Triton attention): tokens of the
    captured decode step (its warm-up must not advance the state twice) == enforce_eager == the CPU engine."""
    pair = trained_hybrid_pair(False)
    gpu = load_model(str(pair.lm.source.path), LoadConfig(device="cuda", dtype="float32", with_tokenizer=False))

    def make(lm):
        if method == "dflash":
            return load_draft(SpeculativeConfig(draft_model=str(pair.draft.source)), lm)
        return NgramProposer(7, 3) if method == "ngram" else None

    prompts, params = workload(10, seed=2)
    runs = {}
    for name, lm, extra in (("cpu", pair.lm, {}), ("captured", gpu, {}), ("eager", gpu, dict(enforce_eager=True))):
        llm = LLM.from_loaded(lm, make(lm), engine=EngineConfig(max_num_seqs=8, block_size=8, **extra))
        runs[name] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if name == "captured":
            assert llm.engine.stats().cuda_graphs and llm.engine.stats().num_overlapped_steps > 0
    assert runs["captured"] == runs["eager"] == runs["cpu"]
    assert runs["cpu"] == [plain_generate(pair.lm, p, sp)[0] for p, sp in zip(prompts, params)]
