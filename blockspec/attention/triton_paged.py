"""Triton kernels for the paged layout: KV store and varlen paged attention (GPU; CPU under TRITON_INTERPRET=1).

One attention kernel serves both models. Each program owns BLOCK_M query rows of one sequence and one query head;
it streams the sequence's cached keys (positions < kv_len, through the block table, page by page) with an online
softmax, masked by position: causal (k <= q) or not, optional window (q - k < W, or |q - k| < W when non-causal:
a target's sliding-window layers, the drafter's windowed layers; key tiles wholly before a causal window are skipped).
The draft block additionally attends to its own K/V, which are passed in and never stored (HAS_NEW). Learned attention
sinks (gpt-oss: one logit per head added to the softmax's denominator, no value) are folded in by the merge, once per
row whatever the number of splits."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ROW: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # slot -1: padding / rejected rows are not written
        offs = tl.arange(0, BLOCK)
        m = offs < ROW
        tl.store(kc_ptr + slot * ROW + offs, tl.load(k_ptr + t * ROW + offs, mask=m), mask=m)
        tl.store(vc_ptr + slot * ROW + offs, tl.load(v_ptr + t * ROW + offs, mask=m), mask=m)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v [T, Hkv, D] -> caches [num_slots, Hkv, D] at `slots` [T] (-1 skips)."""
    T = k.shape[0]
    if T == 0:
        return
    row = k.shape[1] * k.shape[2]
    _store_kv_kernel[(T,)](k.contiguous(), v.contiguous(), k_cache, v_cache, slots, ROW=row,
                           BLOCK=triton.next_power_of_2(row))


@triton.jit
def _masked_scores(s, q_pos, k_pos, valid, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    ok = valid
    diff = q_pos[:, None] - k_pos[None, :]
    if CAUSAL:
        ok = ok & (diff >= 0)
    if WINDOW > 0:
        if CAUSAL:
            ok = ok & (diff < WINDOW)
        else:
            ok = ok & (diff < WINDOW) & (diff > -WINDOW)
    return tl.where(ok, s, float("-inf"))


@triton.jit
def _online_softmax_step(q, k, v, q_pos, k_pos, valid, m_i, l_i, acc, scale,
                         CAUSAL: tl.constexpr, WINDOW: tl.constexpr, PREC: tl.constexpr):
    """Fold one tile of keys/values into the running (max, sum, acc) of the online softmax."""
    s = tl.dot(q, tl.trans(k), input_precision=PREC).to(tl.float32) * scale
    s = _masked_scores(s, q_pos, k_pos, valid, CAUSAL, WINDOW)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked rows so far: avoid inf - inf
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC).to(tl.float32)
    return m_new, l_i, acc


# Integers that follow the batch (token count, block-table width, split count) are not specialized: Triton compiles a
# variant per value class (== 1, divisible by 16, other) of each, and new classes met as contexts grow or batches
# change put a compile (~1 s) inside a step, long after any warm-up.
@triton.jit(do_not_specialize=["bt_stride", "num_splits", "T"])
def _paged_attn_kernel(
    q_ptr, kc_ptr, vc_ptr, kn_ptr, vn_ptr, o_ptr, m_ptr, l_ptr, pos_ptr, qstart_ptr, kvlen_ptr, bt_ptr,
    scale, bt_stride, num_splits, T,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_NEW: tl.constexpr, PREC: tl.constexpr, CHUNK: tl.constexpr,
    LAST_SPLIT: tl.constexpr,
):
    # Rows are (query token, head of this kv group) pairs: the group's heads share every K/V tile load (GQA).
    # Axis 2 splits each sequence's cached keys into num_splits equal chunks (split-K); partials are merged
    # afterwards. Chunk bounds come from kv_len at run time, so one grid serves every context length (CUDA graphs).
    # CHUNK > 0 (batch-invariant): split s holds the fixed key positions [s * CHUNK, (s + 1) * CHUNK), the last
    # split (LAST_SPLIT = MAX_SPLITS - 1) everything beyond, so a key's split never depends on kv_len or on the batch.
    G: tl.constexpr = HQ // HKV
    b = tl.program_id(0)
    kvh = tl.program_id(1) % HKV
    mblk = tl.program_id(1) // HKV
    split = tl.program_id(2)
    q0 = tl.load(qstart_ptr + b)
    q1 = tl.load(qstart_ptr + b + 1)
    r = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = q0 + r // G
    head = kvh * G + r % G
    row_ok = tok < q1
    if mblk * BLOCK_M < (q1 - q0) * G:
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        q_off = (tok[:, None] * HQ + head[:, None]) * D + d[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        q_pos = tl.load(pos_ptr + tok, mask=row_ok, other=0)
        kv_len = tl.load(kvlen_ptr + b)
        if CHUNK > 0:
            lo = split * CHUNK
            hi = tl.where(split == LAST_SPLIT, kv_len, tl.minimum(lo + CHUNK, kv_len))
        else:
            split_len = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
            lo = split * split_len
            hi = tl.minimum(lo + split_len, kv_len)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        if CAUSAL and WINDOW > 0:
            # tiles whose keys lie before every row's window add exact zeros (p = 0, the running scale 1): skip them;
            # the first tile kept starts on a multiple of BLOCK_N from lo, as every tile does, so the fold is the same
            q_min = tl.min(tl.where(row_ok, q_pos, 2147483647), 0)
            first = tl.maximum(lo, lo + (q_min - WINDOW + 1 - lo) // BLOCK_N * BLOCK_N)
        else:
            first = lo
        for start in range(first, hi, BLOCK_N):
            k_pos = start + tl.arange(0, BLOCK_N)
            k_ok = k_pos < hi
            page = tl.load(bt_ptr + b * bt_stride + k_pos // PAGE, mask=k_ok, other=0).to(tl.int64)
            slot = page * PAGE + k_pos % PAGE
            kv_off = (slot[:, None] * HKV + kvh) * D + d[None, :]
            k = tl.load(kc_ptr + kv_off, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(vc_ptr + kv_off, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
            m_i, l_i, acc = _online_softmax_step(q, k, v, q_pos, k_pos, k_ok[None, :] & row_ok[:, None], m_i, l_i,
                                                 acc, scale, CAUSAL, WINDOW, PREC)
        if HAS_NEW:  # the draft block's own K/V (rows q0..q1 of k_new / v_new), folded in by split 0 only
            if split == 0:
                # names of their own: the key loop's `start` and `k_pos` are int64 under a window (from the positions),
                # and Triton refuses a branch that redefines a name with another type
                for n0 in range(0, q1 - q0, BLOCK_N):
                    n_rows = q0 + n0 + tl.arange(0, BLOCK_N)
                    n_ok = n_rows < q1
                    n_pos = tl.load(pos_ptr + n_rows, mask=n_ok, other=0)
                    n_off = (n_rows[:, None] * HKV + kvh) * D + d[None, :]
                    k = tl.load(kn_ptr + n_off, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
                    v = tl.load(vn_ptr + n_off, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
                    m_i, l_i, acc = _online_softmax_step(q, k, v, q_pos, n_pos, n_ok[None, :] & row_ok[:, None],
                                                         m_i, l_i, acc, scale, CAUSAL, WINDOW, PREC)
        # unnormalized partials: out = acc / l after merging splits
        ml_off = (split * T + tok) * HQ + head
        tl.store(m_ptr + ml_off, m_i, mask=row_ok)
        tl.store(l_ptr + ml_off, l_i, mask=row_ok)
        o_off = ((split * T + tok[:, None]) * HQ + head[:, None]) * D + d[None, :]
        tl.store(o_ptr + o_off, acc, mask=row_ok[:, None] & d_ok[None, :])


MAX_SPLITS = 16  # every split adds a partial [T, Hq, D] fp32 result to write and merge
INVARIANT_CHUNK = 256  # keys per split in the batch-invariant mode (4 key tiles)


def _num_splits(B: int, programs_per_seq: int, max_kv_len: int, block_n: int) -> int:
    """About two waves of programs on 132 SMs, without chunks shorter than 4 key tiles at the bound; at most
    MAX_SPLITS."""
    if max_kv_len <= 4 * block_n:
        return 1
    want = -(-264 // max(1, B * programs_per_seq))
    return max(1, min(want, max_kv_len // (4 * block_n), MAX_SPLITS))


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,
    positions: torch.Tensor,  # [T] int64
    query_start: torch.Tensor,  # [B+1] int32/int64
    kv_lens: torch.Tensor,  # [B] cached positions 0..kv_len-1 are candidates
    block_tables: torch.Tensor,  # [B, max_blocks]
    page_size: int,
    scale: float,
    max_q_len: int,
    causal: bool,
    window: int | None = None,
    k_new: torch.Tensor | None = None,  # [T, Hkv, D] the draft block's own keys (not in the cache)
    v_new: torch.Tensor | None = None,
    max_kv_len: int | None = None,  # host bound on kv_lens; None: pages in the block table
    batch_invariant: bool = False,
    sinks: torch.Tensor | None = None,  # [Hq] learned attention-sink logits (gpt-oss); None: none
) -> torch.Tensor:
    """batch_invariant: one tile shape whatever the batch, and splits over fixed key positions (INVARIANT_CHUNK each)
    merged one after another in position order, so each query row folds the same key tiles (fixed boundaries from
    position 0) in the same order as it would alone; masked keys and splits past its position add exact zeros. A
    row's output then depends neither on the rows batched with it nor on how many query rows its request has.
    sinks: each head's sink logit joins the softmax's denominator in the merge (after the splits, in that order)."""
    T, HQ, D = q.shape
    HKV = k_cache.shape[1]
    B = kv_lens.shape[0]
    if T == 0:
        return torch.empty_like(q)
    G = HQ // HKV
    rows = max_q_len * G
    block_m = 16 if rows <= 16 or batch_invariant else 32 if rows <= 32 else 64
    block_n = 64 if D <= 64 else 32
    m_blocks = triton.cdiv(rows, block_m)
    bound = max_kv_len if max_kv_len is not None else block_tables.shape[1] * page_size
    if batch_invariant:
        splits = min(MAX_SPLITS, triton.cdiv(bound, INVARIANT_CHUNK))
    else:
        splits = _num_splits(B, HKV * m_blocks, bound, block_n)
    acc = torch.empty(splits, T, HQ, D, dtype=torch.float32, device=q.device)
    m = torch.empty(splits, T, HQ, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    has_new = k_new is not None
    _paged_attn_kernel[(B, HKV * m_blocks, splits)](
        q.contiguous(), k_cache, v_cache, k_new.contiguous() if has_new else q, v_new.contiguous() if has_new else q,
        acc, m, l, positions, query_start, kv_lens, block_tables, scale, block_tables.stride(0), splits, T,
        HQ=HQ, HKV=HKV, D=D, PAGE=page_size, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(D), CAUSAL=causal, WINDOW=window or 0, HAS_NEW=has_new,
        # fp32 runs are the exactness oracle: no TF32 rounding in their dot products
        PREC="ieee" if q.dtype == torch.float32 else "tf32", CHUNK=INVARIANT_CHUNK if batch_invariant else 0,
        LAST_SPLIT=MAX_SPLITS - 1,
    )
    out = torch.empty_like(q)
    has_sinks = sinks is not None
    sink = sinks.float().contiguous() if has_sinks else m  # fp32 logits, as the scores are
    if batch_invariant:
        _ordered_merge_kernel[(T * HQ,)](acc, m, l, sink, out, T * HQ, D, splits, HQ=HQ, HAS_SINKS=has_sinks,
                                         BLOCK_D=triton.next_power_of_2(D))
    else:
        _merge_kernel[(T * HQ,)](acc, m, l, sink, out, T * HQ, D, splits, HQ=HQ, HAS_SINKS=has_sinks,
                                 BLOCK_S=MAX_SPLITS, BLOCK_D=triton.next_power_of_2(D))
    return out


# The merges take the number of splits at run time (not as a constexpr): it follows the longest context of the batch,
# and a kernel compiled per value put a Triton compile (~1 s) inside a step each time contexts grew past a new count.
@triton.jit(do_not_specialize=["R", "SPLITS"])
def _merge_kernel(acc_ptr, m_ptr, l_ptr, sink_ptr, o_ptr, R, D, SPLITS, HQ: tl.constexpr, HAS_SINKS: tl.constexpr,
                  BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (token, head) row: merge the split-K partials (weights exp(m_s - max m); empty splits have m = -inf and
    contribute nothing; a row with no visible key gives 0) and normalize, in one kernel instead of ~8 torch ops.
    HAS_SINKS: the head's sink logit s joins the max and adds exp(s - max) to the denominator (no value)."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < SPLITS
    m = tl.load(m_ptr + s * R + row, mask=s_ok, other=float("-inf"))
    l = tl.load(l_ptr + s * R + row, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sink_ptr + row % HQ)
        m_max = tl.maximum(m_max, sink)
    w = tl.where(s_ok & (m > float("-inf")), tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max)), 0.0)
    den = tl.sum(w * l, 0)
    if HAS_SINKS:
        den += tl.exp(sink - m_max)
    d = tl.arange(0, BLOCK_D)
    acc = tl.load(acc_ptr + (s[:, None] * R + row) * D + d[None, :], mask=s_ok[:, None] & (d < D)[None, :], other=0.0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(den == 0, 1.0, den)
    tl.store(o_ptr + row * D + d, out.to(o_ptr.dtype.element_ty), mask=d < D)


@triton.jit(do_not_specialize=["R", "SPLITS"])
def _ordered_merge_kernel(acc_ptr, m_ptr, l_ptr, sink_ptr, o_ptr, R, D, SPLITS, HQ: tl.constexpr,
                          HAS_SINKS: tl.constexpr, BLOCK_D: tl.constexpr):
    """The merge of the batch-invariant mode: splits folded one at a time in position order (an online softmax over
    the partials), so the empty splits past a row's position, however many the batch has, change nothing (their
    weight is exp(-inf) = 0 and the running scale exp(0) = 1). A vector reduction over the splits would sum in an
    order that depends on how many there are. HAS_SINKS: the head's sink is folded last, as one more partial with
    max = the sink logit, sum 1 and no value: a fixed place whatever the batch."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    m_run = tl.full([1], float("-inf"), tl.float32)
    den = tl.zeros([1], tl.float32)
    out = tl.zeros([BLOCK_D], tl.float32)
    for s in range(SPLITS):
        m_s = tl.load(m_ptr + s * R + row + tl.zeros([1], tl.int64))
        l_s = tl.load(l_ptr + s * R + row + tl.zeros([1], tl.int64))
        a_s = tl.load(acc_ptr + (s * R + row) * D + d, mask=d_ok, other=0.0)
        m_new = tl.maximum(m_run, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha, w = tl.exp(m_run - m_safe), tl.exp(m_s - m_safe)
        den = den * alpha + w * l_s
        out = out * alpha + w * a_s
        m_run = m_new
    if HAS_SINKS:
        sink = tl.load(sink_ptr + row % HQ + tl.zeros([1], tl.int64))
        m_new = tl.maximum(m_run, sink)
        alpha = tl.exp(m_run - m_new)  # m_new is finite: the sink is
        den = den * alpha + tl.exp(sink - m_new)
        out = out * alpha
    out = out / tl.where(den == 0, 1.0, den)
    tl.store(o_ptr + row * D + d, out.to(o_ptr.dtype.element_ty), mask=d_ok)
