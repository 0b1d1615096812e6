"""The draft length schedule of the machine that serves (EngineConfig.draft_len_schedule="auto").

Speculation pays only where a verify step of K drafts emits more tokens per second than a plain step: that depends
on the device, the batch size and the load options (a quantized CPU target pays for every 4 extra rows; an H100 for
almost none), so no table measured elsewhere is safe to reuse. `auto_schedule` measures, on the engine it will
serve with, what one decode step costs per (batch size, K), takes what each draft position is worth from the
drafter's recorded acceptance (or, without one, a short greedy run on shipped prompts), and derives the K per batch
size that emits the most tokens per second, K = 0 where no draft pays (speculative/schedule.derive_schedule). The
result is cached per device, models and options (BLOCKSPEC_CACHE_DIR, default ~/.cache/blockspec): measured once.

Costs are measured on random prompts under the engine's own acceptance: a decode step's work is fixed by (B, K),
whatever is accepted. Each point is the fastest of three runs of n decode steps, taken in turn over the Ks (prefill,
and the first steps of a new K, which may capture a CUDA graph, stay out)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from blockspec.engine.llm_engine import LLMEngine
from blockspec.engine.sequence import SeqStatus
from blockspec.loading.platform import cpu_model
from blockspec.native import build as native_build
from blockspec.sampling import SamplingParams
from blockspec.speculative.draft_len import DraftLenPolicy, FixedDraftLen, LiveDraftLen
from blockspec.speculative.schedule import derive_schedule, expected_tokens, fingerprint, schedule_for_batches

BATCHES = (1, 2, 4, 8, 16, 32, 64)
DRAFT_LENS = (0, 1, 2, 3, 4, 5, 7, 9, 11, 15)
# prompt tokens of the calibration requests (at most; less where the pool is small): about where a chat answer's steps
# run (a prompt, then ~100 tokens in), since a step's attention grows with the context; at 64 the costs came out
# optimistic, and low-acceptance answers kept drafting at a loss (docs/results/2026-12-07-cpu-dflash-live-draft-length.md)
CONTEXT = 160
MIN_RUN_S = 0.25  # a timed run at least this long (more steps where a step is short): timer noise stays small
ROUNDS = 3  # timed runs of each K, taken in turn over the Ks (measure_costs)
ACCEPTANCE_PROMPTS = (("humaneval", 1), ("gsm8k", 1), ("mtbench", 1))  # code, math, chat
ACCEPTANCE_TOKENS = 96


@dataclass
class Calibration:
    """What the engine runs with and where it came from (reported by generate, chat, bench and serve)."""

    schedule: dict[int, int]  # {batch: K}
    source: str  # "measured" | "cached" | "drafter" (the drafter directory's table for this device)
    device: str
    per_position: list[float] = field(default_factory=list)  # p_1..p_K the schedule was derived with
    step_ms: dict[int, dict[int, float]] = field(default_factory=dict)  # {batch: {K: ms}} measured
    seconds: float = 0.0  # the time measuring took here (0 when cached)

    @property
    def drafts_nothing(self) -> bool:
        """K = 0 at every batch size: the engine runs without the drafter (blockspec/llm.py)."""
        return bool(self.schedule) and not any(self.schedule.values())

    @property
    def live(self) -> bool:
        """Whether K can be re-picked as the engine runs: the acceptance and the cost of K = 0 at every batch size
        measured are known."""
        return bool(self.per_position and self.step_ms) and all(0 in by_k for by_k in self.step_ms.values())

    def policy(self, max_k: int) -> DraftLenPolicy:
        """What picks K as the engine runs: the live policy (speculative/draft_len.py: these costs, acceptance as it
        is measured) where `live`, else this schedule as it is."""
        if self.live:
            return LiveDraftLen(self.step_ms, self.per_position, max_k)
        return FixedDraftLen(self.schedule, max_k)

    def describe(self) -> str:
        sched = ", ".join(f"{b}:{k}" for b, k in sorted(self.schedule.items()))
        how = {"measured": f"measured on {self.device} in {self.seconds:.1f}s", "cached": f"cached for {self.device}",
               "drafter": f"the drafter's table for {self.device}"}[self.source]
        off = "; no draft length pays here: decoding without the drafter" if self.drafts_nothing else ""
        live = ", re-picked from the live acceptance" if self.live and not off else ""
        return f"draft length schedule (batch:K) {sched} ({how}){live}{off}"


def device_name(device: torch.device) -> str:
    """The machine a cost table holds for: the GPU's model, or the CPU's model and the threads torch uses."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} x{torch.get_num_threads()} threads"


def cache_dir() -> Path:
    return Path(os.environ.get("BLOCKSPEC_CACHE_DIR") or Path.home() / ".cache" / "blockspec") / "draft_len"


def calibration_key(engine: LLMEngine) -> tuple[str, dict]:
    """A stable hash of everything a step's cost depends on, and the record it hashes."""
    lm, cfg, proposer = engine.lm, engine.config, engine.proposer
    param = next(lm.model.parameters())
    target = fingerprint(lm.source.path) if lm.source is not None else []  # None: built in memory (benchmarks)
    record = {
        "device": device_name(param.device), "torch": torch.__version__, "dtype": str(param.dtype),
        "target": target, "cpu_packed": lm.cpu_packed, "cpu_quant": lm.cpu_quant,
        "batch_invariant": lm.batch_invariant, "attention": cfg.attention_backend, "eager": cfg.enforce_eager,
        "overlap": engine.overlap, "block_size": cfg.block_size, "context": CONTEXT, "rounds": f"{ROUNDS} in turn",
        # the native kernels' sources: a kernel change changes the costs
        "native": native_build.source_key() if param.device.type == "cpu" else None,
        "proposer": proposer.identity() if proposer is not None else None,
    }
    text = json.dumps(record, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24], record


class _Batch:
    """B random requests kept decoding in the engine; made again (untimed) before a run they could not finish."""

    def __init__(self, engine: LLMEngine, batch: int, context: int, room: int, seed: int) -> None:
        self.engine, self.batch, self.room = engine, batch, room
        gen = torch.Generator().manual_seed(seed)
        vocab = engine.lm.config.vocab_size
        # the same prompts every time the batch is made afresh: after the first, their KV comes from the prefix
        # cache, so the many fresh starts (every K, three runs each) cost little prefill
        self.prompts = [torch.randint(0, vocab, (context,), generator=gen).tolist() for _ in range(batch)]
        self.ids: list[str] = []

    def _left(self) -> int:
        """Tokens the request closest to its max_tokens may still emit (0 without a batch)."""
        seqs = [self.engine.seqs.get(i) for i in self.ids]
        if not seqs or any(s is None or s.finished for s in seqs):
            return 0
        return min(s.max_new_tokens - len(s.output_ids) for s in seqs)

    def _fresh(self) -> None:
        self.release()
        params = SamplingParams(temperature=0.0, max_tokens=self.room, ignore_eos=True)
        for prompt in self.prompts:
            self.ids.append(self.engine.add_request(prompt, params))
        while any(s.in_prefill or s.status is SeqStatus.WAITING for s in map(self.engine.seqs.get, self.ids)):
            self.engine.step()

    def run(self, steps: int, K: int) -> float:
        """Seconds of `steps` engine steps with all B requests decoding (a step emits at most K + 1 tokens each)."""
        if self._left() < steps * (K + 1) + 1:
            self._fresh()
        sync = torch.cuda.synchronize if self.engine.overlap else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            self.engine.step()
        sync()
        return time.perf_counter() - t0

    def release(self) -> None:
        for rid in self.ids:
            self.engine.abort(rid)
        self.engine.step()  # hands out the aborted requests' outputs: none is left for the engine's next caller
        while self.engine.has_unfinished():
            self.engine.step()
        self.ids = []


def _warm(batch: _Batch, K: int) -> int:
    """A first step of this K (graph capture) and two more; -> the steps one timed run of K takes (>= MIN_RUN_S)."""
    batch.engine.set_draft_len_schedule({1: K})
    batch._fresh()
    batch.run(3, K)
    return max(2, min(24, int(MIN_RUN_S / max(batch.run(2, K) / 2, 1e-5)), batch.room // (K + 1) - 1))


def _step_seconds(batch: _Batch, K: int, steps: int) -> float:
    """Seconds per decode step of B requests with K drafts each, over one run of `steps`, on requests made afresh at
    the calibration's context. A step's attention grows with the context (on the CPU a K = 3 step went from 13 to 18
    ms between 270 and 835 tokens): requests carried over from K to K would measure every K at a longer context than
    the one before it."""
    batch.engine.set_draft_len_schedule({1: K})
    batch._fresh()
    batch.run(1, K)  # the step after the prefill verifies the drafts of a block proposed at its end
    return batch.run(steps, K) / steps


def measure_costs(engine: LLMEngine, per_position: list[float], batches: list[int]) -> dict[int, dict[int, float]]:
    """{batch: {K: seconds per step}} for draft lengths up to the engine's K. Only the draft lengths that can still
    win are measured: past the first draft (whose pass is paid whatever K) rates rise then fall in K (stop two past
    the best), and the best K falls as the batch grows (a larger batch tries no K above the best of the one before;
    once K = 0 wins, larger batches draft nothing). Batches whose requests the pool cannot hold are left out."""
    pool_tokens = engine.pool.num_blocks * engine.pool.block_size
    costs: dict[int, dict[int, float]] = {}
    cap = engine.K
    saved = engine.config.draft_len_schedule
    try:
        for batch in batches:
            per_request = pool_tokens // batch - 2 * engine.pool.block_size
            context = min(CONTEXT, per_request // 4)
            room = per_request - context - engine.K - 1  # tokens each request may emit
            if cap == 0 or context < 4 or room < 3 * (cap + 1):
                break
            runner = _Batch(engine, batch, context, room, seed=batch)
            by_k: dict[int, float] = {}
            steps: dict[int, int] = {}
            best, worse = None, 0  # the best K >= 1 so far (K = 0 has no draft pass to pay: compared at the end)
            for K in [k for k in DRAFT_LENS if k <= cap]:
                steps[K] = _warm(runner, K)
                by_k[K] = _step_seconds(runner, K, steps[K])
                rate = {k: expected_tokens(per_position, k) / s for k, s in by_k.items()}
                if K == 0:
                    continue
                if best is None or rate[K] > rate[best]:
                    best, worse = K, 0
                elif (worse := worse + 1) >= 2:
                    break
            # every K again, in turn, ROUNDS times in all; each keeps its fastest run: a pause of the machine must not
            # decide the schedule, and a slow minute of a shared machine falls on every K of a round, not on a few
            # (measured K by K, three runs each, a calibration cached at a noisy moment put K = 1 and K = 3 steps at
            # 1.70x and 2.07x a plain one, 1.48x and 1.61x in one made at a quiet moment of the same night)
            for _ in range(ROUNDS - 1):
                for K in by_k:
                    by_k[K] = min(by_k[K], _step_seconds(runner, K, steps[K]))
            runner.release()
            costs[batch] = by_k
            cap = derive_schedule({batch: by_k}, per_position)[batch]
    finally:
        engine.set_draft_len_schedule(saved)
    return costs


def measure_acceptance(engine: LLMEngine, prompts: list[list[int]] | None = None,
                       max_tokens: int = ACCEPTANCE_TOKENS) -> list[float]:
    """p_1..p_K of greedy decoding of `prompts` (default: a few shipped prompts, in the chat template where the
    model has one; random prompts without a tokenizer), `max_tokens` each, with the engine's K at every batch size."""
    from blockspec.data.eval_prompts import load_eval_prompts

    tok, K = engine.lm.tokenizer, engine.K
    if prompts is not None:
        pass
    elif tok is not None:
        texts = [p for name, n in ACCEPTANCE_PROMPTS for p in load_eval_prompts(name, n)]
        prompts = [tok.apply_chat_template([{"role": "user", "content": t}]) if tok.has_chat_template else tok.encode(t)
                   for t in texts]
    else:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, engine.lm.config.vocab_size, (16,), generator=g).tolist() for _ in range(4)]
    saved = engine.config.draft_len_schedule
    engine.set_draft_len_schedule({1: K})
    # each request must fit the pool alone (the scheduler runs them one after another where they do not fit together)
    room = min(engine.pool.num_blocks * engine.pool.block_size - engine.pool.block_size, engine.max_model_len)
    try:
        ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=max_tokens))
               for p in prompts if len(p) + max_tokens + K + 1 < room]
        outs = []
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.finished and o.request_id in ids]
    finally:
        engine.set_draft_len_schedule(saved)
    steps = [a for o in outs for a in o.acceptance_lengths]
    return [sum(a > i for a in steps) / max(1, len(steps)) for i in range(1, K + 1)]


def auto_schedule(engine: LLMEngine, use_cache: bool = True, prompts: list[list[int]] | None = None) -> Calibration:
    """The schedule for `engine` (see the module's docstring): the drafter's table for this device, else the cached
    calibration (measuring the batch sizes it lacks), else measured now. prompts: for the acceptance (tests)."""
    device = next(engine.lm.model.parameters()).device
    recorded = engine.proposer.default_draft_len_schedule(device)
    if recorded is not None:
        return Calibration(recorded, "drafter", device_name(device), engine.proposer.recorded_acceptance() or [],
                           engine.proposer.recorded_step_ms(device) or {})
    batches = [b for b in BATCHES if b <= engine.config.max_num_seqs]
    if engine.config.max_num_seqs not in batches and engine.config.max_num_seqs < max(BATCHES):
        batches.append(engine.config.max_num_seqs)
    key, record = calibration_key(engine)
    path = cache_dir() / f"{key}.json"
    cached = json.loads(path.read_text()) if use_cache and path.is_file() else {}
    step_ms = {int(b): {int(k): v for k, v in by_k.items()} for b, by_k in cached.get("step_ms", {}).items()}
    t0 = time.perf_counter()
    # the drafter's recorded acceptance (an evaluation set's worth of long answers) where it has one: a short run
    # here sees few steps, mostly of an answer's less predictable start
    per_position = (cached.get("per_position") or (prompts is None and engine.proposer.recorded_acceptance())
                    or measure_acceptance(engine, prompts))
    per_position = (list(per_position) + [0.0] * engine.K)[: engine.K]
    missing = [b for b in batches if b not in step_ms and not _drafts_nothing_below(step_ms, per_position, b)]
    if missing:
        measured = measure_costs(engine, per_position, missing)
        step_ms.update({b: {k: s * 1e3 for k, s in by_k.items()} for b, by_k in measured.items()})
    seconds = time.perf_counter() - t0
    schedule = schedule_for_batches(step_ms, per_position, batches)
    if missing or not cached:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"step_ms": step_ms, "per_position": per_position, "key": record,
                                   "date": time.strftime("%Y-%m-%d %H:%M")}, indent=1, default=str) + "\n")
        tmp.replace(path)  # atomic: two processes calibrating at once never leave half a file
    return Calibration(schedule, "measured" if missing else "cached", device_name(device), per_position,
                       step_ms, seconds if missing else 0.0)


def _drafts_nothing_below(step_ms: dict[int, dict[int, float]], per_position: list[float], batch: int) -> bool:
    """Whether a smaller measured batch already chose K = 0 (so this one would too)."""
    smaller = [b for b in step_ms if b < batch]
    return bool(smaller) and derive_schedule({max(smaller): step_ms[max(smaller)]}, per_position)[max(smaller)] == 0
