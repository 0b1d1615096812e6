"""LLMEngine: add requests, step, abort. Every step is the same stages in the same order: schedule -> run the models
once (verify, sample, accept, append context, propose: engine/model_runner.py) -> commit the tokens and keep each
request's next drafts. Under overlap the step after a decode step is enqueued before that step is read, when the
scheduler says it is the step it would schedule anyway (Scheduler.chain)."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Callable

from blockspec.attention.backends import get_backend
from blockspec.config import AUTO, OFF, EngineConfig
from blockspec.engine.model_runner import ModelRunner, Pending
from blockspec.engine.observer import StepObserver
from blockspec.engine.outputs import FinishReason, Record, RequestOutput, StepTrace
from blockspec.engine.recurrent import recurrent_state, without_prefix_caching
from blockspec.engine.scheduler import Scheduler
from blockspec.engine.sequence import Sequence, StepResult, check_prompt
from blockspec.engine.status import EngineLimits, EngineStats
from blockspec.engine.step_bench import DecodeStepBench, decode_step_bench
from blockspec.errors import BlockspecError
from blockspec.kv.block_manager import BlockManager
from blockspec.kv.pool import CacheShape, KVPool
from blockspec.kv.state_slots import StateSlots
from blockspec.loading.draft_loader import LoadedDraft
from blockspec.loading.loader import LoadedModel
from blockspec.sampling import SamplingParams
from blockspec.speculative.acceptance import AcceptancePolicy, TargetAcceptance
from blockspec.speculative.draft_len import DraftLenPolicy, FixedDraftLen
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
    K = proposer.num_draft_tokens if proposer is not None else 0
    # a hybrid target's per-sequence state first: fixed by max_num_seqs and K, whatever the pool holds
    state = recurrent_state(lm.model, config, K, param.dtype, param.device)
    own_shape = getattr(lm.model, "kv_cache_shape", None)  # a target whose layers do not all keep K/V says so
    target = own_shape() if callable(own_shape) else CacheShape(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                                                cfg.head_dim)
    pool = KVPool(blocks, config.block_size, target, proposer.cache_shape if proposer else None, param.dtype,
                  param.device, proposer.cache_dtype if proposer else None)
    if proposer is not None:
        proposer.bind(pool)
    models = StepModels(lm.model, proposer, pool,
                        get_backend(config.attention_backend, param.device, lm.batch_invariant, lm.row_invariant),
                        state)
    return ModelRunner(models, acceptance, max_model_len, cfg.vocab_size, config)


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
        if not lm.plan.cuda_graphs:  # its step cannot be captured (the plan's reasons say why): eager, not a failure
            config = replace(config, enforce_eager=True)
        param = next(lm.model.parameters())
        if proposer is None or config.draft_len_schedule in (None, AUTO):
            # the drafter's own measured schedule for this device, if it carries one (speculative/schedule.py); "auto"
            # is measured by the LLM facade once this engine exists (engine/calibrate.py)
            schedule = proposer.default_draft_len_schedule(param.device) if proposer is not None else None
            config = replace(config, draft_len_schedule=schedule)
        elif config.draft_len_schedule == OFF:
            config = replace(config, draft_len_schedule=None)
        runner = build_runner(lm, proposer, config, acceptance or TargetAcceptance())
        if runner.models.state is not None:
            config = without_prefix_caching(config, lm.model)
        self.config = config
        self.runner = wrap_runner(runner) if wrap_runner is not None else runner
        self._local = runner  # this process's runner, for what the engine reports of it (under TP: rank 0's)
        self.models: StepModels = runner.models
        self.pool, self.max_model_len = runner.models.pool, runner.max_model_len
        self.blocks = BlockManager(self.pool.num_blocks, config.block_size, config.enable_prefix_caching)
        self.K = proposer.num_draft_tokens if proposer is not None else 0
        state = runner.models.state
        self.scheduler = Scheduler(self.blocks, config, self.K, self.max_model_len,
                                   StateSlots(state.num_slots - 1) if state is not None else None)  # the last: sink
        self.seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._aborted: list[Sequence] = []
        # On the CPU a launched step has already run when launch returns: nothing would overlap, and each request
        # finishing in a step would waste its row of the chained one. Tests force it on there to check the path.
        auto = param.device.type == "cuda"
        self.overlap = (auto if config.overlap is None else config.overlap) and config.tensor_parallel_size == 1
        self.inflight: Pending | None = None  # a step handed to the device and not yet collected
        self.num_overlapped_steps = 0  # steps enqueued before the previous one's tokens were read
        self.observer = StepObserver()

    def observe(self, observer: StepObserver) -> None:
        """Hooks around every stage of every step from now on (benchmarks/step.py times them)."""
        self.observer = observer
        self.runner.observe(observer)

    def set_draft_len_schedule(self, schedule: dict[int, int] | None) -> None:
        """{batch: K} from the next schedule on (None: K throughout); calibration sets it while it measures."""
        self.config = self.scheduler.config = replace(self.config, draft_len_schedule=schedule)
        self.scheduler.draft_len = FixedDraftLen(schedule, self.K)

    def set_draft_len_policy(self, policy: DraftLenPolicy, schedule: dict[int, int] | None) -> None:
        """K per step from `policy` from the next schedule on (speculative/draft_len.py: the live one re-picks K from
        the acceptance it sees); `schedule`: the {batch: K} it starts from, what config reports."""
        self.set_draft_len_schedule(schedule)
        self.scheduler.draft_len = policy

    @property
    def draft_len(self) -> DraftLenPolicy:
        """The draft length policy the scheduler asks (its `used`: the K of every step scheduled so far)."""
        return self.scheduler.draft_len

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
        state = self.models.state
        return EngineLimits(self.lm.tokenizer, self.lm.config.vocab_size, self.max_model_len, self.pool.num_blocks,
                            self.pool.num_blocks * self.pool.block_size, self.K,
                            state.nbytes() if state is not None else 0)

    def stats(self) -> EngineStats:
        runner = self._local
        return EngineStats(len(self.scheduler.waiting), len(self.scheduler.running),
                           self.pool.num_blocks - self.blocks.num_free, self.num_overlapped_steps,
                           runner.num_decode_steps, runner.num_varlen_steps, tuple(runner.captured_graphs()))

    def decode_step_bench(self, batch: int, K: int, context: int) -> DecodeStepBench:
        """This engine's decode step on `batch` random requests at `context`, verifying K drafts and proposing K,
        for timing (benchmarks/step.py): see engine/step_bench.py."""
        return decode_step_bench(self._local.decode, batch, K, context, self.lm.config.vocab_size)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self.inflight is not None  # a step in flight is collected by step()

    def commit(self, r: StepResult) -> None:
        """A step's tokens for one request: stop and length checks, stats, prefix-cache blocks, its next drafts."""
        seq, new, num_accepted, kv_rows = r.seq, r.new_tokens, r.num_accepted, r.num_kv_rows
        if num_accepted is not None and seq.speculate:
            seq.trace.append(StepTrace(seq.num_computed, seq.drafts.tokens[:r.k], num_accepted))
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
        if r.drafts.k:
            seq.stats.num_draft_passes += 1
        seq.drafts = r.drafts
        # KV rows past a stop cut belong to no token: only positions that hold a token are committed
        committed = min(seq.num_computed, len(seq.prompt_ids) + len(seq.output_ids))
        if committed // self.pool.block_size > seq.num_hashed:  # a block filled up (seq.tokens copies the sequence)
            seq.num_hashed = self.blocks.commit_full_blocks(seq.block_table, seq.tokens, committed, seq.num_hashed)
        if reason is not None:
            self.scheduler.finish(seq, reason)

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One engine step: schedule and launch a step (unless one is in flight), enqueue the next one behind it
        where the scheduler says it would schedule that same step, then collect and commit the first. finished_only:
        outputs only for requests that finished (offline callers; saves copying every running request's tokens and
        trace each step, which adds up at hundreds of requests)."""
        obs = self.observer
        if self.inflight is None:
            with obs.stage("schedule"):
                scheduled = self.scheduler.schedule()
            if not scheduled:
                return self.collect_outputs([], finished_only)
            with obs.stage("launch"):
                self.inflight = self.runner.launch(scheduled)
        prev, self.inflight = self.inflight, None
        if self.overlap and prev.chain_k is not None:
            with obs.stage("chain"):
                if self.scheduler.chain(prev.seqs, prev.chain_k):
                    self.inflight = self.runner.launch_next(prev)
                    self.num_overlapped_steps += 1
        with obs.stage("collect"):
            results = [r for r in self.runner.collect(prev) if not r.seq.finished]  # finished or aborted meanwhile
        with obs.stage("commit"):
            batch = len(prev.seqs)
            for r in results:
                if r.num_accepted is not None and r.k and r.seq.speculate:
                    self.scheduler.draft_len.observe(batch, r.k, r.num_accepted)
                try:
                    self.commit(r)
                except Exception as e:  # noqa: BLE001 - one request's failure must not take the batch down
                    r.seq.error = f"{type(e).__name__}: {e}"
                    if not r.seq.finished:
                        self.scheduler.finish(r.seq, FinishReason.ERROR)
        if self.inflight is not None and all(s.finished for s in self.inflight.seqs):
            self.runner.collect(self.inflight)  # enqueued for requests that have all finished now: nothing to keep
            self.inflight = None
        with obs.stage("outputs"):
            return self.collect_outputs([r.seq for r in results], finished_only)

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
