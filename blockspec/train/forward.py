"""One training forward of a micro-batch: frozen target pass (taps of every position) -> draft context K/V of every
position -> all blocks through the draft's own layers -> weighted CE through the target's frozen lm_head (and, for a
DFlash 2 drafter, its candidate selector's loss: train/selector_loss.py).

Nothing here re-implements the draft: context_kv, the layers and the final norm are DFlashDraftModel's, driven with
a training DraftAttentionFn, so training and inference cannot drift apart
(tests/test_train_parts.py, test_training_forward_equals_inference_draft_path)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from blockspec.models.dflash import DFlashDraftModel
from blockspec.models.dflash2 import DFlash2DraftModel
from blockspec.train.attention import BlockTrainingAttention, FlexState, PackedCausalAttention
from blockspec.train.batches import Capacity, MicroBatch
from blockspec.train.compiled_draft import CompiledDraftPass
from blockspec.train.loss import BlockLoss
from blockspec.train.selector_loss import selector_loss
from blockspec.train.target_pass import shared_kv_layers, state_kwargs
from blockspec.train.walk import visited_blocks


@dataclass
class ForwardResult:
    loss_sum: torch.Tensor  # scalar: sum over scored rows of w * CE x walk / prefix / opening factors (differentiable)
    plain_loss_sum: torch.Tensor  # scalar, detached: the same without those factors (logged: comparable across them)
    hits: torch.Tensor  # [R] bool: the draft == label at each scored row (DFlash 2: the selector's teacher-forced pick)
    slots: torch.Tensor  # [R] block slot (1..B-1) of each scored row
    accepted: torch.Tensor  # scalar: sum over blocks of the leading run of hits (what verification would accept)
    block_accepted: torch.Tensor  # [num_blocks]: that leading run per real block
    # DFlash 2, scalars, detached: the selector's w * CE (unscaled), and the weight of the rows whose label is one of
    # the candidates (the only rows with a selector loss)
    selector_loss_sum: torch.Tensor | None = None
    selector_weight: torch.Tensor | None = None


class TrainingForward:
    """target: the loaded target module (frozen here); draft: the model being trained. attention "flex" needs a
    padded capacity (Capacity.pad) and CUDA for speed; "sdpa" is exact, one sequence at a time. draft_backend: run
    the draft layers under torch.compile with this backend (train/compiled_draft.py); None: eager."""

    def __init__(self, target: nn.Module, draft: DFlashDraftModel, tap_layers: list[int], cap: Capacity,
                 attention: str, compiled: bool, walk_weight: float = 0.0, draft_backend: str | None = None,
                 distill: float = 0.0, prefix_weight: float = 0.0, opening_weight: float = 0.0,
                 opening_tokens: int = 64, selector_weight: float = 1.0) -> None:
        self.target, self.draft, self.tap_layers, self.cap = target, draft, tap_layers, cap
        self.walk_weight, self.prefix_weight = walk_weight, prefix_weight
        self.opening_weight, self.opening_tokens = opening_weight, opening_tokens
        target.requires_grad_(False)
        self.shared_kv = shared_kv_layers(target)
        self.device = target.embed_tokens.weight.device
        cuda = self.device.type == "cuda"
        # bf16 autocast on CUDA (fp32 master weights); exact fp32 on CPU
        self.dtype = torch.bfloat16 if cuda else torch.float32
        cfg = draft.config
        kinds = sorted({(c, w) for c, w in zip(cfg.layer_causal, cfg.layer_window)}, key=str)
        self.flex = FlexState(cap, kinds, self.device, compiled=compiled) if attention == "flex" else None
        # DFlash 2: the block loss also hands back each scored row's candidates for the selector's loss
        self.selector = draft.candidate_selector if isinstance(draft, DFlash2DraftModel) else None
        self.selector_weight = selector_weight
        top_k = draft.config.selector_top_k if isinstance(draft, DFlash2DraftModel) else 0
        self.loss = BlockLoss(cfg, target.lm_head.weight, compiled=compiled, distill=distill, top_k=top_k)
        self.draft_pass = CompiledDraftPass(draft, draft_backend) if draft_backend else draft

    @torch.no_grad()
    def target_pass(self, mb: MicroBatch, block_mask=None) -> tuple[torch.Tensor, torch.Tensor]:
        """([T, num_taps * H] the target's residual streams after the tapped layers, [T, H] its final-normed hidden
        states), every position."""
        no_logits = torch.zeros(0, dtype=torch.long, device=self.device)
        attn = PackedCausalAttention(mb, self.flex, block_mask, self.shared_kv)
        out = self.target(mb.input_ids, mb.positions, attn, tap_layers=self.tap_layers, logit_rows=no_logits,
                          **state_kwargs(self.target, mb))
        return out.taps, out.hidden

    def target_only(self, mb: MicroBatch) -> None:
        """The target pass alone, its result unused: with FSDP a rank that has no micro-batch left in a step still
        takes part in every layer's all-gather (train/fsdp.py)."""
        self.target_pass(mb, self.flex.load(mb)[0] if self.flex is not None else None)

    def taps(self, mb: MicroBatch, block_mask=None) -> torch.Tensor:
        return self.target_pass(mb, block_mask)[0]

    def hidden(self, mb: MicroBatch, taps: torch.Tensor, block_masks: dict | None = None) -> torch.Tensor:
        """[Q, H] final-normed draft hidden state of every block row."""
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.device.type == "cuda"):
            ctx_kv = self.draft.context_kv(taps.to(self.dtype), mb.positions)
            with torch.no_grad():
                # in the compute dtype, so the residual stream never matches the fp32 norm weights' dtype (on CUDA
                # RMSNorm takes a forward-only kernel when they match)
                embeds = self.target.embed_tokens(mb.block_ids).to(self.dtype)
            attn = BlockTrainingAttention(mb, ctx_kv, self.cap.block_size, self.dtype, self.flex, block_masks)
            # rows = B: every block's own rows (DFlash 2's convolutions run along each block alone)
            return self.draft_pass(embeds, mb.block_pos, attn, self.cap.block_size)

    def __call__(self, mb: MicroBatch) -> ForwardResult:
        target_mask, draft_masks = self.flex.load(mb) if self.flex is not None else (None, None)
        taps, target_hidden = self.target_pass(mb, target_mask)
        hidden = self.hidden(mb, taps, draft_masks)
        # distillation: the target's own distribution over each label (train/loss.py, soft_ce_chunk)
        target_h = target_hidden[mb.label_src[mb.loss_rows]] if self.loss.distill > 0 else None
        losses, hits, cand = self.loss.scored(hidden, mb.loss_rows, mb.labels, mb.weights, target_h)
        plain = losses.detach().sum()
        sel = found = None
        if self.selector is not None:
            assert cand is not None
            rows = mb.loss_rows  # slots >= 1, so row - 1 is the same block's previous slot (slot 0 is labelled x_a)
            # in fp32, as the inference pass scores (the projection is [rows, rank]: cheap)
            sel, hits, found = selector_loss(self.selector, hidden[rows].float(), mb.labels[rows - 1],
                                             mb.labels[rows], *cand, mb.weights[rows])
        B, n = self.cap.block_size, mb.num_blocks
        # hits laid back out as [blocks, B] (unscored rows count as misses, so a block stops at the response end):
        # the training-side acceptance length, comparable with the engine's tau on similar prompts
        grid = torch.zeros(len(mb.block_ids), dtype=torch.float32, device=hits.device)
        grid[mb.loss_rows] = hits.float()
        run = grid[: n * B].view(-1, B)[:, 1:].cumprod(1)  # [n, B - 1]: slots 1..k all hit; real blocks come first
        per_block = run.sum(1)
        scale = torch.ones_like(losses)  # the per-row factors below weigh the block and the selector loss alike
        if self.prefix_weight > 0:
            # verification reaches slot k only if slots 1..k-1 were accepted: past a miss, a slot's loss buys no tau
            # for this block (the exp-decay slot weights price that in on average, this per block)
            reached = torch.cat([run.new_ones(n, 2), run[:, :-1]], 1).flatten()  # [n * B], slots 0 and 1: 1
            scale = scale * (1.0 - self.prefix_weight * (1.0 - reached[mb.loss_rows]))
        if self.walk_weight > 0:
            # the blocks verification would visit on this text weigh 1 + walk_weight: the engine's tau is the mean
            # acceptance over exactly those (train/walk.py), which start right after a draft the drafter got wrong
            visited = visited_blocks(mb, per_block.long(), B, self.cap.tokens)
            scale = scale * (1.0 + self.walk_weight * visited[mb.loss_rows // B].float())
        if self.opening_weight > 0:
            # blocks anchored in a response's first opening_tokens tokens weigh 1 + opening_weight: an answer's
            # opening is where the drafter has least to go on and is accepted least (docs/training.md, session 14)
            opening = mb.block_offset[mb.loss_rows] < self.opening_tokens
            scale = scale * (1.0 + self.opening_weight * opening.float())
        total = (losses * scale).sum()
        if sel is not None:
            total = total + self.selector_weight * (sel * scale).sum()
        if sel is None or found is None:
            return ForwardResult(total, plain, hits, mb.loss_rows % B, per_block.sum(), per_block)
        return ForwardResult(total, plain, hits, mb.loss_rows % B, per_block.sum(), per_block, sel.detach().sum(),
                             (mb.weights[mb.loss_rows] * found).sum())
