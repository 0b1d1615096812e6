"""Accepting a drafted block against the target's verify logits: greedy and lossless sampling, batched, on device.

All functions are pure tensor code (no host sync): randomness comes in as pre-drawn noise (blockspec.rng, keyed by
the request's seed and token positions), so a request's samples do not depend on the rest of the batch. Output convention for a batch of B blocks with K drafts each:
  out_tokens [B, K+1]: d_1..d_n then the correction/bonus token, -1 after it
  num_accepted [B]: n, the number of accepted drafts (tokens emitted = n + 1)"""

from __future__ import annotations

import torch


def _emit(drafts: torch.Tensor, num_accepted: torch.Tensor, correction: torch.Tensor) -> torch.Tensor:
    B, K = drafts.shape
    idx = torch.arange(K + 1, device=drafts.device)[None, :]
    padded = torch.cat([drafts, drafts.new_full((B, 1), -1)], dim=1)
    out = torch.where(idx < num_accepted[:, None], padded, torch.full_like(padded, -1))
    return out.scatter(1, num_accepted[:, None], correction[:, None])


def accept_tokens(drafts: torch.Tensor, target_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts [B, K], target_tokens [B, K+1] (the target's own choice at each verify row) -> (out_tokens, n).
    A draft is accepted while it equals the target's choice at the row before it; the target's choice at the first
    mismatch (or after the last draft) is emitted. With argmax choices this is greedy verification; with choices
    sampled from p it is exact rejection sampling for a one-hot (argmax) draft distribution."""
    match = drafts == target_tokens[:, :-1]
    n = match.long().cumprod(dim=1).sum(dim=1)
    correction = target_tokens.gather(1, n[:, None])[:, 0]
    return _emit(drafts, n, correction), n


def accept_probabilistic(
    drafts: torch.Tensor,  # [B, K] sampled from q
    p: torch.Tensor,  # [B, K+1, V] target's processed distribution at each verify row
    q: torch.Tensor,  # [B, K, V] draft's processed distribution for each draft
    uniform: torch.Tensor,  # [B, K] U(0,1)
    exp_noise: torch.Tensor,  # [B, V] Exp(1), for the correction sample
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling: accept d_i with prob min(1, p(d_i)/q(d_i)); at the first rejection sample from
    normalize(max(p - q, 0)); if all K are accepted sample the bonus from p at row K."""
    B, K = drafts.shape
    p_d = p[:, :K].gather(2, drafts[..., None])[..., 0]
    q_d = q.gather(2, drafts[..., None])[..., 0]
    ok = uniform * q_d < p_d
    n = ok.long().cumprod(dim=1).sum(dim=1)
    q_pad = torch.cat([q, q.new_zeros(B, 1, q.shape[-1])], dim=1)  # row K: residual is p itself
    rows = n[:, None, None].expand(B, 1, p.shape[-1])
    p_n, q_n = p.gather(1, rows)[:, 0], q_pad.gather(1, rows)[:, 0]
    residual = (p_n - q_n).clamp_min(0)
    total = residual.sum(-1, keepdim=True)
    # p == q exactly leaves no residual mass; rejection then has probability 0, so p_n is a safe fallback
    residual = torch.where(total > 0, residual / total.clamp_min(1e-30), p_n)
    correction = (residual / exp_noise.clamp_min(1e-30)).argmax(dim=-1)
    return _emit(drafts, n, correction), n
