"""Which Triton kernels compiled inside a timed region: a compile costs ~1 s on the GPU, so one inside a timed run
says the warm-up missed a shape (or a kernel specializes on a value that changes as the run goes) and that run's
time is not the engine's speed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def kernel_compiles() -> Iterator[list[str]]:
    """Yields a list that collects the name of every Triton kernel compiled (or loaded from Triton's disk cache)
    while the block runs; empty where Triton is absent or runs interpreted (CPU)."""
    names: list[str] = []
    try:
        from triton import knobs
    except ImportError:  # no Triton (or one without knobs): nothing compiles through it
        yield names
        return
    runtime = knobs.runtime
    previous = runtime.jit_cache_hook

    # Triton calls this before compiling a specialization it has not in memory; None lets the compile go on.
    def hook(*args, **kwargs) -> bool | None:
        fn = kwargs.get("fn")
        names.append(getattr(fn, "name", None) or str(kwargs.get("repr", "?")).split("[")[0])
        return previous(*args, **kwargs) if previous is not None else None

    runtime.jit_cache_hook = hook
    try:
        yield names
    finally:
        runtime.jit_cache_hook = previous
