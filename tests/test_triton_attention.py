"""Triton paged kernels against the torch reference on random inputs of many shapes (interpreter on CPU)."""

from __future__ import annotations

import random

import pytest
import torch

triton = pytest.importorskip("triton")
from blockspec.attention.torch_ref import attend, build_mask  # noqa: E402
from blockspec.attention.triton_paged import paged_attention, store_kv  # noqa: E402
from blockspec.config import EngineConfig

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(seed: int, page: int, hq: int, hkv: int, d: int, q_lens: list[int], ctx_lens: list[int]):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    B = len(q_lens)
    max_blocks = max(-(-(c + q) // page) for c, q in zip(ctx_lens, q_lens)) + 1
    num_blocks = B * max_blocks + 3
    perm = list(range(num_blocks))
    rng.shuffle(perm)  # pages scattered through the pool
    tables = torch.tensor([perm[i * max_blocks:(i + 1) * max_blocks] for i in range(B)], dtype=torch.int64)
    kc = torch.randn(num_blocks * page, hkv, d, generator=g)
    vc = torch.randn(num_blocks * page, hkv, d, generator=g)
    T = sum(q_lens)
    q = torch.randn(T, hq, d, generator=g)
    qs = [0]
    positions = []
    for c, n in zip(ctx_lens, q_lens):
        qs.append(qs[-1] + n)
        positions += list(range(c, c + n))
    return q, kc, vc, tables, torch.tensor(qs), torch.tensor(positions)


def gather(kc, vc, table, n, page):
    pos = torch.arange(n)
    slots = table[pos // page] * page + pos % page
    return kc[slots], vc[slots]


CASES = [(1, 4, 2, 16, None), (4, 4, 4, 32, None), (16, 6, 2, 64, None), (16, 8, 1, 16, None),
         (16, 4, 2, 32, "long")]  # long contexts: split-K with merged partials


@pytest.mark.parametrize("page,hq,hkv,d,kind", CASES)
def test_target_causal_matches_reference(page, hq, hkv, d, kind):
    q_lens, ctx_lens = [1, 5, 16, 23, 1], [0, 7, 30, 3, 45]  # decode, verify blocks, prefill chunks
    if kind == "long":
        q_lens, ctx_lens = [1, 4, 16], [700, 300, 555]
    q, kc, vc, tables, qs, positions = make_case(page * 7 + hq, page, hq, hkv, d, q_lens, ctx_lens)
    kv_lens = torch.tensor([c + n for c, n in zip(ctx_lens, q_lens)])
    out = paged_attention(q.to(DEV), kc.to(DEV), vc.to(DEV), positions.to(DEV), qs.to(DEV), kv_lens.to(DEV),
                          tables.to(DEV), page, d**-0.5, max(q_lens), causal=True).cpu()
    for i in range(len(q_lens)):
        k, v = gather(kc, vc, tables[i], int(kv_lens[i]), page)
        a, b = int(qs[i]), int(qs[i + 1])
        ref = attend(q[a:b], k, v, build_mask(positions[a:b], torch.arange(int(kv_lens[i])), True), d**-0.5)
        assert (out[a:b] - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("causal,window", [(False, None), (True, 5), (False, 6), (True, None)])
def test_draft_block_over_context(causal, window):
    page, hq, hkv, d = 4, 4, 2, 16
    q_lens, ctx_lens = [8, 8, 4], [1, 19, 40]
    q, kc, vc, tables, qs, positions = make_case(3, page, hq, hkv, d, q_lens, ctx_lens)
    g = torch.Generator().manual_seed(9)
    kn, vn = torch.randn(q.shape[0], hkv, d, generator=g), torch.randn(q.shape[0], hkv, d, generator=g)
    kv_lens = torch.tensor(ctx_lens)
    out = paged_attention(q.to(DEV), kc.to(DEV), vc.to(DEV), positions.to(DEV), qs.to(DEV), kv_lens.to(DEV),
                          tables.to(DEV), page, d**-0.5, max(q_lens), causal=causal, window=window,
                          k_new=kn.to(DEV), v_new=vn.to(DEV)).cpu()
    for i in range(len(q_lens)):
        k, v = gather(kc, vc, tables[i], ctx_lens[i], page)
        a, b = int(qs[i]), int(qs[i + 1])
        keys, values = torch.cat([k, kn[a:b]]), torch.cat([v, vn[a:b]])
        k_pos = torch.cat([torch.arange(ctx_lens[i]), positions[a:b]])
        ref = attend(q[a:b], keys, values, build_mask(positions[a:b], k_pos, causal, window), d**-0.5)
        assert (out[a:b] - ref).abs().max().item() < 1e-4


def test_store_kv_skips_minus_one():
    kc, vc = torch.zeros(10, 2, 16, device=DEV), torch.zeros(10, 2, 16, device=DEV)
    k, v = torch.randn(4, 2, 16, device=DEV), torch.randn(4, 2, 16, device=DEV)
    store_kv(k, v, kc, vc, torch.tensor([3, -1, 7, 0], device=DEV))
    assert torch.equal(kc[3], k[0]) and torch.equal(kc[7], k[2]) and torch.equal(vc[0], v[3])
    assert kc[[1, 2, 4, 5, 6, 8, 9]].abs().sum() == 0


def test_engine_with_triton_backend_equals_reference(tmp_path):
    """The whole engine (target + DFlash draft) on the Triton backend gives the torch backend's tokens."""
    from blockspec.config import SpeculativeConfig
    from blockspec.llm import LLM
    from blockspec.loading.draft_loader import load_draft
    from blockspec.loading.loader import LoadConfig, load_model
    from blockspec.sampling import SamplingParams
    from dflash_utils import make_zlab_draft
    from hf_utils import make_hf_model, save_hf_model

    hf = make_hf_model("qwen3", seed=31, num_hidden_layers=2)
    save_hf_model(hf, tmp_path / "t")
    make_zlab_draft(hf.config, tmp_path / "d", layers=1, block_size=4, target_layer_ids=[0, 1], scale=2.0,
                    layer_types=["sliding_attention"], sliding_window=3)
    lm = load_model(str(tmp_path / "t"), LoadConfig(device=DEV, dtype="float32", with_tokenizer=False))
    dr = load_draft(SpeculativeConfig(draft_model=str(tmp_path / "d")), lm)
    prompts = [[5, 6, 7], list(range(1, 14)), [9]]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM.from_loaded(lm, dr,
                              engine=EngineConfig(block_size=4, max_num_batched_tokens=16, attention_backend=backend))
        outs[backend] = [(o.token_ids, o.acceptance_lengths) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["triton"] == outs["torch"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_rmsnorm_matches_torch(dtype):
    from blockspec.layers.norm import RMSNorm
    from blockspec.layers.triton_norm import rmsnorm

    norm = RMSNorm(96, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(5, 3, 96).to(dtype)
    ref = norm(x)  # CPU: the torch path
    out = rmsnorm(x.to(DEV), norm.weight.to(DEV), 1e-6).cpu()
    # fp32: reduction order only; bf16: a differently rounded rstd can move the two bf16 roundings by an ulp each
    tol = 1e-5 if dtype == torch.float32 else 2**-6
    assert out.dtype == dtype
    assert ((out.float() - ref.float()).abs() <= tol * ref.float().abs().clamp_min(1.0)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_rotary_matches_torch(dtype):
    from blockspec.layers.rotary import RotaryEmbedding, rotate_half
    from blockspec.layers.triton_rotary import rotary_

    rope = RotaryEmbedding(32, 10000.0, None, 512)
    pos = torch.tensor([0, 5, 17, 300, 511])
    cos, sin = rope.cos_sin(pos, dtype)
    x = torch.randn(5, 3, 32).to(dtype)
    ref = x * cos + rotate_half(x) * sin
    out = rotary_(x.clone().to(DEV), cos.to(DEV), sin.to(DEV)).cpu()
    if dtype == torch.float32:
        assert (out - ref).abs().max().item() <= 1e-6
    else:  # bf16: within two rounding steps (the interpreter truncates fp32 -> bf16 casts; CUDA torch may fuse)
        assert ((out.float() - ref.float()).abs() <= 2**-6 * ref.float().abs().clamp_min(1.0)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_add_rmsnorm_matches_torch(dtype):
    from blockspec.layers.norm import RMSNorm
    from blockspec.layers.triton_norm import add_rmsnorm

    norm = RMSNorm(96, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x, r = torch.randn(7, 96).to(dtype), torch.randn(7, 96).to(dtype)
    ref_out, ref_h = norm.add_forward(x, r)  # CPU: the torch path
    out, h = add_rmsnorm(x.to(DEV), r.to(DEV), norm.weight.to(DEV), 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 2**-6
    # the residual sum is one rounding of an fp32 sum both ways: exact in fp32; in bf16 one ulp apart at most
    # (Triton's CPU interpreter truncates fp32 -> bf16 casts instead of rounding to nearest)
    assert ((h.cpu().float() - ref_h.float()).abs() <= (0 if dtype == torch.float32 else 2**-7) * ref_h.float().abs()).all()
    assert out.dtype == dtype
    assert ((out.cpu().float() - ref_out.float()).abs() <= tol * ref_out.float().abs().clamp_min(1.0)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_silu_mul_matches_torch(dtype):
    import torch.nn.functional as F

    from blockspec.layers.triton_norm import silu_mul

    x = (torch.randn(5, 2 * 1500) * 3).to(dtype)  # 1500 columns: two column blocks, the second one partial
    gate, up = x.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    out = silu_mul(x.to(DEV)).cpu()
    assert out.shape == (5, 1500) and out.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2**-6  # two bf16 roundings (the interpreter truncates them)
    assert ((out.float() - ref.float()).abs() <= tol * ref.float().abs().clamp_min(1.0)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("Hq", [4, 0])  # 0: k/v rows only (the drafter's context K/V)
def test_triton_split_qkv_norm_rope_matches_torch(dtype, qk_norm, Hq):
    from blockspec.layers.norm import RMSNorm
    from blockspec.layers.rotary import RotaryEmbedding, rotate_half
    from blockspec.layers.triton_qkv import split_qkv_norm_rope

    T, Hkv, D = 5, 2, 32
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D + 16).to(dtype)[:, : (Hq + 2 * Hkv) * D]  # row stride > width
    qn, kn = RMSNorm(D, 1e-6).to(dtype), RMSNorm(D, 1e-6).to(dtype)
    with torch.no_grad():
        qn.weight.normal_()
        kn.weight.normal_()
    cos, sin = RotaryEmbedding(D, 10000.0, None, 512).cos_sin(torch.tensor([0, 3, 17, 300, 511]), dtype)
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.reshape(T, Hq, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
    if qk_norm:
        q, k = qn(q), kn(k)
    rope = lambda x: x * cos + rotate_half(x) * sin  # noqa: E731
    refs = (rope(q), rope(k), v)
    norms = (qn.weight.to(DEV), kn.weight.to(DEV), 1e-6) if qk_norm else (None, None, 0.0)
    outs = split_qkv_norm_rope(qkv.to(DEV), Hq, Hkv, D, *norms, cos.to(DEV), sin.to(DEV))
    tol = 1e-5 if dtype == torch.float32 else 2**-5  # bf16: up to four roundings (interpreter truncates them)
    for out, ref in zip(outs, refs):
        out = out.cpu()
        assert out.shape == ref.shape and out.dtype == dtype and out.is_contiguous()
        assert ((out.float() - ref.float()).abs() <= tol * ref.float().abs().clamp_min(1.0)).all()
    assert torch.equal(outs[2].cpu(), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_split_qkv_writes_kv_into_the_pool(dtype):
    """paged=(k_cache, v_cache, slots): k/v rows land in the pool at their slots exactly as the contiguous outputs
    would, slot -1 writes nothing, q is unchanged."""
    from blockspec.layers.rotary import RotaryEmbedding
    from blockspec.layers.triton_qkv import split_qkv_norm_rope

    T, Hq, Hkv, D, S = 6, 4, 2, 32, 20
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(dtype).to(DEV)
    w = torch.randn(D, generator=g).to(dtype).to(DEV)
    cos, sin = RotaryEmbedding(D, 10000.0, None, 512).cos_sin(torch.arange(10, 10 + T), dtype)
    cos, sin = cos.to(DEV), sin.to(DEV)
    slots = torch.tensor([7, 3, -1, 19, 0, -1], device=DEV)
    q, k, v = split_qkv_norm_rope(qkv, Hq, Hkv, D, w, w, 1e-6, cos, sin)
    kc = torch.full((S, Hkv, D), 5.0, dtype=dtype, device=DEV)
    vc = torch.full((S, Hkv, D), 5.0, dtype=dtype, device=DEV)
    q2, k2, v2 = split_qkv_norm_rope(qkv, Hq, Hkv, D, w, w, 1e-6, cos, sin, paged=(kc, vc, slots))
    assert k2 is None and v2 is None and torch.equal(q2, q)
    written = slots[slots >= 0]
    assert torch.equal(kc[written], k[slots >= 0]) and torch.equal(vc[written], v[slots >= 0])
    untouched = torch.ones(S, dtype=torch.bool, device=DEV)
    untouched[written] = False
    assert (kc[untouched] == 5.0).all() and (vc[untouched] == 5.0).all()
