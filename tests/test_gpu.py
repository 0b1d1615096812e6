"""The CUDA path gives the CPU path's results (run on the GPU machine; skipped where CUDA is absent)."""

from __future__ import annotations

import pytest
import torch

from dense_cache import DenseCausalAttention, DenseKVCache
from blockspec.config import EngineConfig, SpeculativeConfig
from oracles import generate
from blockspec.llm import LLM
from blockspec.loading.draft_loader import load_draft
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.loading.prepare import limit_draft_vocab
from blockspec.sampling import SamplingParams
from oracles import spec_generate
from dflash_utils import check_fused_draft_prologue, make_zlab_draft
from hf_utils import make_hf_model, save_hf_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_cuda_fp32_matches_transformers_and_cpu(tmp_path, arch):
    hf = make_hf_model(arch, seed=21)
    d = str(save_hf_model(hf, tmp_path))
    gpu = load_model(d, LoadConfig(device="cuda", dtype="float32", with_tokenizer=False))
    cpu = load_model(d, LoadConfig(device="cpu", with_tokenizer=False))
    ids = torch.randint(0, 128, (64,))
    cfg = gpu.config
    cache = DenseKVCache.allocate(cfg.num_hidden_layers, 64, cfg.num_key_value_heads, cfg.head_dim, torch.float32,
                                  torch.device("cuda"))
    pos = torch.arange(64, device="cuda")
    with torch.no_grad():
        ours = gpu.model(ids.cuda(), pos, DenseCausalAttention(cache, pos, 64)).logits.cpu()
        ref = hf.cuda()(ids[None].cuda()).logits[0].float().cpu()
    assert (ours - ref).abs().max().item() <= 1e-3
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    assert generate(gpu, [3, 4, 5], params).token_ids == generate(cpu, [3, 4, 5], params).token_ids


def test_cuda_bf16_greedy_close_to_transformers(tmp_path):
    hf = make_hf_model("qwen3", seed=22)
    d = str(save_hf_model(hf, tmp_path))
    gpu = load_model(d, LoadConfig(device="cuda", dtype="bfloat16", with_tokenizer=False))
    hf = hf.to(device="cuda", dtype=torch.bfloat16)
    prompt = [7, 8, 9, 10]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=16, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, 4:].tolist()
    ours = generate(gpu, prompt, SamplingParams(max_tokens=16, ignore_eos=True)).token_ids
    agree = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ours))
    assert agree >= 8, (ours, ref)  # bf16 near-ties may flip late tokens


def test_cuda_spec_and_engine_equal_plain(tmp_path):
    hf = make_hf_model("qwen3", seed=23)
    save_hf_model(hf, tmp_path / "t")
    make_zlab_draft(hf.config, tmp_path / "d", block_size=8, target_layer_ids=[0, 2], scale=2.0)
    lm = load_model(str(tmp_path / "t"), LoadConfig(device="cuda", dtype="float32", with_tokenizer=False))
    dr = load_draft(SpeculativeConfig(draft_model=str(tmp_path / "d")), lm)
    prompts = [[1 + i, 2, 3 + i] * (i + 1) for i in range(6)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = [generate(lm, p, params).token_ids for p in prompts]
    assert [spec_generate(lm, dr, p, params).token_ids for p in prompts] == plain
    outs = LLM.from_loaded(lm, dr,
                           engine=EngineConfig(block_size=4,
                                               max_num_batched_tokens=32)).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == plain


def _on_cuda(pair, dtype: torch.dtype):
    """The trained tiny pair (built on CPU) copied onto the GPU in `dtype`."""
    import copy
    import dataclasses

    lm = dataclasses.replace(pair.lm, model=copy.deepcopy(pair.lm.model).to("cuda", dtype))
    draft = dataclasses.replace(pair.draft, model=copy.deepcopy(pair.draft.model).to("cuda", dtype))
    return lm, draft


def _workload():
    from trained_pair import CYCLE_A, CYCLE_B, cycle_seq

    prompts = [cycle_seq((CYCLE_A, CYCLE_B)[i % 2], 3 * i, 5 + 7 * i) for i in range(10)]
    params = [SamplingParams(max_tokens=60, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=60, ignore_eos=True) for i in range(10)]
    return prompts, params


def _run(lm, draft, **kw):
    prompts, params = _workload()
    llm = LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=8, block_size=8, **kw))
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.token_ids, o.acceptance_lengths) for o in outs], llm.engine.stats()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_step_equals_eager(dtype):
    from trained_pair import trained_pair

    lm, draft = _on_cuda(trained_pair(), dtype)
    graph, stats = _run(lm, draft)
    assert len(stats.cuda_graphs) >= 2  # several buckets were captured and replayed
    eager, eager_stats = _run(lm, draft, enforce_eager=True)
    assert not eager_stats.cuda_graphs and eager_stats.num_decode_steps
    assert graph == eager


def test_cuda_overlap_equals_synchronous():
    """Overlap scheduling on the GPU: steps chained from the graph's device-side result (and read back through
    pinned memory) give the synchronous engine's outputs (fp32: a step chained for requests that have finished runs
    a larger batch than the synchronous engine would, which moves bf16 roundings)."""
    from trained_pair import trained_pair

    lm, draft = _on_cuda(trained_pair(), torch.float32)
    prompts, params = _workload()
    on = LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=8, block_size=8))
    got = [(o.token_ids, o.acceptance_lengths) for o in on.generate(prompts, params, use_tqdm=False)]
    assert on.engine.num_overlapped_steps > 10
    off, _ = _run(lm, draft, overlap=False)
    assert got == off


def test_cuda_fp32_engine_equals_cpu_engine():
    from trained_pair import trained_pair

    pair = trained_pair()
    cpu, _ = _run(pair.lm, pair.draft)
    gpu, _ = _run(*_on_cuda(pair, torch.float32))
    assert gpu == cpu
    assert max(max(a) for _, a in cpu if a) > 3  # real acceptance, not a drafter that never hits


def test_cuda_probabilistic_drafting_in_the_graph_equals_eager_and_cpu():
    """Sampled drafts (p/q rejection) run inside the captured decode step, their q carried on the device from step to
    step (chained under overlap): captured, eager and CPU runs agree in fp32."""
    import dataclasses

    from trained_pair import trained_pair

    def sampled(d):
        return dataclasses.replace(d, spec=dataclasses.replace(d.spec, probabilistic_drafting=True))

    pair = trained_pair()
    cpu, _ = _run(pair.lm, sampled(pair.draft))
    lm, draft = _on_cuda(pair, torch.float32)
    graph, stats = _run(lm, sampled(draft))
    assert any(not g.all_greedy for g in stats.cuda_graphs)  # a graph of sampled (not all-greedy) rows
    eager, _ = _run(lm, sampled(draft), enforce_eager=True)
    assert graph == eager == cpu


def test_cuda_full_block_drafting_graph_equals_eager_and_cpu():
    # K = 2 drafts taken from a block of the trained size: captured, eager and CPU runs agree in fp32
    import dataclasses

    from trained_pair import trained_pair

    def full(d):
        return dataclasses.replace(d, spec=dataclasses.replace(d.spec, num_draft_tokens=2, full_block_drafting=True))

    pair = trained_pair()
    cpu, _ = _run(pair.lm, full(pair.draft))
    lm, draft = _on_cuda(pair, torch.float32)
    graph, stats = _run(lm, full(draft))
    assert stats.cuda_graphs
    eager, _ = _run(lm, full(draft), enforce_eager=True)
    assert graph == eager == cpu


def test_cuda_draft_vocab_graph_equals_eager_and_cpu():
    # argmax drafts over token ids < 30 (a static view of the head's first rows, made before capture): captured,
    # eager and CPU runs agree in fp32, and the CPU run emits the plain tokens (CYCLE_B's ids are never drafted)
    import copy
    import dataclasses

    from trained_pair import trained_pair

    def limited(lm, d):
        model = copy.deepcopy(d.model)
        limit_draft_vocab(model, lm.model.lm_head, 30)
        return dataclasses.replace(d, model=model)

    pair = trained_pair()
    cpu, _ = _run(pair.lm, limited(pair.lm, pair.draft))
    assert [t for t, _ in cpu] == [t for t, _ in _run(pair.lm, None)[0]]
    lm, draft = _on_cuda(pair, torch.float32)
    graph, stats = _run(lm, limited(lm, draft))
    assert stats.cuda_graphs
    eager, _ = _run(lm, limited(lm, draft), enforce_eager=True)
    assert graph == eager == cpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_fused_draft_prologue_matches_unfused(dtype):
    """The drafter's fused prologue (one GEMM + Triton split/norm/rotary) for its block and its context K/V gives the
    unfused path's q, k, v; the paged variant writes them into the pool."""
    from trained_pair import trained_pair

    _, draft = _on_cuda(trained_pair(), dtype)
    check_fused_draft_prologue(draft.model, "cuda", dtype, 1e-5 if dtype == torch.float32 else 2**-6)
