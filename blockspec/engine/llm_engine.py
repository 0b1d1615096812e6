"""LLMEngine: add requests, step, abort. Each step schedules, runs the models once, commits tokens, drafts."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Callable

from blockspec.attention.backends import get_backend
from blockspec.config import AUTO, EngineConfig
from blockspec.engine.decode_step import Launched
from blockspec.engine.model_runner import ModelRunner
from blockspec.engine.outputs import FinishReason, Record, RequestOutput, StepTrace
from blockspec.engine.scheduler import Scheduler
from blockspec.engine.sequence import Sequence, StepResult, check_prompt
from blockspec.engine.status import EngineLimits, EngineStats
from blockspec.errors import BlockspecError
from blockspec.kv.block_manager import BlockManager
from blockspec.kv.pool import CacheShape, KVPool
from blockspec.loading.draft_loader import LoadedDraft
from blockspec.loading.loader import LoadedModel
from blockspec.sampling import SamplingParams
from blockspec.speculative.acceptance import AcceptancePolicy, TargetAcceptance
from blockspec.speculative.proposer import Proposer, StepModels
from blockspec.speculative.registry import as_proposer
from blockspec.speculative.stats import SpecStats

def build_runner(lm: LoadedModel, proposer: Proposer | None, config: EngineConfig,
                 acceptance: AcceptancePolicy) -> ModelRunner:
    """The models, their paged KV pool and the runner of their steps: what an engine runs its steps on, and all a
    tensor-parallel rank other than the first needs (it schedules nothing)."""
    cfg = lm.config
    param = next(lm.model.parameters())
    max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    blocks = config.num_kv_blocks
    if blocks is None:
        tokens = min(config.kv_cache_tokens, config.max_num_seqs * max_model_len)
        blocks = max(2, -(-tokens // config.block_size))
    target = CacheShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    pool = KVPool(blocks, config.block_size, target, proposer.cache_shape if proposer else None, param.dtype,
                  param.device, proposer.cache_dtype if proposer else None)
    if proposer is not None:
        proposer.bind(pool)
    models = StepModels(lm.model, proposer, pool,
                        get_backend(config.attention_backend, param.device, lm.batch_invariant, lm.row_invariant))
    return ModelRunner(models, acceptance, max_model_len, cfg.vocab_size, config.enforce_eager, config.max_num_seqs,
                       config.split_mixed_steps)


class LLMEngine:
    def __init__(self, lm: LoadedModel, draft: Proposer | LoadedDraft | None, config: EngineConfig | None = None,
                 acceptance: AcceptancePolicy | None = None,
                 wrap_runner: Callable[[ModelRunner], ModelRunner] | None = None) -> None:
        """draft: the proposer (speculative/registry.load_proposer), a loaded DFlash drafter, or None (plain
        decoding). acceptance: how drafts are accepted (default: the lossless TargetAcceptance; benchmarks pass
        ForcedAcceptance). wrap_runner: what the engine calls the runner through (tensor parallelism: a runner that
        broadcasts each call to the other ranks first)."""
        self.lm = lm
        self.proposer = proposer = as_proposer(draft)
        config = config or EngineConfig()
        param = next(lm.model.parameters())
        if proposer is None or config.draft_len_schedule in (None, AUTO):
            # the drafter's own measured schedule for this device, if it carries one (speculative/schedule.py); "auto"
            # is measured by the LLM facade once this engine exists (engine/calibrate.py)
            schedule = proposer.default_draft_len_schedule(param.device) if proposer is not None else None
            config = replace(config, draft_len_schedule=schedule)
        self.config = config
        runner = build_runner(lm, proposer, config, acceptance or TargetAcceptance())
        self.runner = wrap_runner(runner) if wrap_runner is not None else runner
        self.pool, self.max_model_len = runner.models.pool, runner.max_model_len
        self.blocks = BlockManager(self.pool.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens, config.min_admit)
        self.seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._aborted: list[Sequence] = []
        self.K = proposer.num_draft_tokens if proposer is not None else 0
        # On the CPU a launched step has already run when launch returns: nothing would overlap, and each request
        # finishing in a step would waste its row of the chained one. Tests turn it on there to check the path.
        self.overlap = config.overlap and config.tensor_parallel_size == 1 and param.device.type == "cuda"
        self.inflight: Launched | None = None  # a decode step enqueued and not yet collected (overlap)
        self.num_overlapped_steps = 0  # steps enqueued before the previous one's tokens were read

    def set_draft_len_schedule(self, schedule: dict[int, int] | None) -> None:
        """{batch: K} from the next drafting on (None: K throughout); calibration sets it once measured."""
        self.config = replace(self.config, draft_len_schedule=schedule)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    speculate: bool = True) -> str:
        check_prompt(prompt_ids, self.lm.config.vocab_size, self.max_model_len)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.seqs and not self.seqs[rid].finished:
            raise BlockspecError(f"request id {rid!r} is already in use")
        capacity = self.pool.num_blocks * self.pool.block_size
        max_new = min(params.max_tokens, self.max_model_len - len(prompt_ids))
        need = len(prompt_ids) + max_new + self.K + 1  # everything in KV at the end, plus the verify window
        if need > capacity:
            raise BlockspecError(
                f"the request needs up to {need} KV slots (prompt {len(prompt_ids)} + max_tokens {max_new} + "
                f"{self.K + 1} verify slots) but the KV pool holds {capacity} (num_kv_blocks x block_size); "
                f"raise num_kv_blocks / kv_cache_tokens or lower max_tokens"
            )
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.lm.stop_token_ids))
        seq = Sequence(
            request_id=rid, prompt_ids=list(prompt_ids), params=params, stop_ids=stops,
            max_new_tokens=max_new,
            speculate=speculate and self.proposer is not None, seed=params.resolve_seed(),
            stats=SpecStats(self.K), arrival=next(self._arrivals),
        )
        self.seqs[rid] = seq
        self.scheduler.add(seq)
        return rid

    def abort(self, request_id: str) -> None:
        seq = self.seqs.get(request_id)
        if seq is not None and not seq.finished:
            self.scheduler.abort(seq)
            self._aborted.append(seq)

    def limits(self) -> EngineLimits:
        return EngineLimits(self.lm.tokenizer, self.lm.config.vocab_size, self.max_model_len, self.pool.num_blocks,
                            self.pool.num_blocks * self.pool.block_size, self.K)

    def stats(self) -> EngineStats:
        return EngineStats(len(self.scheduler.waiting), len(self.scheduler.running),
                           self.pool.num_blocks - self.blocks.num_free, self.num_overlapped_steps)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self.inflight is not None  # a step in flight is collected by step()

    def commit(self, seq: Sequence, new: list[int], num_accepted: int | None, kv_rows: int) -> None:
        seq.num_computed += kv_rows
        reason = None
        for i, t in enumerate(new):
            if t in seq.stop_ids:
                reason = FinishReason.STOP
            elif len(seq.output_ids) + i + 1 >= seq.max_new_tokens:
                reason = FinishReason.LENGTH
            if reason is not None:
                new = new[: i + 1]
                break
        seq.output_ids.extend(new)
        if num_accepted is not None and seq.speculate:
            seq.stats.record(num_accepted, len(new))
            seq.trace.append(StepTrace(seq.num_computed - kv_rows, seq.drafts, num_accepted))
        # KV rows past a stop cut belong to no token: only positions that hold a token are committed
        committed = min(seq.num_computed, len(seq.prompt_ids) + len(seq.output_ids))
        if committed // self.pool.block_size > seq.num_hashed:  # a block filled up (seq.tokens copies the sequence)
            seq.num_hashed = self.blocks.commit_full_blocks(seq.block_table, seq.tokens, committed, seq.num_hashed)
        if reason is not None:
            self.scheduler.finish(seq, reason)

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One engine step. finished_only: outputs only for requests that finished (offline callers; saves copying
        every running request's tokens and trace each step, which adds up at hundreds of requests)."""
        seqs: list[Sequence] = []
        if self.inflight is not None:
            seqs = self._collect_inflight()
            if self.inflight is not None:  # the next step is enqueued already: this call's work is done
                return self.collect_outputs(seqs, finished_only)
        scheduled = self.scheduler.schedule()
        if scheduled:
            if self.overlap and (launched := self.runner.launch_decode(scheduled)) is not None:
                self.inflight = launched
                seqs += self._collect_inflight()
            else:
                seqs += self._apply(self.runner.step(scheduled))
        return self.collect_outputs(list(dict.fromkeys(seqs)), finished_only)

    def _collect_inflight(self) -> list[Sequence]:
        """Enqueue the next step behind the in-flight one where nothing can change between them, then read and
        commit the in-flight one (dropping its rows of requests that finished or were aborted since it was
        enqueued)."""
        prev, self.inflight = self.inflight, None
        if self._can_chain(prev):
            self.inflight = self.runner.launch_next(prev)
            self.num_overlapped_steps += 1
        seqs = self._apply([r for r in self.runner.collect(prev) if not r.seq.finished])
        if self.inflight is not None and all(s.finished for s in self.inflight.seqs):
            self.runner.collect(self.inflight)  # enqueued for requests that have all finished now: nothing to keep
            self.inflight = None
        return seqs

    def _can_chain(self, prev: Launched) -> bool:
        """Would the synchronous engine run the same step next, with the same drafts? The same requests (none
        finished, none waiting to be admitted, the batch within the token budget), the same K (no schedule change,
        no clipping near max_model_len), and free blocks for the next verify window whatever prev accepts."""
        running, K = self.scheduler.running, prev.K
        admit = self.scheduler.waiting and len(running) < self.config.max_num_seqs  # a full batch admits no one
        # nothing is admitted while a step is in flight, so running differs from prev.seqs only by finished requests
        if (admit or any(s.finished for s in prev.seqs)
                or len(running) * (K + 1) > self.config.max_num_batched_tokens
                or self.config.draft_len(len(running), self.K) != K and any(s.speculate for s in prev.seqs)):
            return False
        reach = [s.num_computed + 2 * (K + 1) for s in prev.seqs]  # prev's window, then the next one at most
        if max(reach) > self.max_model_len - 1:
            return False
        need = sum(self.blocks.blocks_needed(s.block_table, r) for s, r in zip(prev.seqs, reach))
        if not self.blocks.can_allocate(need):
            return False
        for s, r in zip(prev.seqs, reach):
            self.blocks.grow(s.block_table, r)
        return True

    def _apply(self, results: list[StepResult]) -> list[Sequence]:
        """Commit a step's tokens, then give each request still decoding its next drafts."""
        for r in results:
            try:
                self.commit(r.seq, r.new_tokens, r.num_accepted, r.num_kv_rows)
            except Exception as e:  # noqa: BLE001 - one request's failure must not take the batch down
                r.seq.error = f"{type(e).__name__}: {e}"
                if not r.seq.finished:
                    self.scheduler.finish(r.seq, FinishReason.ERROR)
        K = self.config.draft_len(len(self.scheduler.running), self.K)
        chained = {id(s) for s in self.inflight.seqs} if self.inflight is not None else set()
        to_draft, ks = [], []
        for r in results:
            seq = r.seq
            if seq.finished or seq.in_prefill:
                continue
            in_flight = id(seq) in chained  # its next step, in flight, verifies these drafts whatever K is now
            k = min(K, self.max_model_len - 1 - seq.num_computed) if seq.speculate else 0
            if r.next_drafts is not None and (len(r.next_drafts) == k or in_flight):  # drafted by the decode step
                seq.drafts, seq.draft_probs = r.next_drafts, None
                seq.stats.num_draft_passes += 1
            elif k > 0 and not in_flight:
                to_draft.append(seq)
                ks.append(k)
            else:
                seq.drafts, seq.draft_probs = [], None
        if to_draft:
            self.runner.propose(to_draft, ks)
        return [r.seq for r in results]

    def collect_outputs(self, seqs: list[Sequence], finished_only: bool = False) -> list[RequestOutput]:
        """An output per request with something new: what is new since its previous output (O(new), never its
        whole history), its record shared with it; a finished request's record copied once, then forgotten."""
        seqs, self._aborted = seqs + self._aborted, []
        outs = []
        for seq in seqs:
            if seq.final_sent or (finished_only and not seq.finished):
                continue
            if len(seq.output_ids) == seq.num_streamed and not seq.finished:
                continue
            lengths, trace, s = seq.stats.acceptance_lengths, seq.trace, seq.num_steps_streamed
            outs.append(RequestOutput(
                seq.request_id, seq.prompt_ids, seq.output_ids[seq.num_streamed:], seq.finished, seq.finish_reason,
                lengths[s:], trace[s:], Record.of(seq.output_ids, lengths, trace, owned=seq.finished),
                seq.num_preemptions, seq.error,
            ))
            seq.num_streamed, seq.num_steps_streamed, seq.final_sent = len(seq.output_ids), len(trace), seq.finished
            if seq.finished:  # the caller has everything: the engine forgets the request
                self.seqs.pop(seq.request_id, None)
        return outs
