"""The draft pass of training under torch.compile, with the attention left outside the compiled graphs.

Why: a training micro-batch sends anchors x B rows (65,536 for the bundled drafter) through the draft layers, and in
eager mode every norm, rotary, SiLU gate, residual add and autocast cast is its own pass over [rows, hidden]: the
largest share of a step on the H200 (profile in docs/training.md). Compiling the layers fuses those passes.

The attention function is a new object per micro-batch (it holds that micro-batch's context K/V and masks), so it
is handed to the compiled model through one persistent holder whose call runs outside the graph: the guards see the
same object every time and nothing recompiles, and the attention keeps its own compiled FlexAttention kernels."""

from __future__ import annotations

import torch

from blockspec.models.dflash import DFlashDraftModel, DraftAttentionFn


class _OutsideGraph:
    """A stable stand-in for the current micro-batch's attention function (a graph break per draft layer)."""

    inner: DraftAttentionFn | None = None

    @torch._dynamo.disable
    def __call__(self, *args):  # type: ignore[no-untyped-def]
        assert self.inner is not None
        return self.inner(*args)


class CompiledDraftPass:
    """Callable like DFlashDraftModel.forward(embeds [Q, H], positions [Q], attn, rows) -> [Q, H]; the same
    parameters, so the optimizer, checkpoints and export see no difference. backend: torch.compile's ("inductor" on
    CUDA; the CPU tests use "aot_eager", which checks the graph breaks and autograd without generating code)."""

    def __init__(self, draft: DFlashDraftModel, backend: str = "inductor") -> None:
        self.compiled = torch.compile(draft, backend=backend, dynamic=False)
        self.attn = _OutsideGraph()

    def __call__(self, embeds: torch.Tensor, positions: torch.Tensor, attn: DraftAttentionFn,
                 rows: int | None = None) -> torch.Tensor:
        self.attn.inner = attn
        try:
            return self.compiled(embeds, positions, self.attn, rows)
        finally:
            self.attn.inner = None  # the micro-batch's K/V are not kept alive past its forward
