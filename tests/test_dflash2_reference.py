"""DFlash 2 drafters against the authors' own implementation (z-lab `dflash` package: DFlash2DraftModel,
dflash_generate), greedy, fp32, CPU: tiny drafters built here are written in the z-lab format, loaded by both, and
blockspec's drafts, acceptance lengths and output tokens must equal the reference's step for step, through generate
(one request) and through the batched engine (staggered arrivals, preemption, prefix cache). Also: bad DFlash 2
configs fail in one line naming the field."""

from __future__ import annotations

import json
import time

import pytest
import torch

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.errors import BlockspecError
from blockspec.layers import cpu_packed
from blockspec.llm import LLM
from blockspec.loading.draft_loader import load_draft
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.models.dflash2 import DFlash2DraftModel
from blockspec.sampling import SamplingParams
from dflash_utils import make_zlab_draft2
from engine_utils import Run, one_device_and_tp2, spec_consistency
from hf_utils import make_hf_model, save_hf_model

zm = pytest.importorskip("dflash.model")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: extra threads only add synchronisation cost
    yield
    torch.set_num_threads(old)


def reference_trace(zd, hf, prompt: list[int], max_new: int, block_size: int):
    """The authors' dflash_generate, greedy: (generated ids, acceptance lengths, drafts of every step, and per step
    whether the selector's pick differs from the argmax somewhere)."""
    drafts: list[list[int]] = []
    moved: list[bool] = []
    orig = zd.propose

    def record(hidden, anchor, head, temperature):
        out = orig(hidden, anchor, head, temperature)
        drafts.append(out[0][0].tolist())
        moved.append(bool((zd.compute_logits(hidden, head).argmax(-1) != out[0]).any()))
        return out

    zd.propose = record
    old_time, zm._cuda_time = zm._cuda_time, time.perf_counter  # the reference times with CUDA events only
    try:
        out = zm.dflash_generate(zd, hf, torch.tensor([prompt]), max_new, None, block_size=block_size,
                                 return_stats=True)
    finally:
        zm._cuda_time = old_time
        del zd.propose
    return out.output_ids[0, len(prompt):].tolist(), out.acceptance_lengths, drafts, moved


def full_width(ref_drafts: list[list[int]], K: int) -> int:
    """Steps the reference drafted at full width: near max_tokens it shrinks its last blocks (fewer MASK slots change
    a non-causal draft) where the engine still drafts K; every step before those is compared."""
    full = [i for i, d in enumerate(ref_drafts) if len(d) == K]
    assert full == list(range(len(full)))
    return len(full)


def assert_same_as_reference(out, ref, K: int, min_steps: int = 5) -> None:
    ids, lens, drafts, _ = ref
    assert out.token_ids == ids
    n = full_width(drafts, K)
    assert n >= min_steps
    assert [s.draft for s in out.steps[:n]] == drafts[:n]
    assert out.acceptance_lengths[:n] == lens[:n]


VARIANTS = {
    "plain": {},
    "kernel1_top1": {"conv_kernel_size": 1, "selector_top_k": 1},  # pointwise conv; the selector is the argmax
    # kernel sizes up to 3: the reference's own convolution fails on blocks shorter than kernel_size - 1 (its last
    # blocks near max_tokens); longer kernels are checked against the formula below
    "kernel2_group4": {"conv_kernel_size": 2, "conv_group_size": 4, "selector_top_k": 8, "selector_rank": 4},
    "sliding_causal": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
    "sliding_noncausal": {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 5,
                          "is_causal": False},
    "scaled": {"input_embedding_scale": 1.7, "output_multiplier": 0.8, "final_logit_softcapping": 3.0},
}
CASES = [("qwen3", "plain", 7), ("llama", "plain", 3), ("qwen3", "kernel1_top1", 7), ("llama", "kernel2_group4", 7),
         ("qwen3", "sliding_causal", 3), ("llama", "sliding_noncausal", 7), ("qwen3", "scaled", 7)]


@pytest.mark.parametrize("arch,variant,K", CASES)
def test_generate_matches_reference(tmp_path, arch, variant, K):
    hf = make_hf_model(arch, seed=2)
    hf.generation_config.eos_token_id = None
    save_hf_model(hf, tmp_path / "t")
    zd = make_zlab_draft2(hf.config, tmp_path / "d", block_size=8, target_layer_ids=[0, 2], scale=3.0,
                          **VARIANTS[variant])
    lm = load_model(str(tmp_path / "t"), LoadConfig(device="cpu", with_tokenizer=False))
    draft = load_draft(SpeculativeConfig(draft_model=str(tmp_path / "d"), num_draft_tokens=K), lm)
    assert isinstance(draft.model, DFlash2DraftModel)
    prompt = [5, 17, 99, 3, 42, 8, 1, 9, 60, 61][: 4 + K]
    ref = reference_trace(zd, hf, prompt, 40, block_size=K + 1)
    if VARIANTS[variant].get("selector_top_k", 4) > 1:
        assert any(ref[3]), "the selector never overrode the argmax: the test would not see it"
    llm = LLM.from_loaded(lm, draft)
    out = llm.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert_same_as_reference(out, ref, K)


def test_cli_generate_matches_reference(tmp_path, capsys):
    """`blockspec generate --draft DIR --json --trace`: the command detects DFlash 2 from `architectures` alone."""
    from blockspec.cli import main

    hf = make_hf_model("qwen3", seed=12)
    hf.generation_config.eos_token_id = None
    save_hf_model(hf, tmp_path / "t")
    zd = make_zlab_draft2(hf.config, tmp_path / "d", block_size=8, target_layer_ids=[0, 2], scale=3.0)
    prompt = [4, 5, 6]
    ref = reference_trace(zd, hf, prompt, 24, block_size=8)
    argv = ["generate", "--model", str(tmp_path / "t"), "--draft", str(tmp_path / "d"), "--prompt-ids", "4,5,6",
            "--max-tokens", "24", "--json", "--trace", "--draft-len-schedule", "off", "--no-cpu-bf16-draft"]
    assert main(argv) in (0, None)
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["token_ids"] == ref[0]
    n = full_width(ref[2], 7)
    assert [s["draft"] for s in got["steps"][:n]] == ref[2][:n]
    assert got["acceptance_lengths"][:n] == ref[1][:n]


# --------------------------------------------------------------------------------------------------------------
# the batched engine, with a DFlash 2 drafter that gets long blocks accepted: the trained DFlash 1 pair's drafter
# (tests/trained_pair.py) with convolutions near the identity and a selector strong enough to override its argmax
# in most steps (acceptance lengths spread over 1..8: every kind of context append runs)


@pytest.fixture(scope="module")
def trained2(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from blockspec.train.export import hf_state_dict
    from trained_pair import BLOCK, MASK, TAPS, trained_pair

    pair = trained_pair()
    hf = AutoModelForCausalLM.from_pretrained(str(pair.lm.source.path), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    root = tmp_path_factory.mktemp("dflash2_trained")
    zd = make_zlab_draft2(hf.config, root / "d", layers=1, block_size=BLOCK, target_layer_ids=TAPS,
                          mask_token_id=MASK, conv_group_size=8, selector_rank=8, selector_top_k=4,
                          codebook_scale=2.5, conv_noise=0.1, init=hf_state_dict(pair.draft.model))
    draft = load_draft(SpeculativeConfig(draft_model=str(root / "d")), pair.lm)
    return pair.lm, hf, zd, draft


_refs: dict = {}


def ref_for(trained2, prompt: list[int], max_tokens: int):
    key = (tuple(prompt), max_tokens)
    if key not in _refs:
        _, hf, zd, draft = trained2
        _refs[key] = reference_trace(zd, hf, list(prompt), max_tokens, draft.spec.block_size)
    return _refs[key]


def check_outputs(trained2, prompts, params, outs) -> float:
    """Every request equals its own dflash_generate run; returns the mean acceptance length."""
    K = trained2[3].spec.num_draft_tokens
    for p, sp, o in zip(prompts, params, outs):
        assert_same_as_reference(o, ref_for(trained2, p, sp.max_tokens), K, min_steps=2)
    spec_consistency(outs)
    lens = [a for o in outs for a in o.acceptance_lengths]
    return sum(lens) / len(lens)


@pytest.mark.parametrize("stagger,pool", [(None, "roomy"), (2, "tight")])
def test_engine_matches_reference(trained2, stagger, pool):
    """Many requests at once (or arriving two per step), chunked prefill, paged context; with a tight pool requests
    are preempted and recomputed, and continue with the same drafts."""
    from engine_utils import cycle_workload

    lm, _, _, draft = trained2
    prompts, params = cycle_workload(10, seed=5, max_len=60, max_tokens=(24, 40))
    K = draft.spec.num_draft_tokens
    kw = dict(num_kv_blocks=60) if pool == "tight" else dict(num_kv_blocks=400)
    llm = LLM.from_loaded(lm, draft,
                          engine=EngineConfig(block_size=4, max_num_seqs=6, max_num_batched_tokens=6 * (K + 1), **kw))
    run = Run(llm)
    outs = run.run(prompts, params, stagger=stagger)
    assert (llm.engine.scheduler.num_preemptions > 0) == (pool == "tight")
    assert run.batch_accept >= 2  # several requests accepted drafts in the same step
    assert check_outputs(trained2, prompts, params, outs) > 2.5


def test_engine_prefix_cache_matches_reference(trained2):
    """Requests whose prompts share long prefixes map each other's cached blocks (target K/V and the draft context
    under the same block ids), one after another and while the first is still decoding."""
    from trained_pair import CYCLE_A, CYCLE_B, cycle_seq

    lm, _, _, _ = trained2
    prefix = cycle_seq(CYCLE_A, 3, 41)
    a, b = prefix + cycle_seq(CYCLE_A, 44, 3), prefix + cycle_seq(CYCLE_A, 44, 7)
    sp = SamplingParams(max_tokens=32, ignore_eos=True)
    llm = LLM.from_loaded(lm, trained2[3], engine=EngineConfig(block_size=8, max_num_batched_tokens=256))
    bm = llm.engine.blocks
    first = llm.generate([a], sp, use_tqdm=False)[0]
    hits = bm.prefix_hits
    second = llm.generate([b], sp, use_tqdm=False)[0]
    assert bm.prefix_hits - hits >= 41 // 8
    cont = a + first.token_ids  # a's generated tokens are cached too (blocks written by verify steps)
    third = llm.generate([cont], sp, use_tqdm=False)[0]
    # a running request shares its blocks with one that arrives while it decodes
    c, d = cycle_seq(CYCLE_B, 5, 64) + [CYCLE_B[9]], cycle_seq(CYCLE_B, 5, 64) + cycle_seq(CYCLE_B, 9, 6)
    run = Run(llm)
    rc = run.add(c, sp)
    run.step()
    run.step()
    hits = bm.prefix_hits
    rd = run.add(d, sp)
    run.step()
    assert bm.prefix_hits - hits >= 64 // 8 and max(bm.ref) == 2
    while llm.engine.has_unfinished():
        run.step()
    prompts, outs = [a, b, cont, c, d], [first, second, third, run.final[rc], run.final[rd]]
    assert check_outputs(trained2, prompts, [sp] * 5, outs) > 2.5


def test_engine_overlap_matches_reference(trained2):
    """Overlap (the CUDA engine's chained decode steps, forced on the CPU): step n+1's drafts come from step n's
    device-side result and still equal the reference's."""
    from engine_utils import cycle_workload

    lm, _, _, draft = trained2
    prompts, params = cycle_workload(8, seed=9, max_len=40, max_tokens=(24, 40))
    llm = LLM.from_loaded(lm, draft, engine=EngineConfig(block_size=4, max_num_seqs=5, overlap=True))
    outs = Run(llm).run(prompts, params, stagger=2)
    assert check_outputs(trained2, prompts, params, outs) > 2.5


@pytest.mark.skipif(not cpu_packed.fp32_supported(torch.device("cpu")), reason="torch without oneDNN")
def test_packed_target_and_drafter_stay_lossless(trained2):
    """A packed target's DFlash 2 drafter is packed too (its convolution and selector projections included), in fp32
    or in bf16 (cpu_bf16_draft): the output is the packed target's plain decoding, and the drafts still get
    accepted."""
    lm = load_model(str(trained2[0].source.path), LoadConfig(device="cpu", with_tokenizer=False, cpu_packed=True))
    draft = load_draft(SpeculativeConfig(draft_model=str(trained2[3].source)), lm)
    assert isinstance(draft.model.layers[0].attention_conv.kernel_projection, cpu_packed.PackedLinear)
    assert isinstance(draft.model.candidate_selector.hidden_projection, cpu_packed.PackedLinear)
    from trained_pair import CYCLE_A, CYCLE_B, cycle_seq

    prompts = [cycle_seq(CYCLE_A, 2, 9), cycle_seq(CYCLE_B, 7, 30), [3, 1, 4, 1, 5]]
    sp = SamplingParams(max_tokens=32, ignore_eos=True)
    plain = LLM.from_loaded(lm, None).generate(prompts, sp, use_tqdm=False)
    drafters = [draft]
    if cpu_packed.bf16_supported(torch.device("cpu")):  # and the bf16 drafter under the fp32 target
        drafters.append(load_draft(SpeculativeConfig(draft_model=str(trained2[3].source), cpu_bf16_draft=True), lm))
    for d in drafters:
        spec = LLM.from_loaded(lm, d).generate(prompts, sp, use_tqdm=False)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
        assert max(o.mean_acceptance_length for o in spec) > 2.5


# --------------------------------------------------------------------------------------------------------------
# the parts, against their formulas


def test_convolution_is_causal_inside_each_block_only():
    """out[j] = sum_o (base[o] + dyn[j, o, group]) * x[j - o], x before the block's first row = 0: written out for
    a kernel longer than the block (which the reference's own convolution cannot take), and blocks never mix."""
    from blockspec.models.dflash2 import GroupedDynamicCausalConv

    torch.manual_seed(0)
    H, g, ks, rows, blocks = 12, 4, 5, 3, 4
    conv = GroupedDynamicCausalConv(H, ks, g)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    x, y = torch.randn(blocks * rows, H), torch.randn(blocks * rows, H)
    with torch.no_grad():
        pre, dyn = conv.prepare(x, rows)
        post = conv.finish(y, dyn, rows)
        d = conv.kernel_projection(x).view(blocks, rows, 2, ks, H // g)
    for side, inp, got in [(0, x, pre), (1, y, post)]:
        want = torch.zeros(blocks, rows, H)
        xb = inp.view(blocks, rows, H)
        for b in range(blocks):
            for j in range(rows):
                for o in range(min(ks, j + 1)):
                    w = conv.base_kernel[side, o].detach() + d[b, j, side, o].repeat_interleave(g)
                    want[b, j] += w * xb[b, j - o]
        torch.testing.assert_close(got.view(blocks, rows, H), want, rtol=1e-5, atol=1e-5)
    # each block alone gives the rows of the batch of blocks: a leak between blocks would move them by O(1); the
    # kernel projection's GEMM may round differently for 3 rows than for 12 (MKL picks kernels by M), hence 1e-5
    with torch.no_grad():
        torch.testing.assert_close(conv.prepare(x[rows:2 * rows], rows)[0], pre[rows:2 * rows], rtol=1e-5, atol=1e-5)


def test_draft_pass_and_selector_read_nothing_back_to_the_host():
    """The block forward, the greedy selector pass and the sampled one run on meta tensors (no values at all): none of
    them reads a device value on the host (.item(), .tolist(), data-dependent shapes), so the decode step can
    capture them in its CUDA graph."""
    from blockspec.models.dflash2 import DFlash2Config

    cfg = DFlash2Config.from_hf({"architectures": ["DFlash2DraftModel"], "hidden_size": 32, "intermediate_size": 64,
                                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "head_dim": 8, "vocab_size": 50, "block_size": 8,
                                 "dflash_config": {"conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 4,
                                                   "selector_top_k": 5, "mask_token_id": 49,
                                                   "target_layer_ids": [0]}}, "meta-test")
    with torch.device("meta"):
        model = DFlash2DraftModel(cfg, num_taps=1)
        head = torch.nn.Linear(32, 50, bias=False)
        B, R, K = 3, 8, 7
        embeds, pos = torch.empty(B * R, 32), torch.zeros(B * R, dtype=torch.long)
        hidden = model(embeds, pos, lambda layer, q, k, v, scale, causal, window: q, R).view(B, R, -1)[:, 1:K + 1]
        anchor = torch.zeros(B, dtype=torch.long)
        assert model.block_drafts(hidden, anchor, head).shape == (B, K)
        drafts, q = model.sampled_block_drafts(hidden, anchor, head, torch.ones(B), torch.ones(B, K, 5))
        assert drafts.shape == (B, K) and q.shape == (B, K, 50)


# --------------------------------------------------------------------------------------------------------------
# bad configs: one line naming the field


def _write_config(tmp_path, **changes):
    hf = make_hf_model("qwen3", seed=1)
    save_hf_model(hf, tmp_path / "t")
    make_zlab_draft2(hf.config, tmp_path / "d", block_size=8, target_layer_ids=[0, 2])
    path = tmp_path / "d" / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg["dflash_config"].pop(key, None)
            cfg.pop(key, None)
        else:
            cfg["dflash_config"][key] = value
    path.write_text(json.dumps(cfg))
    return load_model(str(tmp_path / "t"), LoadConfig(device="cpu", with_tokenizer=False))


@pytest.mark.parametrize("changes,expected", [
    ({"conv_kernel_size": 0}, "conv_kernel_size=0 must be an integer >= 1"),
    ({"conv_kernel_size": None}, "required DFlash 2 field 'conv_kernel_size' is missing"),
    ({"conv_group_size": 7}, "conv_group_size=7 must divide hidden_size=64"),
    ({"conv_group_size": "8"}, "conv_group_size='8' must be an integer >= 1"),
    ({"selector_rank": True}, "selector_rank=True must be an integer >= 1"),
    ({"selector_rank": -2}, "selector_rank=-2 must be an integer >= 1"),
    ({"selector_top_k": 1000}, "selector_top_k=1000 exceeds vocab_size=128"),
    ({"selector_top_k": 2.5}, "selector_top_k=2.5 must be an integer >= 1"),
])
def test_bad_dflash2_config_fails_in_one_line(tmp_path, changes, expected):
    lm = _write_config(tmp_path, **changes)
    with pytest.raises(BlockspecError) as err:
        load_draft(SpeculativeConfig(draft_model=str(tmp_path / "d")), lm)
    msg = str(err.value)
    assert "\n" not in msg and expected in msg and str(tmp_path / "d") in msg


def test_draft_vocab_below_the_selectors_top_k_is_refused(tmp_path):
    lm = _write_config(tmp_path)
    with pytest.raises(BlockspecError, match="draft_vocab_size=3 is below this DFlash 2 drafter's selector_top_k=4"):
        load_draft(SpeculativeConfig(draft_model=str(tmp_path / "d"), draft_vocab_size=3), lm)


def test_codebooks_saved_with_a_weight_suffix_load_too(tmp_path):
    """z-lab stores the codebooks as raw tensors; a copy saved from an nn.Embedding-based module names them
    `...codebook.weight`: both load to the same drafter, and a misnamed tensor still fails naming it."""
    from safetensors.torch import load_file, save_file

    lm = _write_config(tmp_path)
    zlab = load_draft(SpeculativeConfig(draft_model=str(tmp_path / "d")), lm).model.candidate_selector
    file = tmp_path / "d" / "model.safetensors"
    tensors = load_file(str(file))
    save_file({f"{k}.weight" if k.endswith("_codebook") else k: v for k, v in tensors.items()}, str(file))
    suffixed = load_draft(SpeculativeConfig(draft_model=str(tmp_path / "d")), lm).model.candidate_selector
    for name in ("predecessor_codebook", "successor_codebook"):
        assert torch.equal(getattr(zlab, name), getattr(suffixed, name))
    save_file({k.replace("successor_codebook", "successor_table"): v for k, v in tensors.items()}, str(file))
    with pytest.raises(BlockspecError, match="candidate_selector.successor_table"):
        load_draft(SpeculativeConfig(draft_model=str(tmp_path / "d")), lm)


def test_tensor_parallel_2_equals_one_device(trained2):
    """LLM(tensor_parallel_size=2) on the CPU (gloo) with the DFlash 2 drafter: the ranks shard target and drafter and
    run the convolutions and the selector on their own; tokens and acceptance lengths equal one device's."""
    from trained_pair import CYCLE_A, CYCLE_B, cycle_seq

    lm, _, _, draft = trained2
    prompts = [cycle_seq((CYCLE_A, CYCLE_B)[i % 2], 2 * i, 6 + 5 * i) for i in range(3)]
    want, got = one_device_and_tp2(lm, draft, prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert got == want
    assert max(max(a) for _, a in want) > 2  # the selector's drafts were accepted
