"""gpt-oss and Gemma 4 targets in the batched engine (issue 53), fp32 on the CPU, on tiny targets of each family that
transformers builds and that learned tests/trained_pair.py's token cycles (tests/new_targets_utils.py: gpt-oss with
sinks, windows of 3 and routed experts; Gemma 4 with sliding / global layers, K/V shared between layers, per-layer
inputs, soft-capped logits and routed experts; prompts up to 60 tokens, far longer than the windows).

- Plain greedy decoding through the engine equals transformers' (a full forward per token, no cache); the KV pool has
  the target's own shape (Gemma 4: one cache per layer computing K/V, rows of the widest layer).
- Greedy n-gram and DFlash speculative decoding equal it token for token: staggered requests, the decode step and the
  varlen step, overlap on and off, chunked prefill; steps that accept some but not all drafts (0 < n < K) happen.
- Seeded sampling with argmax drafts equals plain seeded sampling (every emitted token is the target's own sample
  at its position, from its soft-capped logits on Gemma 4: the verify forward applies the cap).
- The Triton target attention (interpreter on the CPU) honours windows, sinks and shared K/V: logits equal
  transformers', and the engine on it decodes as transformers does.
- On CUDA their grouped experts run eagerly (the platform plan says why, the engine picks enforce_eager); tensor
  parallelism and drafting with them as classic draft models are refused in one line naming the field, as are
  drafters whose layer ids fall outside the target."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from blockspec.attention.backends import InvariantTargetAttention, TritonTargetAttention
from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.llm_engine import LLMEngine
from blockspec.errors import ConfigError
from blockspec.llm import LLM
from blockspec.loading.capabilities import graph_refusal, sharding_refusal
from blockspec.loading.draft_loader import load_draft
from blockspec.loading.loader import load_model
from blockspec.loading.platform import PlatformPlan
from blockspec.loading.platform_report import summary
from blockspec.sampling import SamplingParams
from blockspec.speculative.dflash import DFlashProposer
from blockspec.speculative.draft_model import DraftModelProposer
from blockspec.speculative.ngram import NgramProposer
from dflash_utils import make_zlab_draft
from engine_utils import Run, cycle_workload, spec_consistency
from new_targets_utils import CAP, CPU, FAMILIES, hf_greedy, trained_pair
from paged_utils import assert_matches
from trained_pair import CYCLE_A, CYCLE_B, cycle_seq


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # tiny matmuls: a second thread only adds synchronisation (and much of it on a busy machine)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request):
    return trained_pair(request.param)


def workload(n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Cycle prompts (some with a random head, a few random: engine_utils.cycle_workload) and, every other one, a
    cycle fragment, junk, then the fragment's start again: prompt lookup drafts the rest of the fragment and then the
    junk, which the target does not follow (it continues the cycle): drafts accepted in part."""
    prompts, params = cycle_workload(n, seed, max_len=60, max_tokens=(16, 40))
    rng = random.Random(seed)
    for i in range(0, n, 2):
        frag = cycle_seq((CYCLE_A, CYCLE_B)[i % 2], rng.randrange(20), rng.randint(6, 12))
        prompts[i] = frag + [rng.randrange(50, 60) for _ in range(rng.randint(1, 4))] + frag[:rng.randint(2, 4)]
    return prompts, params


def assert_transformers_greedy(pair, prompts, params, outs) -> None:
    for i, (p, sp, o) in enumerate(zip(prompts, params, outs)):
        assert o.token_ids == hf_greedy(pair.hf, p, sp.max_tokens), f"request {i} (prompt {len(p)} tokens)"
        assert o.finish_reason == "length"


def test_plain_decoding_equals_transformers(pair):
    prompts, params = workload(10, seed=0)
    llm = LLM.from_loaded(pair.lm, None, engine=EngineConfig(max_num_seqs=4, block_size=4, overlap=True))
    shape = llm.engine.pool.target_shape
    assert shape == pair.lm.model.kv_cache_shape()
    if "Gemma4" in pair.lm.config.architecture:  # the last two layers read the caches of the two before them
        assert (shape.num_layers, shape.head_dim) == (2, 32) and pair.lm.config.num_hidden_layers == 4
    run = Run(llm)
    assert_transformers_greedy(pair, prompts, params, run.run(prompts, params, stagger=1))
    assert run.max_running >= 3


# name -> (engine config, requests added after each step; None: all before the first)
SCENARIOS = {
    "staggered": (dict(max_num_seqs=5, block_size=4, overlap=True), 1),
    "varlen": (dict(max_num_seqs=5, block_size=4, step_path="varlen", overlap=False), 2),
    "no_overlap": (dict(max_num_seqs=4, block_size=8, overlap=False), None),
    "chunked_prefill": (dict(max_num_seqs=4, block_size=4, max_num_batched_tokens=12, overlap=True), 2),
}
METHODS = {"ngram": lambda pair: NgramProposer(7, 3), "dflash": lambda pair: DFlashProposer(pair.draft)}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_speculation_equals_plain_decoding(pair, method, scenario):
    prompts, params = workload(12, seed=1)
    engine, stagger = SCENARIOS[scenario]
    llm = LLM.from_loaded(pair.lm, METHODS[method](pair), engine=EngineConfig(**engine))
    outs = Run(llm).run(prompts, params, stagger=stagger)
    assert_transformers_greedy(pair, prompts, params, outs)
    spec_consistency(outs)
    steps = [st for o in outs for st in o.steps if st.draft]
    assert any(st.num_accepted == len(st.draft) for st in steps), "no block accepted whole"
    assert any(0 < st.num_accepted < len(st.draft) for st in steps), "no block accepted in part"
    stats = llm.engine.stats()
    if scenario == "varlen":
        assert stats.num_decode_steps == 0 and stats.num_overlapped_steps == 0
    else:
        assert stats.num_decode_steps > 0 and stats.num_varlen_steps > 0
        assert (stats.num_overlapped_steps > 0) == engine["overlap"], stats


def test_sliding_scaled_drafter_is_lossless(pair, tmp_path):
    """A random drafter of the Gemma 4 kind (a sliding-window draft layer, a scaled input embedding, a logit cap)
    through both step paths: greedy output is the target's whatever it drafts."""
    make_zlab_draft(pair.hf.config, tmp_path / "d", block_size=6, target_layer_ids=[1, 3], mask_token_id=63,
                    scale=3.0, layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                    input_embedding_scale=8.0, final_logit_softcapping=5.0)
    draft = load_draft(SpeculativeConfig(draft_model=str(tmp_path / "d")), pair.lm)
    assert draft.model.layers[0].self_attn.window == 4 and draft.config.input_embedding_scale == 8.0
    prompts, params = workload(6, seed=2)
    for path in ("auto", "varlen"):
        llm = LLM.from_loaded(pair.lm, draft, engine=EngineConfig(max_num_seqs=3, block_size=4, step_path=path))
        assert_transformers_greedy(pair, prompts, params, Run(llm).run(prompts, params, stagger=1))


def test_seeded_sampling_with_argmax_drafts_equals_plain(pair):
    """Each emitted token is the target's own seeded sample at its position (argmax drafts are accepted where they
    equal it), so speculative sampling gives plain sampling's tokens; on Gemma 4 those come from the soft-capped
    logits of the verify forward, and the cap bites."""
    prompts, _ = workload(8, seed=4)
    params = [SamplingParams(temperature=1.0, top_k=5, top_p=0.95, seed=100 + i, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]
    spec = LLM.from_loaded(pair.lm, DFlashProposer(pair.draft), engine=EngineConfig(max_num_seqs=4, block_size=4))
    plain = LLM.from_loaded(pair.lm, None, engine=EngineConfig(max_num_seqs=4, block_size=4))
    got, want = (llm.generate(prompts, params, use_tqdm=False) for llm in (spec, plain))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert any(a > 1 for o in got for a in o.acceptance_lengths), "no draft accepted under sampling"
    if "Gemma4" in pair.lm.config.architecture:
        pos = torch.arange(len(prompts[1]))
        with torch.no_grad():
            out = pair.lm.model(torch.tensor(prompts[1]), pos, _dense_attention(pair.lm, pos))
            raw = pair.lm.model.lm_head(out.hidden)
        assert out.logits.abs().max() <= CAP < raw.abs().max()


def _dense_attention(lm, pos: torch.Tensor):
    """The paged reference over a pool of one sequence in one block run (a whole-prompt forward)."""
    from blockspec.attention.paged_ref import PagedBatch, PagedTargetAttention
    from blockspec.kv.pool import KVPool

    n = len(pos)
    pool = KVPool(1, n, lm.model.kv_cache_shape(), None, torch.float32, torch.device("cpu"))
    batch = PagedBatch(pos, pos.clone(), torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                       torch.zeros(1, 1, dtype=torch.long), n, n)
    return PagedTargetAttention(pool, batch)


def test_quantized_target_on_the_rowwise_attention(pair):
    """A quantized CPU target (cpu_quant auto: bf16-rounded activations) runs the row-wise reference attention, each
    verify row computed as a one-row step with its window and sinks: speculative output equals plain decoding of the
    same quantized target token for token."""
    lm = load_model(str(pair.root / "target"), dataclasses.replace(CPU, cpu_quant="auto"))
    if lm.plan.cpu_quant == "off":
        pytest.skip("no quantized kernel on this CPU")
    assert lm.plan.attention == "rowwise"
    draft = load_draft(SpeculativeConfig(draft_model=str(pair.root / "draft")), lm)  # random weights
    prompts, _ = workload(4, seed=3)
    params = [SamplingParams(max_tokens=16, ignore_eos=True)] * len(prompts)
    engine = EngineConfig(max_num_seqs=3, block_size=4)
    want = [o.token_ids for o in LLM.from_loaded(lm, None, engine=engine).generate(prompts, params, use_tqdm=False)]
    for proposer in (NgramProposer(7, 3), DFlashProposer(draft)):
        outs = Run(LLM.from_loaded(lm, proposer, engine=engine)).run(prompts, params, stagger=1)
        assert [o.token_ids for o in outs] == want, proposer.name


# ---- the Triton target attention (interpreter on the CPU) ---------------------------------------------------------


def test_triton_target_attention_honours_windows_sinks_and_shared_kv(pair):
    """attention/backends.py's Triton target attention (and its batch-invariant mode) given each layer's window and
    sinks, storing nothing for layers that share K/V: the logits and taps of transformers."""
    pytest.importorskip("triton")
    ids = [torch.tensor(cycle_seq(CYCLE_A, 2, 14)), torch.tensor([50, 51] + cycle_seq(CYCLE_B, 5, 5))]
    for attention in (TritonTargetAttention, InvariantTargetAttention):
        assert_matches(pair.lm, pair.hf, ids, [10, 1], attention=attention)


def test_engine_on_the_triton_backend_decodes_as_transformers(pair):
    pytest.importorskip("triton")
    prompts = [cycle_seq(CYCLE_A, 3, 12), [50, 51, 52] + cycle_seq(CYCLE_B, 7, 6)]
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    llm = LLM.from_loaded(pair.lm, DFlashProposer(pair.draft),
                          engine=EngineConfig(max_num_seqs=2, block_size=4, attention_backend="triton"))
    assert_transformers_greedy(pair, prompts, [sp] * 2, llm.generate(prompts, sp, use_tqdm=False))


# ---- CUDA graphs, tensor parallelism, bad configs ----------------------------------------------------------------


def test_grouped_experts_run_eagerly_on_cuda(pair):
    """The platform plan of a CUDA target with grouped experts turns CUDA graphs off and says why; the engine then
    runs eagerly (enforce_eager) instead of failing inside the capture. CPU plans are left alone."""
    model = pair.lm.model
    why = graph_refusal(model)
    assert why is not None and "grouped path" in why
    plan = PlatformPlan(device="cuda").with_graphs(model)
    assert not plan.cuda_graphs and plan.reasons == (f"CUDA graphs off: {why}",)
    assert summary(plan).endswith(", eager (no CUDA graphs)")
    assert PlatformPlan().with_graphs(model) == PlatformPlan()
    engine = LLMEngine(dataclasses.replace(pair.lm, plan=plan), None, EngineConfig(max_num_seqs=2))
    assert engine.config.enforce_eager


def test_shared_decoder_families_keep_graphs_and_sharding(tmp_path):
    """A dense llama and a Qwen3-MoE whose experts are stacked for the fused kernel (as on CUDA) are captured and
    sharded as before."""
    pytest.importorskip("triton")
    from hf_utils import make_hf_model, save_hf_model
    from moe_utils import make_hf_moe

    save_hf_model(make_hf_model("llama", seed=0), tmp_path / "llama")
    make_hf_moe(0).save_pretrained(str(tmp_path / "moe"))
    for name in ("llama", "moe"):
        model = load_model(str(tmp_path / name), CPU).model
        for module in model.modules():
            if hasattr(module, "stack_experts"):
                module.stack_experts()
        assert graph_refusal(model) is None and sharding_refusal(model) is None, name


def _one_line(e: pytest.ExceptionInfo, field: str, needle: str) -> None:
    msg = str(e.value)
    assert e.value.field == field and needle in msg and "\n" not in msg, msg


def test_tensor_parallelism_and_draft_model_use_are_refused(pair):
    arch = pair.lm.config.architecture
    what = "its learned attention sinks" if arch == "GptOssForCausalLM" else "its attention (Gemma4Attention)"
    with pytest.raises(ConfigError) as e:
        LLM.from_loaded(pair.lm, None, engine=EngineConfig(tensor_parallel_size=2))
    _one_line(e, "tensor_parallel_size", f"tensor parallelism does not support {arch} targets yet: {what} in layer 0")
    with pytest.raises(ConfigError) as e:
        DraftModelProposer(pair.lm, 4)
    _one_line(e, "draft_model", f"{arch} is not supported as a draft model yet: {what} in layer 0")


@pytest.mark.parametrize("edit,needle", [
    (dict(target_layer_ids=[0, 4]), "target_layer_ids=[0, 4] contains 4, but the target has only 4 layers"),
    (dict(mask_token_id=64), "mask_token_id=64 is outside the target vocabulary [0, 64)"),
    (dict(num_draft_tokens=8), "num_draft_tokens=8 is out of range for this draft: block_size=8 allows 1..7"),
])
def test_drafter_configs_that_do_not_fit_the_target_fail_naming_the_field(pair, tmp_path, edit, needle):
    make_zlab_draft(pair.hf.config, tmp_path / "d", layers=1, block_size=8, target_layer_ids=[0, 3],
                    mask_token_id=63)
    with pytest.raises(ConfigError) as e:
        load_draft(SpeculativeConfig(draft_model=str(tmp_path / "d"), **edit), pair.lm)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.gpu
def test_cuda_engine_runs_eagerly_and_decodes_as_transformers(pair):
    """fp32 on CUDA: the plan turns CUDA graphs off for the grouped experts, the engine captures nothing, and plain,
    n-gram and DFlash greedy decoding (the Triton attention with windows, sinks and shared K/V) give transformers'
    tokens (transformers on the CPU)."""
    from blockspec.loading.loader import LoadConfig

    lm = load_model(str(pair.root / "target"), LoadConfig(device="cuda", dtype="float32", with_tokenizer=False))
    assert not lm.plan.cuda_graphs and lm.plan.reasons[-1].startswith("CUDA graphs off: the routed experts")
    draft = load_draft(SpeculativeConfig(draft_model=str(pair.root / "draft")), lm)  # random weights: lossless
    prompts, params = workload(8, seed=5)
    for proposer in (None, NgramProposer(7, 3), DFlashProposer(draft)):
        llm = LLM.from_loaded(lm, proposer, engine=EngineConfig(max_num_seqs=4, block_size=16))
        assert_transformers_greedy(pair, prompts, params, Run(llm).run(prompts, params, stagger=2))
        stats = llm.engine.stats()
        assert llm.engine.config.enforce_eager and not stats.cuda_graphs and stats.num_decode_steps > 0
