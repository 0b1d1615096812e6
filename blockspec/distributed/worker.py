"""What every rank runs: load the models, shard them, build the same engine as rank 0, replay rank 0's calls.

Rank 0 owns the scheduler. Each engine step it broadcasts the runner call it is about to make (a StepMessage with
the scheduled sequences, pickled over the gloo control group); every other rank makes the same call on its shard.
Cost: the pickled sequences carry their token ids, so a message is O(batch x context) bytes per step — small next to
a target forward at the batch sizes the engine runs (a few hundred KB at batch 64 x 2k tokens); a delta protocol
would cut it if it ever shows in a profile."""

from __future__ import annotations

import dataclasses
import os
import traceback
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.distributed.parallel_state import TPGroup, destroy_tp, init_tp
from blockspec.distributed.shard import shard_pair
from blockspec.engine.llm_engine import build_runner
from blockspec.engine.model_runner import ModelRunner
from blockspec.engine.scheduler import ScheduledSeq
from blockspec.engine.sequence import Sequence
from blockspec.loading.draft_loader import LoadedDraft, load_draft
from blockspec.loading.loader import LoadConfig, LoadedModel, load_model, resolve_device, resolve_dtype
from blockspec.speculative.acceptance import TargetAcceptance
from blockspec.speculative.drafts import Drafts
from blockspec.speculative.registry import as_proposer
from blockspec.speculative.stats import SpecStats


@dataclass(frozen=True)
class ModelSpec:
    """Where every rank reads the models from and how (picklable: it is sent to the spawned ranks): the target's
    source, its LoadConfig (device: the ranks' device type) and the drafter's SpeculativeConfig (None: none)."""

    source: str | None
    load: LoadConfig
    speculative: SpeculativeConfig | None

    def load_models(self, with_tokenizer: bool) -> tuple[LoadedModel, LoadedDraft | None]:
        """The full models on the CPU in the final dtype (sharded, then moved to the rank's device)."""
        dtype = str(resolve_dtype(self.load.dtype, resolve_device(self.load.device))).removeprefix("torch.")
        lm = load_model(self.source, replace(self.load, device="cpu", dtype=dtype, with_tokenizer=with_tokenizer))
        draft = load_draft(self.speculative, lm) if self.speculative is not None else None
        return lm, draft


@dataclass
class StepMessage:
    kind: str  # "step" | "stop"
    scheduled: list[ScheduledSeq] | None = None  # step


def portable(seq: Sequence) -> Sequence:
    """A copy with what the runner reads: no per-step history (trace, stats), the drafts' q on the CPU."""
    drafts = seq.drafts
    if drafts.probs is not None:
        drafts = Drafts(drafts.tokens, drafts.probs.cpu())
    return dataclasses.replace(seq, trace=[], stats=SpecStats(seq.stats.num_draft_tokens), drafts=drafts)


def _to_device(seq: Sequence, device: torch.device) -> Sequence:
    if seq.drafts.probs is not None:
        seq.drafts = Drafts(seq.drafts.tokens, seq.drafts.probs.to(device))
    return seq


def broadcast(tp: TPGroup, msg: StepMessage | None) -> StepMessage:
    box = [msg]
    dist.broadcast_object_list(box, src=0, group=tp.control)
    return box[0]  # type: ignore[return-value]


def serve(tp: TPGroup, runner: ModelRunner) -> None:
    """Ranks > 0: replay rank 0's runner calls until it says stop. Results are discarded (rank 0 commits)."""
    while True:
        msg = broadcast(tp, None)
        if msg.kind == "stop":
            return
        runner.step([dataclasses.replace(s, seq=_to_device(s.seq, tp.device)) for s in msg.scheduled])


def worker_main(rank: int, world: int, port: int, spec: ModelSpec, config: EngineConfig, ready) -> None:
    """Entry of a spawned rank. Reports on `ready` once loaded (or why it could not load), then serves."""
    if spec.load.device in (None, "cpu") and not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the ranks share the host's cores
    try:
        lm, draft = spec.load_models(with_tokenizer=False)
    except Exception:  # noqa: BLE001 - reported to rank 0, which raises it to the user
        ready.put((rank, traceback.format_exc()))
        return
    ready.put((rank, None))
    tp = init_tp(rank, world, port, resolve_device(spec.load.device))
    try:
        lm, draft = shard_pair(lm, draft, tp)
        # the runner alone: its models and KV pool, no scheduler (rank 0 schedules and broadcasts every call)
        serve(tp, build_runner(lm, as_proposer(draft), config, TargetAcceptance()))
    finally:
        destroy_tp()
