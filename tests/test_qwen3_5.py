"""The Qwen3.5 / Qwen3.6 hybrid families (blockspec/models/qwen3_5.py, qwen3_5_moe.py, gated_deltanet.py,
hybrid_state.py; layers/gated_delta.py, short_conv.py, gated_norm.py) against transformers' Qwen3_5ForCausalLM and
Qwen3_5MoeForCausalLM on tiny random configs, fp32 on CPU: logits and taps from a safetensors directory through
load_model, over the paged pool and state slots (batched prefill chunks, then decode); the ConditionalGeneration
checkpoint form; the delta rule's chunked form against its recurrent form; exact rollback of a verify block (its
rows' inputs kept, the replay commit); bad hybrid configs failing in one line naming the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockspec.errors import ModelLoadError
from blockspec.layers.gated_delta import chunked_rule, gated_delta_rule, l2_normalize, recurrent_rule
from blockspec.layers.moe import Router
from blockspec.layers.short_conv import causal_conv, window_after
from blockspec.loading.loader import LoadConfig, load_model
from dense_cache import DenseCausalAttention, DenseKVCache
from hybrid_utils import VOCAB, PagedRunner, assert_matches_transformers, make_hf, prefill_decode, save

CPU = LoadConfig(device="cpu", with_tokenizer=False)
FULL, LIN = "full_attention", "linear_attention"
# (seed, moe, config overrides)
CONFIGS = {
    "dense": (0, False, {}),
    # q/k/v/o biases, tied embeddings, half the head rotated, a layer pattern of its own, one value head per key head,
    # a conv kernel of 2
    "dense-variant": (1, False, dict(attention_bias=True, tie_word_embeddings=True, num_hidden_layers=5,
                                     layer_types=[FULL, LIN, LIN, FULL, LIN], linear_num_key_heads=4,
                                     linear_conv_kernel_dim=2,
                                     rope_parameters={"rope_type": "default", "rope_theta": 5e4,
                                                      "partial_rotary_factor": 0.5})),
    "moe": (2, True, {}),
    "moe-tied": (3, True, dict(tie_word_embeddings=True, num_experts_per_tok=3, layer_types=[LIN, FULL, LIN, FULL])),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    seed, moe, overrides = CONFIGS[request.param]
    hf = make_hf(seed, moe=moe, **overrides)
    return hf, load_model(str(save(hf, tmp_path_factory.mktemp(request.param))), CPU)


def test_logits_and_taps_match_transformers(pair):
    hf, lm = pair
    cfg = hf.config
    assert [l.linear for l in lm.model.layers] == [t == LIN for t in cfg.layer_types]
    assert lm.model.num_kv_layers == cfg.layer_types.count(FULL)
    assert lm.model.rotary.inv_freq.shape[0] * 2 == int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"])
    assert_matches_transformers(lm.model, hf)


def test_whole_sequence_forward_without_state(pair):
    """state=None: the rows are one sequence from position 0 (taps for training data, parity checks): the paged
    path's numbers; continuing a sequence, or several sequences, without a RecurrentBatch is refused."""
    _, lm = pair
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(2))
    cfg = lm.config
    cache = DenseKVCache.allocate(max(lm.model.num_kv_layers, 1), 40, cfg.num_key_value_heads, cfg.head_dim,
                                  torch.float32, torch.device("cpu"))
    pos = torch.arange(40)
    with torch.no_grad():
        whole = lm.model(ids, pos, DenseCausalAttention(cache, pos, 40)).logits
    paged, _ = PagedRunner(lm.model, 1, 40).forward([(0, ids.tolist())])
    assert (whole - paged.logits).abs().max().item() <= 1e-6
    for p in (pos[5:8], torch.tensor([0, 1, 0, 1])):  # a continuation; two sequences
        with pytest.raises(ValueError, match="needs the batch's RecurrentBatch"):
            lm.model(ids[:len(p)], p, DenseCausalAttention(cache, p, 8))


# ---- the delta rule and the conv on their own --------------------------------------------------------------------


def rule_inputs(B: int, L: int, H: int, Dk: int, Dv: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(B, L, H, Dk, generator=g)) * Dk ** -0.5
    k = l2_normalize(torch.randn(B, L, H, Dk, generator=g))
    v = torch.randn(B, L, H, Dv, generator=g)
    decay = -torch.rand(B, L, H, generator=g) * 4  # strong decays too: exp(-4) a row
    beta = torch.rand(B, L, H, generator=g)
    return q, k, v, decay, beta, torch.randn(B, H, Dk, Dv, generator=g)


@pytest.mark.parametrize("L", [1, 5, 64, 150])
def test_chunked_form_equals_recurrent_form(L):
    q, k, v, g, beta, s0 = rule_inputs(2, L, 3, 8, 12, L)
    out_r, final_r = recurrent_rule(q, k, v, g, beta, s0)
    out_c, final_c = chunked_rule(q, k, v, g, beta, s0)
    assert torch.allclose(out_c, out_r, rtol=1e-5, atol=1e-5) and torch.allclose(final_c, final_r, rtol=1e-5, atol=1e-5)
    assert torch.equal(s0, rule_inputs(2, L, 3, 8, 12, L)[-1])  # the initial state is not written
    # a run split in two, the second part from the first's state: the same as in one go
    cut = L // 2
    a, s_mid = chunked_rule(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], s0)
    b, s_end = chunked_rule(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], s_mid)
    assert torch.allclose(torch.cat([a, b], 1), out_r, rtol=1e-5, atol=1e-5)
    assert torch.allclose(s_end, final_r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("L", [1, 5, 16])
def test_replay_with_neutral_rows_is_the_prefix_state_bit_for_bit(L):
    """The rollback's premise: rows with g = 0 and beta = 0 leave the state exactly as it is, so all L rows replayed
    with the rows past n so neutralized give bit for bit the state after rows 0..n alone (per sequence, n differing
    between the two), and gated_delta_rule (key heads, expanded to the value heads) is the reference form."""
    q, k, v, g, beta, s0 = rule_inputs(2, L, 4, 8, 12, L)
    for n in {0, L // 2, L - 1}:
        ns = torch.tensor([n, L - 1 - n])
        live = (torch.arange(L)[None] <= ns[:, None])[..., None]
        out, replayed = recurrent_rule(q, k, v, torch.where(live, g, 0.0), torch.where(live, beta, 0.0), s0,
                                       outputs=False)
        assert out is None
        for b, m in enumerate(ns.tolist()):
            alone = recurrent_rule(q[b:b + 1, :m + 1], k[b:b + 1, :m + 1], v[b:b + 1, :m + 1], g[b:b + 1, :m + 1],
                                   beta[b:b + 1, :m + 1], s0[b:b + 1])[1]
            assert torch.equal(replayed[b:b + 1], alone), (n, b)
    # two value heads per key head: the same as the reference form on keys repeated by hand
    qk = q[:, :, ::2], k[:, :, ::2]
    got = gated_delta_rule(*qk, v, g, beta, s0, chunked=False)
    want = recurrent_rule(qk[0].repeat_interleave(2, 2), qk[1].repeat_interleave(2, 2), v, g, beta, s0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_conv_window_continues_across_calls():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 11, 6, generator=g), torch.randn(6, 1, 4, generator=g)
    zeros = torch.zeros(2, 6, 3)
    whole, last = causal_conv(x, zeros, w)
    a, win = causal_conv(x[:, :4], zeros, w)
    b, end = causal_conv(x[:, 4:], win, w)
    assert torch.allclose(torch.cat([a, b], 1), whole, atol=1e-6) and torch.equal(end, last)
    # the window after row n of a block (n per sequence): the last 3 inputs through row n, as a run stopped there
    n = torch.tensor([1, 5])
    after = window_after(win, x[:, 4:], n)
    for i, m in enumerate(n.tolist()):
        assert torch.equal(after[i], causal_conv(x[i:i + 1, 4:5 + m], win[i:i + 1], w)[1][0])
    assert torch.equal(window_after(win, x[:, 4:], torch.tensor([0, 0]))[:, :, :2], win[:, :, 1:])  # old inputs too
    y0, _ = causal_conv(x[:, :1], zeros, w)
    assert torch.allclose(y0[:, 0], torch.nn.functional.silu(x[:, 0] * w[:, 0, -1]), atol=1e-6)  # zeros before


# ---- exact rollback: a verify block's state after row n == decoding its first n + 1 tokens one by one --------------


@pytest.fixture(scope="module")
def dense_lm(tmp_path_factory):
    hf = make_hf(4)
    return hf, load_model(str(save(hf, tmp_path_factory.mktemp("dense"))), CPU)


def test_verify_rows_roll_back_exactly(dense_lm):
    """Two sequences verify K + 1 = 5 rows each (their rows' inputs kept, their slots untouched) beside a third's
    plain decode row, in one forward. For each choice of accepted rows, the replay commit (model.commit_state) puts
    into each verify slot the state after its row n, which equals (every linear layer's conv window and delta-rule
    state) the state after decoding rows 0..n one at a time; the plain row's slot holds its new state; and decoding
    on from the committed state gives HF's logits. Within 1e-6, not bit for bit: the projections' GEMMs round a
    5-row block and a 1-row step apart by an ulp (the replay's own arithmetic is exact:
    test_replay_with_neutral_rows_is_the_prefix_state_bit_for_bit)."""
    hf, lm = dense_lm
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (20, 33, 7)]
    block = [torch.randint(0, VOCAB, (5,), generator=g).tolist() for _ in range(2)]
    ver = PagedRunner(lm.model, 3, 64, keep_seqs=3, keep_rows=5)
    ref = PagedRunner(lm.model, 3, 64)
    for r in (ver, ref):
        r.forward([(i, p) for i, p in enumerate(prompts)])
    ssm0 = [ver.slot_state(s)[1] for s in (0, 1)]
    out, rb = ver.forward([(0, block[0]), (1, block[1]), (2, [3])], keep=[True, True, False])
    # the reference: the same rows decoded one at a time, the state of every slot after each
    after: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[], []]
    ref_logits = [[], []]
    for r in range(5):
        o, _ = ref.forward([(0, [block[0][r]]), (1, [block[1][r]])] + ([(2, [3])] if r == 0 else []))
        for s in (0, 1):
            after[s].append(ref.slot_state(s))
            ref_logits[s].append(o.logits[s])
    assert torch.allclose(out.logits[:5], torch.stack(ref_logits[0]), atol=1e-6)
    assert torch.allclose(out.logits[5:10], torch.stack(ref_logits[1]), atol=1e-6)
    assert (ver.slot_state(2)[0] - ref.slot_state(2)[0]).abs().max().item() <= 1e-6  # the plain row's, in its slot
    assert torch.allclose(ver.slot_state(2)[1], ref.slot_state(2)[1], atol=1e-6)
    before = (ver.state.conv.clone(), ver.state.ssm.clone())
    assert all(torch.equal(ver.slot_state(s)[1], ref_before) for s, ref_before in ((0, ssm0[0]), (1, ssm0[1])))
    for n0, n1 in [(0, 4), (2, 1), (4, 0), (3, 3)]:
        ver.state.conv.copy_(before[0])
        ver.state.ssm.copy_(before[1])
        ver.commit(rb, [n0, n1, 0])
        for s, n in ((0, n0), (1, n1)):
            conv, ssm = ver.slot_state(s)
            assert (conv - after[s][n][0]).abs().max().item() <= 1e-6, (s, n)
            assert (ssm - after[s][n][1]).abs().max().item() <= 1e-6, (s, n)
        assert torch.equal(ver.slot_state(2)[0], before[0][:, 2])  # not a verify sequence: untouched by commit
    # decode on from the last commit (3 accepted drafts each): HF's logits over prompt + block[:4] + next
    nxt = [11, 12]
    for s in (0, 1):
        ver.lens[s] += 4
    o, _ = ver.forward([(0, [nxt[0]]), (1, [nxt[1]])])
    for s in (0, 1):
        with torch.no_grad():
            want = hf(torch.tensor([prompts[s] + block[s][:4] + [nxt[s]]])).logits[0, -1]
        assert (o.logits[s] - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_keep_rows_beyond_the_scratch_is_refused(dense_lm):
    _, lm = dense_lm
    runner = PagedRunner(lm.model, 1, 32, keep_seqs=1, keep_rows=3)
    runner.forward([(0, [1, 2, 3])])
    with pytest.raises(ValueError, match="keeps 3 rows of 1 sequences"):
        runner.forward([(0, [4, 5, 6, 7])], keep=[True])


# ---- checkpoint forms --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_conditional_generation_checkpoint_loads(tmp_path, capfd, moe):
    """A vision-language checkpoint (config.json's text_config, model.language_model.*, model.visual.* and mtp.*
    tensors) loads its language model, saying once on stderr that vision inputs are not supported; its text logits are HF's."""
    hf = make_hf(5, moe=moe, conditional=True)
    d = save(hf, tmp_path / "cg")
    assert "text_config" in json.loads((d / "config.json").read_text())
    tensors = load_file(str(d / "model.safetensors"))  # the hub's checkpoints carry a multi-token-prediction head too
    assert any(k.startswith("model.visual.") for k in tensors)
    save_file({**tensors, "mtp.fc.weight": torch.zeros(64, 128)}, str(d / "model.safetensors"))
    capfd.readouterr()
    lm = load_model(str(d), CPU)
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "image and video inputs are not supported" in err[0], err
    ids = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(1))
    (logits, _), = prefill_decode(lm.model, [ids])
    with torch.no_grad():
        want = hf(input_ids=ids[None]).logits[0]
    assert (logits - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_stacked_expert_banks_load(tmp_path):
    """transformers 5 keeps each layer's experts stacked (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]); a checkpoint saved from that state dict loads as the per-expert one does."""
    hf = make_hf(6, moe=True)
    d = save(hf, tmp_path / "stacked")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(d / "model.safetensors"))
    assert_matches_transformers(load_model(str(d), CPU).model, hf)


def test_bf16_runs_close_to_fp32(dense_lm, tmp_path):
    hf, lm = dense_lm
    d = save(hf, tmp_path / "m")
    lm16 = load_model(str(d), LoadConfig(device="cpu", dtype="bfloat16", with_tokenizer=False))
    ids = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(3))
    (f32, _), = prefill_decode(lm.model, [ids])
    (b16, _), = prefill_decode(lm16.model, [ids])
    assert b16.dtype == torch.float32 and (b16 - f32).abs().max().item() < 0.1


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_cpu_packed_variant(tmp_path, moe):
    """cpu_packed (the linears packed for oneDNN, fp32): the reference's numbers; the one-row shared-expert gate is a
    Router, as the router, which the platform passes leave unpacked and unquantized."""
    d = str(save(make_hf(7, moe=moe), tmp_path / "m"))
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(4))
    (ref, _), = prefill_decode(load_model(d, CPU).model, [ids])
    (packed, _), = prefill_decode(load_model(d, LoadConfig(device="cpu", with_tokenizer=False,
                                                           cpu_packed=True)).model, [ids])
    assert (packed - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    if moe:  # the platform passes swap exact nn.Linears only (cpu_quant's kernels take 8+ rows, this has one)
        assert type(load_model(d, CPU).model.layers[0].mlp.shared_expert_gate) is Router


# ---- bad configs: one line naming the field ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad")
    return {"dense": save(make_hf(0), root / "dense"), "moe": save(make_hf(0, moe=True), root / "moe"),
            "cg": save(make_hf(0, conditional=True), root / "cg")}


ROPE = {"rope_type": "default", "rope_theta": 1e4}


@pytest.mark.parametrize("kind,edit,needle", [
    ("dense", {"layer_types": [LIN, LIN, FULL]}, "field 'layer_types' must list 'linear_attention' or "
                                                  "'full_attention' for each of the num_hidden_layers=4 layers"),
    ("dense", {"layer_types": [LIN, "sliding_attention", LIN, FULL]}, "field 'layer_types' must list"),
    ("dense", {"linear_num_value_heads": 3}, "field 'linear_num_value_heads' must be a multiple of "
                                             "linear_num_key_heads=2, got 3"),
    ("dense", {"linear_conv_kernel_dim": 0}, "field 'linear_conv_kernel_dim' must be an integer >= 1, got 0"),
    ("dense", {"linear_key_head_dim": "8"}, "field 'linear_key_head_dim' must be an integer >= 1, got '8'"),
    ("dense", {"rope_parameters": {**ROPE, "partial_rotary_factor": 0}}, "field 'partial_rotary_factor' must be in"),
    ("dense", {"rope_parameters": ROPE, "partial_rotary_factor": 1.5}, "field 'partial_rotary_factor' must be in"),
    ("dense", {"rope_parameters": {**ROPE, "partial_rotary_factor": 0.1}}, "head_dim=16, got 0.1"),
    ("dense", {"attn_output_gate": False}, "field 'attn_output_gate' is false"),
    ("dense", {"hidden_act": "gelu"}, "field 'hidden_act' must be 'silu' for Qwen3_5ForCausalLM, got 'gelu'"),
    ("dense", {"layer_types": None, "full_attention_interval": 0}, "field 'full_attention_interval' must be an "
                                                                   "integer >= 1, got 0"),
    ("moe", {"num_experts_per_tok": 9}, "field 'num_experts_per_tok' must be at most num_experts=8, got 9"),
    ("moe", {"shared_expert_intermediate_size": None}, "required field 'shared_expert_intermediate_size' is missing"),
    ("cg", {"text_config.linear_num_value_heads": 5}, "field 'linear_num_value_heads' must be a multiple of "),
])
def test_bad_hybrid_configs_fail_in_one_line(ckpts, tmp_path, kind, edit, needle):
    d = Path(shutil.copytree(ckpts[kind], tmp_path / "m"))
    cfg = json.loads((d / "config.json").read_text())
    for key, value in edit.items():
        where, _, name = key.rpartition(".")
        target = cfg[where] if where else cfg
        if value is None:
            target.pop(name, None)
        else:
            target[name] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as e:
        load_model(str(d), CPU)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg and str(d) in msg, msg
