"""Single-request reference loops over dense KV caches: the test oracles the engine is held to.

`generate` is plain autoregressive decoding; `spec_generate` / `DFlashSession` is DFlash speculative decoding
(DFLASH.md section 3): per step draft a block [bonus, MASK x K] in one draft pass, verify [bonus, d_1..d_K] in one
target pass with taps, accept, append the committed rows' taps to the draft context cache; the correction becomes
the next bonus. It always drafts K tokens; the engine drafts fewer near max_model_len or under a draft_len_schedule,
so the two agree step for step only away from those clips (both stay lossless)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from blockspec import rng
from blockspec.engine.outputs import StepTrace
from blockspec.engine.sequence import check_prompt
from blockspec.loading.draft_loader import LoadedDraft
from blockspec.loading.loader import LoadedModel
from blockspec.sampling import SamplingParams, processed_probs_for, race, sample
from blockspec.speculative.stats import SpecStats
from blockspec.speculative.verify import accept_probabilistic, accept_tokens
from dense_cache import DenseCausalAttention, DenseDraftAttention, DenseKVCache


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated ids only
    finish_reason: str  # "stop" | "length"
    num_prompt_tokens: int
    time_s: float
    acceptance_lengths: list[int] = field(default_factory=list)  # speculative decoding only
    steps: list[dict] = field(default_factory=list)  # speculative trace only


def stop_set(lm: LoadedModel, params: SamplingParams) -> set[int]:
    return set(params.stop_token_ids) | (set() if params.ignore_eos else set(lm.stop_token_ids))


@torch.inference_mode()
def generate_stream(lm: LoadedModel, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
    """Yields generated token ids one by one; stops on a stop id (yielded) or after max_tokens."""
    cfg = lm.config
    check_prompt(prompt_ids, cfg.vocab_size, cfg.max_position_embeddings)
    device = next(lm.model.parameters()).device
    max_new = min(params.max_tokens, cfg.max_position_embeddings - len(prompt_ids))
    cache = DenseKVCache.allocate(
        cfg.num_hidden_layers, len(prompt_ids) + max_new, cfg.num_key_value_heads, cfg.head_dim,
        next(lm.model.parameters()).dtype, device,
    )
    seed = params.resolve_seed()
    stops = stop_set(lm, params)
    ids = torch.tensor(prompt_ids, device=device)
    positions = torch.arange(len(prompt_ids), device=device)
    last = torch.tensor([len(prompt_ids) - 1], device=device)
    for i in range(max_new):
        attn = DenseCausalAttention(cache, positions, int(positions[-1]) + 1)
        out = lm.model(ids, positions, attn, logit_rows=last if i == 0 else None)
        token = int(sample(out.logits, params, seed, torch.tensor([len(prompt_ids) + i], device=device))[0])
        yield token
        if token in stops:
            return
        pos = len(prompt_ids) + i
        ids = torch.tensor([token], device=device)
        positions = torch.tensor([pos], device=device)


def generate(lm: LoadedModel, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
    t0 = time.perf_counter()
    tokens = list(generate_stream(lm, prompt_ids, params))
    reason = "stop" if tokens and tokens[-1] in stop_set(lm, params) else "length"
    return GenerationResult(tokens, reason, len(prompt_ids), time.perf_counter() - t0)


class DFlashSession:
    """One request's speculative decoding state: target KV, draft context KV, the pending bonus."""

    def __init__(self, lm: LoadedModel, draft: LoadedDraft, prompt_ids: list[int], params: SamplingParams) -> None:
        cfg = lm.config
        check_prompt(prompt_ids, cfg.vocab_size, cfg.max_position_embeddings)
        self.lm, self.draft, self.params = lm, draft, params
        self.K = draft.spec.num_draft_tokens
        param = next(lm.model.parameters())
        self.device = param.device
        self.max_new = min(params.max_tokens, cfg.max_position_embeddings - len(prompt_ids))
        # Room for the verify window / draft block reaching K positions past the last committed token.
        cap = len(prompt_ids) + self.max_new + self.K + 1
        self.kv = DenseKVCache.allocate(cfg.num_hidden_layers, cap, cfg.num_key_value_heads, cfg.head_dim, param.dtype, self.device)
        d = draft.config
        self.ctx = DenseKVCache.allocate(d.num_hidden_layers, cap, d.num_key_value_heads, d.head_dim,
                                         draft.model.dtype, self.device)  # the drafter's dtype, maybe not the target's
        self.seed = params.resolve_seed()
        self.stats = SpecStats(self.K)
        self.steps: list[StepTrace] = []
        self.prompt_ids = prompt_ids
        self.taps = draft.spec.target_layer_ids

    def _seeds(self, n: int) -> torch.Tensor:
        return torch.full((n,), self.seed, dtype=torch.long, device=self.device)

    def _append_context(self, taps: torch.Tensor, positions: torch.Tensor) -> None:
        for layer, (k, v) in enumerate(self.draft.model.context_kv(taps, positions)):
            self.ctx.k[layer, positions] = k
            self.ctx.v[layer, positions] = v

    def _propose(self, bonus: int, start: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft K tokens after `bonus` at position `start`: (drafts [K], q [K, V] when probabilistic)."""
        spec = self.draft.spec
        rows = spec.draft_rows(self.K)
        ids = torch.full((rows,), spec.mask_token_id, device=self.device)
        ids[0] = bonus
        positions = torch.arange(start, start + rows, device=self.device)
        embeds = self.lm.model.embed_tokens(ids)
        hidden = self.draft.model(embeds, positions, DenseDraftAttention(self.ctx, start, positions))
        self.stats.num_draft_passes += 1
        p = self.params
        if spec.probabilistic_drafting and not p.greedy:
            logits = self.draft.model.compute_logits(hidden[1:self.K + 1], self.lm.model.lm_head)
            q = processed_probs_for(logits, p)
            noise = rng.exponential(self._seeds(self.K), positions[1:self.K + 1], rng.STREAM_DRAFT, q.shape[-1])
            return race(q, noise), q
        return self.draft.model.greedy_drafts(hidden[1:self.K + 1], self.lm.model.lm_head), None

    def _verify(self, bonus: int, drafts: torch.Tensor, q: torch.Tensor | None,
                start: int) -> tuple[torch.Tensor, int, torch.Tensor]:
        ids = torch.cat([torch.tensor([bonus], device=self.device), drafts])
        positions = torch.arange(start, start + self.K + 1, device=self.device)
        out = self.lm.model(ids, positions, DenseCausalAttention(self.kv, positions, start + self.K + 1), tap_layers=self.taps)
        p = self.params
        if q is None:  # the target's own sample (or argmax) at every row; noise keyed by the sampled position
            tokens, n = accept_tokens(drafts[None], sample(out.logits, p, self.seed, positions + 1)[None])
        else:
            probs = processed_probs_for(out.logits, p)
            u = rng.uniform(self._seeds(self.K), positions[1:], rng.STREAM_ACCEPT, 1)
            noise = rng.exponential(self._seeds(1), positions[:1], rng.STREAM_RESIDUAL, probs.shape[-1])
            tokens, n = accept_probabilistic(drafts[None], probs[None], q[None], u.T, noise)
        return tokens[0], int(n[0]), out.taps

    @torch.inference_mode()
    def stream(self) -> Iterator[int]:
        stops = stop_set(self.lm, self.params)
        P = len(self.prompt_ids)
        positions = torch.arange(P, device=self.device)
        out = self.lm.model(torch.tensor(self.prompt_ids, device=self.device), positions,
                            DenseCausalAttention(self.kv, positions, P), tap_layers=self.taps,
                            logit_rows=torch.tensor([P - 1], device=self.device))
        bonus = int(sample(out.logits, self.params, self.seed, torch.tensor([P], device=self.device))[0])
        self._append_context(out.taps, positions)
        emitted = 1
        yield bonus
        if bonus in stops or emitted >= self.max_new:
            return
        start = P  # position of the bonus
        while True:
            drafts, q = self._propose(bonus, start)
            tokens, n, taps = self._verify(bonus, drafts, q, start)
            new = tokens[: n + 1].tolist()
            cut = len(new)
            for i, t in enumerate(new):
                if t in stops or emitted + i + 1 >= self.max_new:
                    cut = i + 1
                    break
            self.stats.record(n, cut)
            self.steps.append(StepTrace(start, drafts.tolist(), n))
            for t in new[:cut]:
                yield t
            emitted += cut
            if cut < len(new) or new[-1] in stops or emitted >= self.max_new:
                return
            # The committed verify rows (bonus, d_1..d_n) become draft context; the correction is the next bonus.
            self._append_context(taps[: n + 1], torch.arange(start, start + n + 1, device=self.device))
            start += n + 1
            bonus = new[-1]


def spec_generate(lm: LoadedModel, draft: LoadedDraft, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
    t0 = time.perf_counter()
    session = DFlashSession(lm, draft, prompt_ids, params)
    tokens = list(session.stream())
    reason = "stop" if tokens and tokens[-1] in stop_set(lm, params) else "length"
    return GenerationResult(tokens, reason, len(prompt_ids), time.perf_counter() - t0,
                            session.stats.acceptance_lengths, session.steps)
