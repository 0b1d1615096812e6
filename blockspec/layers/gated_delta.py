"""The gated delta rule (the linear-attention core of Gated DeltaNet: Qwen3.5, Qwen3.6, Qwen3-Next), torch reference.

Per value head a state S [Dk, Dv] maps keys to values. Row t brings a decay a_t = exp(g_t) (g_t <= 0), a write
strength beta_t in (0, 1), a key k_t and a query q_t (both l2-normed; q also scaled by Dk^-1/2) and a value v_t:

    S   <- a_t S                        forget a little of everything
    u_t  = beta_t (v_t - S^T k_t)       the part of v_t the decayed state does not already predict at k_t
    S   <- S + k_t u_t^T                the delta-rule write
    o_t  = S^T q_t                      read after the write

A row with g_t = 0 and beta_t = 0 leaves S exactly as it is (S * exp(0) = S, and a zero write adds exact zeros):
that is how a verify block's state is rolled back to its accepted rows (models/hybrid_state.py: the block is
replayed with its rejected rows so neutralized, fixed shapes whatever was accepted).

`recurrent_rule` runs the rule row after row: decode and verify rows, and the replay of a verify block.
`chunked_rule` gives the same outputs and final state over blocks of C rows with matmuls (prefill); derivation at the
function. Both compute in fp32 whatever the activations' dtype, and agree to fp32 rounding (tests/test_qwen3_5.py).
`gated_delta_rule` is the one call the layer makes (q and k at the key heads, as fused kernels take them: fla-core's
fused_recurrent / chunk gated-delta-rule kernels can take its place on the GPU).

Shapes: a leading batch dim B (sequences computed together: same row count), then rows L, then heads H; in the two
reference forms q and k already repeated to the value heads (grouped value heads share a key head)."""

from __future__ import annotations

import torch

CHUNK = 64  # rows per block of the chunked form: the intra-block matrices are [C, C] per head


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, as rsqrt times x (the reference model's rounding)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, chunked: bool, outputs: bool = True
                     ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """q, k [B, L, Hk, Dk] (l2-normed; q also scaled); v [B, L, Hv, Dv]; g, beta [B, L, Hv]; state [B, Hv, Dk, Dv]
    (all fp32; state not modified); value heads h * r .. h * r + r - 1 read key head h (r = Hv / Hk).
    -> (out [B, L, Hv, Dv] or None without outputs, final state [B, Hv, Dk, Dv])."""
    r = v.shape[2] // k.shape[2]
    if r > 1:
        q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
    if chunked:
        return chunked_rule(q, k, v, g, beta, state)
    return recurrent_rule(q, k, v, g, beta, state, outputs)


def recurrent_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor, outputs: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
    """q, k [B, L, H, Dk]; v [B, L, H, Dv]; g, beta [B, L, H]; state [B, H, Dk, Dv] (all fp32; state not modified).
    -> (out [B, L, H, Dv] or None without outputs (a replay wants the state only), final state [B, H, Dk, Dv])."""
    L = q.shape[1]
    out = q.new_empty(*v.shape) if outputs else None
    decay = g.exp()
    S = state
    for t in range(L):
        S = S * decay[:, t, :, None, None]
        k_t = k[:, t]  # [B, H, Dk]
        predicted = (k_t.unsqueeze(-2) @ S).squeeze(-2)  # S^T k: [B, H, Dv]
        u = (v[:, t] - predicted) * beta[:, t, :, None]
        S = S + k_t.unsqueeze(-1) * u.unsqueeze(-2)  # outer product k u^T, exact
        if out is not None:
            out[:, t] = (q[:, t].unsqueeze(-2) @ S).squeeze(-2)
    return out, S


def chunked_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The same outputs and final state as recurrent_rule (shapes alike), a block of `chunk` rows at a time.

    Within a block starting from state S0, let G_t be the running sum of g over the block's rows through t and
    gamma_t = exp(G_t) (decay from the block's start through row t; ratios gamma_t / gamma_s = exp(G_t - G_s) are
    formed in log space, so nothing overflows however strong the decay). Unrolling the recurrence,

        u_s = beta_s v_s - beta_s gamma_s S0^T k_s - sum_{r<s} beta_s (gamma_s / gamma_r) (k_s . k_r) u_r

    i.e. (I + A) U = beta V - (beta gamma K) S0 with A strictly lower triangular, A[s, r] = beta_s (gamma_s/gamma_r)
    (k_s . k_r): one unit-triangular solve per block for U = W_v - W_k S0. Then

        O   = (gamma Q) S0 + (D * Q K^T) U               D[t, s] = gamma_t / gamma_s for s <= t, else 0
        S_n = gamma_n S0 + (K * gamma_n / gamma)^T U     the state after the block's last row n
    """
    B, L, H, Dk = q.shape
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, L, D]
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)  # [B, H, L]
    out = v.new_empty(B, H, L, v.shape[-1])
    S = state
    for lo in range(0, L, chunk):
        hi = min(lo + chunk, L)
        n = hi - lo
        qc, kc, vc, bc = q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], beta[:, :, lo:hi]
        G = g[:, :, lo:hi].cumsum(dim=-1)  # [B, H, n]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        D = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # [B, H, n, n]
        eye = torch.eye(n, dtype=q.dtype, device=q.device)
        A = (bc.unsqueeze(-1) * (kc @ kc.transpose(-1, -2)) * D).tril(-1)
        gamma = G.exp()
        rhs = torch.cat([bc.unsqueeze(-1) * vc, (bc * gamma).unsqueeze(-1) * kc], dim=-1)  # [beta V | beta gamma K]
        W = torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True)
        W_v, W_k = W.split([vc.shape[-1], Dk], dim=-1)
        U = W_v - W_k @ S  # [B, H, n, Dv]
        out[:, :, lo:hi] = (gamma.unsqueeze(-1) * qc) @ S + ((qc @ kc.transpose(-1, -2)) * D) @ U
        tail = (G[..., -1:] - G).exp()  # gamma_n / gamma_s
        S = G[..., -1].exp()[..., None, None] * S + (kc * tail.unsqueeze(-1)).transpose(-1, -2) @ U
    return out.transpose(1, 2), S
