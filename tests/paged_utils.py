"""Driving a target through blockspec's paged attention over a KV pool, as the engine does, for the model-family
parity tests (tests/test_gpt_oss.py, tests/test_gemma4.py): several prompts prefilled together in one varlen batch
(each in part), then decoded one token per sequence per step, their blocks scattered through the pool; logits and
taps of every position gathered per prompt, to compare with transformers' full forward (causal: the same numbers)."""

from __future__ import annotations

import random
from typing import Callable, Sequence

import torch

from blockspec.attention.backends import TritonTargetAttention  # the engine's; test_gemma4 takes it from here
from blockspec.attention.paged_ref import PagedBatch, PagedTargetAttention
from blockspec.kv.pool import KVPool

BLOCK = 4




def batch_of(runs: list[tuple[list[int], int, int]], device: torch.device | str = "cpu") -> PagedBatch:
    """runs: per sequence (its block table, first position, rows) -> the batch of those rows, on `device`."""
    pos, slots, starts = [], [], [0]
    for table, first, n in runs:
        p = list(range(first, first + n))
        pos += p
        slots += [table[i // BLOCK] * BLOCK + i % BLOCK for i in p]
        starts.append(starts[-1] + n)
    width = max(len(t) for t, _, _ in runs)
    tables = torch.tensor([t + [0] * (width - len(t)) for t, _, _ in runs])
    return PagedBatch(torch.tensor(pos, device=device), torch.tensor(slots, device=device),
                      torch.tensor(starts, dtype=torch.int32, device=device),
                      torch.tensor([f + n for _, f, n in runs], dtype=torch.int32, device=device), tables.to(device),
                      max(n for *_, n in runs), max(f + n for _, f, n in runs))


def prefill_decode(lm, prompts: Sequence[torch.Tensor], splits: Sequence[int], taps: Sequence[int] = (),
                   attention: Callable[[KVPool, PagedBatch], object] = PagedTargetAttention, seed: int = 0
                   ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Per prompt (logits [len, vocab], taps [len, ...] or None): prompts[i][:splits[i]] prefilled with the others'
    in one batch, then one row per unfinished sequence per step."""
    shape = lm.model.kv_cache_shape()  # every family says what its pool holds
    blocks_each = [-(-len(p) // BLOCK) for p in prompts]
    order = list(range(sum(blocks_each) + 2))
    random.Random(seed).shuffle(order)  # blocks scattered through the pool: the tables are read
    tables, start = [], 0
    for n in blocks_each:
        tables.append(order[start:start + n])
        start += n
    param = next(lm.model.parameters())  # the pool on the model's device, in its dtype
    pool = KVPool(len(order), BLOCK, shape, None, param.dtype, param.device)
    done = [0] * len(prompts)
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    tapped: list[list[torch.Tensor]] = [[] for _ in prompts]
    want = list(splits)
    with torch.no_grad():
        while any(d < len(p) for d, p in zip(done, prompts)):
            live = [i for i, p in enumerate(prompts) if done[i] < len(p)]
            rows = {i: (want[i] if done[i] == 0 else 1) for i in live}
            b = batch_of([(tables[i], done[i], rows[i]) for i in live], param.device)
            ids = torch.cat([prompts[i][done[i]:done[i] + rows[i]] for i in live]).to(param.device)
            out = lm.model(ids, b.positions, attention(pool, b), tap_layers=list(taps))
            at = 0
            for i in live:
                logits[i].append(out.logits[at:at + rows[i]].cpu())
                if taps:
                    tapped[i].append(out.taps[at:at + rows[i]].float().cpu())
                at += rows[i]
                done[i] += rows[i]
    return [(torch.cat(lg), torch.cat(tp) if taps else None) for lg, tp in zip(logits, tapped)]


def assert_matches(lm, hf, prompts: Sequence[torch.Tensor], splits: Sequence[int], tol: float = 2e-5,
                   attention: Callable[[KVPool, PagedBatch], object] = PagedTargetAttention) -> None:
    """Logits of every position and taps after every layer (the last one final-normed) equal transformers', to `tol`
    relative to the largest magnitude compared (fp32 rounding: GEMMs and SDPA sum in their own orders)."""
    n, H = lm.config.num_hidden_layers, lm.config.hidden_size
    ours = prefill_decode(lm, prompts, splits, list(range(n)), attention)

    def close(got: torch.Tensor, want: torch.Tensor) -> float:
        return (got - want).abs().max().item() / max(1.0, want.abs().max().item())

    for ids, (logits, taps) in zip(prompts, ours):
        with torch.no_grad():
            ref = hf(ids[None], output_hidden_states=True)
        err = close(logits, ref.logits[0].float())
        assert err <= tol, (len(ids), err)
        for i in range(n):
            err = close(taps[:, i * H:(i + 1) * H], ref.hidden_states[i + 1][0])
            assert err <= tol, (len(ids), i, err)


def assert_same_as_cpu(path: str, prompts: Sequence[torch.Tensor], splits: Sequence[int], tol: float = 1e-4) -> None:
    """The checkpoint at `path` in fp32 on CUDA through the Triton paged kernel (and the fused kernels CUDA runs)
    gives the logits and taps of the CPU reference path, which the CPU tests hold equal to transformers' (compared
    with our CPU numbers rather than transformers' own: the device machine's transformers may be another version)."""
    from blockspec.loading.loader import LoadConfig, load_model

    cpu = load_model(path, LoadConfig(device="cpu", with_tokenizer=False))
    gpu = load_model(path, LoadConfig(device="cuda", dtype="float32", with_tokenizer=False))
    taps = list(range(cpu.config.num_hidden_layers))
    want = prefill_decode(cpu, prompts, splits, taps)
    got = prefill_decode(gpu, prompts, splits, taps, TritonTargetAttention)
    for (gl, gt), (wl, wt) in zip(got, want):
        for g, w in ((gl, wl), (gt, wt)):
            assert (g - w).abs().max().item() <= tol * max(1.0, w.abs().max().item())
