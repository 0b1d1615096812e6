"""An engine's own decode step on synthetic inputs, for timing it apart from the engine around it
(benchmarks/step.py, benchmarks/moe_step.py): `LLMEngine.decode_step_bench(batch, K, context)`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from blockspec.engine.decode_step import DecodeBuffers, DecodeStep
from blockspec.errors import BlockspecError


@dataclass
class DecodeStepBench:
    """One decode step of `batch` requests at one context, each verifying K random tokens as drafts and proposing K,
    greedy, argmax drafts. Call under torch.inference_mode(). Every call runs the same step on the same inputs (the
    KV it writes is overwritten by the next call)."""

    graph: Callable[[], object]  # one replay of its CUDA graph (the first call warms up and captures it; CUDA only)
    eager: Callable[[], object]  # the same step uncaptured (what the graph captures)
    batch: int
    K: int
    context: int


def decode_step_bench(step: DecodeStep, batch: int, K: int, context: int, vocab_size: int) -> DecodeStepBench:
    """Inputs for `step`: random tokens, every request at position `context`, its blocks laid out in turn from
    block 0 (their KV is whatever the pool holds: the step's cost does not depend on it)."""
    pool = step.models.pool
    per = -(-(context + 2 * K + 2) // pool.block_size)  # blocks per request: its context and two verify windows
    if batch * per > pool.num_blocks:
        raise BlockspecError(f"a decode step bench of {batch} requests at context {context} needs {batch * per} KV "
                             f"blocks; the engine's pool has {pool.num_blocks} (raise num_kv_blocks)")
    buf = DecodeBuffers.allocate(batch, K, step.width, None, step.device)
    buf.input_ids.random_(0, vocab_size)
    buf.start.fill_(context)
    buf.valid.fill_(True)
    buf.block_tables[:, :per] = torch.arange(batch * per, device=step.device).view(batch, per)
    state = step.models.state
    if state is not None:  # a hybrid target: a state slot per request (the sink excluded)
        buf.state_slots.copy_(torch.arange(batch, device=step.device) % max(1, state.num_slots - 1))
    rows = buf.sampling  # greedy rows (SamplingRows.allocate)
    return DecodeStepBench(lambda: step.replay(buf, rows, K, K), lambda: step.forward(buf, rows, K), batch, K, context)
