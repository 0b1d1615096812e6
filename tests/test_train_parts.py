"""Drafter-training pieces against their definitions: the block mask (hand-checked), anchors (property test), slot
weights, the chunked loss (against autograd through compute_logits), FlexAttention against SDPA, and the training
forward against the inference draft path (parity)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from dense_cache import DenseCausalAttention, DenseDraftAttention, DenseKVCache
from blockspec.data.shards import TokenSequence
from blockspec.models.dflash import DFlashDraftModel
from blockspec.models.dflash_config import DFlashConfig
from blockspec.train.anchors import default_gamma, sample_anchors, slot_weights
from blockspec.train.attention import BlockTrainingAttention, FlexState, PackedCausalAttention, draft_layout
from blockspec.train.batches import Capacity, build_micro_batch, generator
from blockspec.train.export import draft_config_dict, random_draft
from blockspec.train.forward import TrainingForward
from blockspec.train.loss import BlockLoss
from test_train_common import MASK, random_sequences, tiny_target


def _seq(ids: list[int], mask: list[int]) -> TokenSequence:
    return TokenSequence(torch.tensor(ids), torch.tensor(mask, dtype=torch.bool))


def _rows(text: str) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in row] for row in text.split()])


# Sequence 0: 5 tokens, response from position 2: anchors 2 and 3 (a response token followed by one); the block at 3
# runs past the end (its row at position 5 has no label). Sequence 1: 4 tokens, response 1-2: anchor 1 only.
# Keys: context of seq 0 (positions 0-4), of seq 1 (positions 0-3), then the 9 block rows (seq 0 blocks at positions
# 2,3,4 and 3,4,5, seq 1 block at positions 1,2,3).
HAND_SEQS = [_seq([10, 11, 12, 13, 14], [0, 0, 1, 1, 1]), _seq([20, 21, 22, 23], [0, 1, 1, 0])]
HAND_MASKS = {
    (False, None): """110000000111000000 110000000111000000 110000000111000000
                      111000000000111000 111000000000111000 111000000000111000
                      000001000000000111 000001000000000111 000001000000000111""",
    # causal, window 2: keys with 0 <= q_pos - k_pos < 2
    (True, 2): """010000000100000000 000000000110000000 000000000011000000
                  001000000000100000 000000000000110000 000000000000011000
                  000001000000000100 000000000000000110 000000000000000011""",
    # non-causal, window 2: |q_pos - k_pos| < 2, context still only before the anchor
    (False, 2): """010000000110000000 000000000111000000 000000000011000000
                   001000000000110000 000000000000111000 000000000000011000
                   000001000000000110 000000000000000111 000000000000000011""",
}


def test_block_mask_and_labels_hand_checked():
    w = slot_weights(3, 7.0)
    mb = build_micro_batch(HAND_SEQS, Capacity(64, 64, 3, pad=False), 8, MASK, w, generator(0))
    assert mb.block_anchor.tolist() == [2, 2, 2, 3, 3, 3, 1, 1, 1]
    assert mb.block_pos.tolist() == [2, 3, 4, 3, 4, 5, 1, 2, 3]
    assert mb.block_ids.tolist() == [12, MASK, MASK, 13, MASK, MASK, 21, MASK, MASK]
    assert mb.labels.tolist() == [12, 13, 14, 13, 14, 0, 21, 22, 23]
    # slot 0 is never scored; position 5 is past seq 0's end; seq 1's last label (position 3) is outside the response
    e = math.exp(-1 / 7)
    assert mb.weights.tolist() == pytest.approx([0.0, 1.0, e, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0], rel=1e-6)
    assert mb.loss_rows.tolist() == [1, 2, 4, 7]
    layout = draft_layout(mb, 3)
    for (causal, window), text in HAND_MASKS.items():
        assert torch.equal(layout.dense(causal, window), _rows(text)), (causal, window)


def test_block_stops_at_the_first_label_outside_the_response():
    # response, user turn, response again: anchors 1 and 5 (2 is followed by the user turn, 6 by nothing). The block
    # at 1 runs into the user turn and then the next response: everything from the first user-turn label on is
    # unscored. The block at 5 runs past the end: only its slot 1 has a label.
    seq = TokenSequence(torch.arange(30, 37), torch.tensor([0, 1, 1, 0, 0, 1, 1], dtype=torch.bool))
    w = slot_weights(6, 7.0)
    mb = build_micro_batch([seq], Capacity(64, 64, 6, pad=False), 8, MASK, w, generator(0))
    assert mb.block_anchor.tolist() == [1] * 6 + [5] * 6
    assert mb.weights.tolist() == pytest.approx([0.0, 1.0, 0.0, 0.0, 0.0, 0.0] * 2)
    assert mb.labels.tolist()[6:] == [35, 36, 0, 0, 0, 0]


def test_slot_weights_and_gamma_rule():
    assert [default_gamma(b) for b in (16, 10, 8)] == [7.0, 5.0, 4.0]
    assert default_gamma(12) == pytest.approx(5 + 2 / 3) and default_gamma(4) == 2.0 and default_gamma(2) == 1.0
    w = slot_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1 and torch.allclose(w[1:], torch.exp(-torch.arange(15.0) / 7))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=40), st.integers(2, 8), st.integers(1, 20), st.integers(0, 99))
def test_anchors_stay_inside_the_response(mask_bits, B, N, seed):
    mask = torch.tensor(mask_bits)
    L = len(mask)
    ids = torch.arange(100, 100 + L)
    a = sample_anchors(mask, N, generator(seed))
    eligible = [p for p in range(L - 1) if mask_bits[p] and mask_bits[p + 1]]  # slot 1 is always scored
    assert len(a) == min(N, len(eligible)) and a.tolist() == sorted(set(a.tolist()))
    assert all(p in eligible for p in a.tolist())
    if not len(a):
        return
    mb = build_micro_batch([TokenSequence(ids, mask)], Capacity(64, 64, B, pad=False), N, MASK,
                           slot_weights(B, 4.0), generator(seed))
    rows = mb.loss_rows
    pos = mb.block_pos[rows]
    assert bool((rows % B > 0).all()) and bool(mask[pos].all()) and bool((pos < L).all())
    assert torch.equal(mb.labels[rows], ids[pos])  # same-position labels: slot k predicts x_{a+k}
    assert torch.equal(mb.block_ids[mb.block_pos == mb.block_anchor], ids[a])
    assert bool((mb.weights.view(-1, B)[:, 1] > 0).all())  # every block scores slot 1


def test_chunked_loss_matches_autograd_through_compute_logits():
    cfg = DFlashConfig.from_hf({"hidden_size": 16, "intermediate_size": 8, "num_hidden_layers": 1,
                                "num_attention_heads": 2, "dflash_config": {"output_multiplier": 1.5,
                                                                            "final_logit_softcapping": 3.0}}, "t")
    torch.manual_seed(0)
    draft, head = DFlashDraftModel(cfg, 1), torch.nn.Linear(16, 50, bias=False)
    loss = BlockLoss(cfg, head.weight, compiled=False)
    loss.chunk = 5  # several chunks and a ragged last one
    hidden = torch.randn(23, 16, requires_grad=True)
    rows = torch.tensor([1, 2, 3, 5, 8, 9, 10, 13, 14, 15, 19, 21])
    labels, weights = torch.randint(0, 50, (23,)), torch.rand(23)
    factor = 1 + torch.rand(len(rows))  # per-row factors applied after the forward (the walk weighting's use)
    losses, hits = loss(hidden, rows, labels, weights)
    (losses * factor).sum().backward()
    ours = hidden.grad.clone()
    hidden.grad = None
    logits = draft.compute_logits(hidden[rows], head)
    ref = F.cross_entropy(logits, labels[rows], reduction="none") * weights[rows]
    (ref * factor).sum().backward()
    assert torch.allclose(losses, ref, rtol=1e-5) and torch.allclose(ours, hidden.grad, atol=1e-6)
    assert torch.equal(hits, logits.argmax(-1) == labels[rows])


def _draft(lm, layer_types=("sliding_attention", "full_attention"), window=5, block_size=4):
    cfg = draft_config_dict(lm.config, len(layer_types), block_size, MASK, [0, 2], intermediate_size=48)
    cfg.update(layer_types=list(layer_types), sliding_window=window)
    model = random_draft(cfg, seed=3)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)  # norms away from 1 so they matter
    return model


def _small_batch(lm, num_anchors: int, B: int = 4):
    """A tiny drafter and a micro-batch of three random sequences for forward-level checks."""
    seqs = random_sequences(3, torch.Generator().manual_seed(5), min_len=14, max_len=24)
    cap = Capacity(128, 256, B, pad=False)
    return _draft(lm, block_size=B), seqs, cap, build_micro_batch(seqs, cap, num_anchors, MASK,
                                                                   slot_weights(B, 4.0), generator(1))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("train_parts"))


def test_training_forward_equals_inference_draft_path(target):
    lm, B = target, 4
    draft, seqs, cap, mb = _small_batch(lm, 6, B)
    fwd = TrainingForward(lm.model, draft, [0, 2], cap, "sdpa", compiled=False)
    with torch.no_grad():
        logits = draft.compute_logits(fwd.hidden(mb, fwd.taps(mb)), lm.model.lm_head)
    cfg, dcfg = lm.config, draft.config
    row = 0
    for s, n in enumerate(mb.blocks_per_seq):
        ids = seqs[s].input_ids
        for _ in range(n):
            a = int(mb.block_anchor[row])
            # inference, as spec/single.py does it: prefill taps of positions < a -> draft context cache -> block
            kv = DenseKVCache.allocate(cfg.num_hidden_layers, a, cfg.num_key_value_heads, cfg.head_dim,
                                       torch.float32, torch.device("cpu"))
            ctx = DenseKVCache.allocate(dcfg.num_hidden_layers, a, dcfg.num_key_value_heads, dcfg.head_dim,
                                        torch.float32, torch.device("cpu"))
            pos = torch.arange(a)
            with torch.no_grad():
                taps = lm.model(ids[:a], pos, DenseCausalAttention(kv, pos, a), tap_layers=[0, 2]).taps
                for layer, (k, v) in enumerate(draft.context_kv(taps, pos)):
                    ctx.k[layer], ctx.v[layer] = k, v
                block = torch.tensor([int(ids[a])] + [MASK] * (B - 1))
                bpos = torch.arange(a, a + B)
                h = draft(lm.model.embed_tokens(block), bpos, DenseDraftAttention(ctx, a, bpos))
                ref = draft.compute_logits(h, lm.model.lm_head)
            got = logits[row:row + B]
            assert (got - ref).abs().max() <= 1e-5 * ref.abs().max(), (s, a)
            row += B
    assert row == len(mb.block_ids) and row >= 12


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_matches_sdpa_on_a_padded_batch(target):
    """The FlexAttention path (mask_mod + tile superset) gives the SDPA path's output for every real row; padding
    rows and keys change nothing (eager flex on CPU; tests/test_train_gpu.py runs the compiled kernels)."""
    lm = target
    draft = _draft(lm, ("sliding_attention", "full_attention"), window=6, block_size=8)
    seqs = random_sequences(4, torch.Generator().manual_seed(9), min_len=20, max_len=40)
    gen_args = (MASK, slot_weights(8, 4.0))
    plain = build_micro_batch(seqs, Capacity(160, 40, 8, pad=False), 10, *gen_args, generator(2))
    padded = build_micro_batch(seqs, Capacity(160, 40, 8, pad=True), 10, *gen_args, generator(2))
    assert len(padded.input_ids) == 256 and len(padded.block_ids) == 384
    flex = FlexState(Capacity(160, 40, 8, pad=True), [(True, 6), (False, None)], torch.device("cpu"),
                     compiled=False)
    t_mask, d_masks = flex.load(padded)
    # the tiles a BlockMask lists cover every visible (row, key) pair
    layout = draft_layout(padded, 8)
    for kind in ((True, 6), (False, None)):
        exact = layout.dense(*kind).view(3, 128, 5, 128).any(3).any(1)
        assert not (exact & ~layout.tile_superset(4)).any()
    T, Q = plain.num_tokens, plain.num_blocks * 8
    torch.manual_seed(0)
    q, k, v = torch.randn(256, 4, 16), torch.randn(256, 2, 16), torch.randn(256, 2, 16)
    ref = PackedCausalAttention(plain)(0, q[:T], k[:T], v[:T], 0.25)
    got = PackedCausalAttention(padded, flex, t_mask)(0, q, k, v, 0.25)
    assert torch.allclose(got[:T], ref, atol=1e-5)
    ctx = [(torch.randn(256, 2, 16), torch.randn(256, 2, 16))]
    bq, bk, bv = torch.randn(384, 4, 16), torch.randn(384, 2, 16), torch.randn(384, 2, 16)
    for kind in ((True, 6), (False, None)):
        ref = BlockTrainingAttention(plain, [(ctx[0][0][:T], ctx[0][1][:T])], 8, torch.float32)(
            0, bq[:Q], bk[:Q], bv[:Q], 0.25, *kind)
        got = BlockTrainingAttention(padded, ctx, 8, torch.float32, flex, d_masks)(0, bq, bk, bv, 0.25, *kind)
        assert torch.allclose(got[:Q], ref, atol=1e-5), kind


def test_verification_walk_hand_checked():
    from blockspec.train.anchors import response_starts
    from blockspec.train.walk import walk

    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1], dtype=torch.bool)
    assert response_starts(mask) == [2, 10]
    anchors = [2, 3, 4, 5, 6, 7, 10, 11]  # a block at every response position but the last of each answer
    accepted = [2, 0, 0, 1, 0, 0, 0, 5]
    # first answer: 2 accepts 2 -> 5 accepts 1 -> 7 accepts 0 -> 8: no block (user turn); second: 10 -> 11 -> 17
    assert walk(anchors, accepted, [2, 10]) == [0, 3, 5, 6, 7]
    assert walk(anchors, accepted, [3]) == [1, 2, 3, 5]  # another start, another path
    assert walk([], [], [0]) == []


def _host_walk(mb, seqs, accepted: list[int], B: int) -> list[int]:
    """The blocks (micro-batch indices) that walk() visits in each sequence of a micro-batch, from its responses'
    starts."""
    from blockspec.train.anchors import response_starts
    from blockspec.train.walk import walk

    anchors, seq_of = mb.block_anchor[: mb.num_blocks * B: B].tolist(), mb.block_seq[: mb.num_blocks * B: B].tolist()
    out = []
    for s, seq in enumerate(seqs):
        idx = [j for j in range(mb.num_blocks) if seq_of[j] == s]
        out += [idx[k] for k in walk([anchors[j] for j in idx], [accepted[j] for j in idx],
                                     response_starts(seq.loss_mask))]
    return out


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 8), st.booleans())
def test_device_walk_visits_what_the_host_walk_visits(seed, B, pad):
    from blockspec.train.walk import visited_blocks

    gen = torch.Generator().manual_seed(seed)
    seqs = random_sequences(5, gen, min_len=8, max_len=40)  # some with a user turn inside: two walks
    n_anchors = sum(int((s.loss_mask[:-1] & s.loss_mask[1:]).sum()) for s in seqs)
    cap = Capacity(256, max(n_anchors, 1) + 7, B, pad)
    mb = build_micro_batch(seqs, cap, 1000, MASK, slot_weights(B, 4.0), generator(seed))
    n = mb.num_blocks
    # any acceptance lengths the blocks allow: at most the run of scored slots (a block never accepts past its
    # response, as in the training forward, where unscored rows count as misses)
    scored = (mb.weights[: n * B].view(n, B)[:, 1:] > 0).long().cumprod(1).sum(1)
    accepted = torch.minimum(torch.randint(0, B, (n,), generator=gen), scored)
    got = visited_blocks(mb, accepted, B, cap.tokens)
    want = _host_walk(mb, seqs, accepted.tolist(), B)
    assert want and len(set(want)) == len(want)  # positions only grow: no block is stepped on twice
    assert set(torch.nonzero(got).flatten().tolist()) == set(want)


def test_walk_weight_adds_the_visited_blocks_losses_once_more(target):
    lm, B = target, 4
    draft, seqs, cap, mb = _small_batch(lm, 100, B)
    plain = TrainingForward(lm.model, draft, [0, 2], cap, "sdpa", compiled=False)
    walked = TrainingForward(lm.model, draft, [0, 2], cap, "sdpa", compiled=False, walk_weight=1.0)
    with torch.no_grad():
        r0, r1 = plain(mb), walked(mb)
        losses, _ = plain.loss(plain.hidden(mb, plain.taps(mb)), mb.loss_rows, mb.labels, mb.weights)
    assert torch.equal(r0.block_accepted, r1.block_accepted)
    visited = _host_walk(mb, seqs, r0.block_accepted.long().tolist(), B)
    extra = sum(float(losses[(mb.loss_rows // B) == j].sum()) for j in visited)
    assert len(visited) >= 3 and extra > 0
    assert float(r1.loss_sum) == pytest.approx(float(r0.loss_sum) + extra, rel=1e-5)
    assert float(r1.plain_loss_sum) == pytest.approx(float(r0.loss_sum), rel=1e-6)  # what the log shows


@pytest.mark.parametrize("W, N", [(1.0, 5), (2.5, 12)])
def test_opening_weight_scales_the_blocks_anchored_in_a_responses_opening(target, W, N):
    from blockspec.train.anchors import response_starts

    lm, B = target, 4
    draft, seqs, cap, mb = _small_batch(lm, 100, B)
    plain = TrainingForward(lm.model, draft, [0, 2], cap, "sdpa", compiled=False)
    scaled = TrainingForward(lm.model, draft, [0, 2], cap, "sdpa", compiled=False, opening_weight=W, opening_tokens=N)
    with torch.no_grad():
        r0, r1 = plain(mb), scaled(mb)
        losses, _ = plain.loss(plain.hidden(mb, plain.taps(mb)), mb.loss_rows, mb.labels, mb.weights)
    # the offset from the host's own definition: the anchor minus the last response start at or before it
    n_opening, want = 0, 0.0
    for row, loss in zip(mb.loss_rows.tolist(), losses.tolist()):
        a, s = int(mb.block_anchor[row]), int(mb.block_seq[row])
        offset = a - max(p for p in response_starts(seqs[s].loss_mask) if p <= a)
        assert int(mb.block_offset[row]) == offset
        n_opening += offset < N
        want += loss * (1.0 + W if offset < N else 1.0)
    assert n_opening >= 3 and n_opening < len(losses)  # both kinds of rows are in the batch
    assert float(r1.loss_sum) == pytest.approx(want, rel=1e-5)
    assert float(r1.plain_loss_sum) == pytest.approx(float(r0.loss_sum), rel=1e-6)


@pytest.mark.parametrize("p, B", [(0.5, 4), (1.0, 4), (1.0, 2)])
def test_prefix_weight_scales_the_slots_past_a_miss(target, p, B):
    lm = target
    draft, _, cap, mb = _small_batch(lm, 100, B)
    plain = TrainingForward(lm.model, draft, [0, 2], cap, "sdpa", compiled=False)
    scaled = TrainingForward(lm.model, draft, [0, 2], cap, "sdpa", compiled=False, prefix_weight=p)
    with torch.no_grad():
        r0, r1 = plain(mb), scaled(mb)
        losses, hits = plain.loss(plain.hidden(mb, plain.taps(mb)), mb.loss_rows, mb.labels, mb.weights)
    hit = dict(zip(mb.loss_rows.tolist(), hits.tolist()))  # row -> hit; unscored rows count as misses
    want, past_miss = 0.0, 0
    for row, loss in zip(mb.loss_rows.tolist(), losses.tolist()):
        start = row - row % B
        reached = all(hit.get(start + j, False) for j in range(1, row % B))
        past_miss += not reached
        want += loss * (1.0 if reached else 1.0 - p)
    assert torch.equal(r0.block_accepted, r1.block_accepted)
    assert float(r1.loss_sum) == pytest.approx(want, rel=1e-5)
    assert float(r1.plain_loss_sum) == pytest.approx(float(r0.loss_sum), rel=1e-6)
    if B > 2:  # with one drafted slot per block nothing lies past a miss
        assert past_miss >= 3 and float(r1.loss_sum) < float(r0.loss_sum)
