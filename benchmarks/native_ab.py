"""Two builds of the native kernels in one process, call by call alternated (docs/results/2026-12-08-cpu-tiled-
attention-deferred-context.md): the bundled q4 target's layer stack at 1, 4 and 16 rows and the drafter's 16-row
block, after each --contexts tokens of one sequence, with the library this checkout builds and an older one (--old:
a .so built from another checkout's blockspec/native, e.g. `gcc -O3 -ffp-contract=off -fno-math-errno
-fno-trapping-math -fopenmp -shared -fPIC -march=native -o old.so *.c` there). On this shared VM a tree's runs
minutes apart move by 10-40 %; alternating calls in one process leaves the machine's drift out of the ratio.
Prints ms (medians of --reps per library) and new / old.
Usage: python -m benchmarks.native_ab --old OLD.so [--contexts 8,300,800] [--threads 2] [--reps 31]"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from benchmarks.cpu_native import bundled_native, stack_calls
from blockspec.native import lib, q4


def alternate(fn: Callable[[], object], libs: dict[str, object], reps: int) -> dict[str, float]:
    """Median ms of fn under each library, the order flipped every call."""
    times: dict[str, list[float]] = {name: [] for name in libs}
    own = q4.library
    for i in range(reps):
        for name in (list(libs) if i % 2 else list(libs)[::-1]):
            q4.library = lambda dll=libs[name]: dll  # what native_stack calls through
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    q4.library = own
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, required=True, help="the other build of blockspec/native (a .so)")
    ap.add_argument("--contexts", default="8,300,800")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=31)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    libs = {"old": lib.load(args.old), "new": q4.library()}
    loaded = bundled_native()
    if loaded is None or libs["new"] is None:
        print("the native kernels did not build here (or BLOCKSPEC_NATIVE=0): nothing to time")
        return 1
    lm, draft, pool = loaded
    for cache in (pool.k, pool.v, *pool.draft_k, *pool.draft_v):
        cache.normal_()  # keys of any magnitude: the attention's work does not depend on them
    for ctx in map(int, args.contexts.split(",")):
        ms = {name: alternate(call, libs, args.reps) for name, call in stack_calls(lm, draft, pool, ctx).items()}
        print(f"context {ctx}, {args.threads} thread(s), ms old -> new: " + ", ".join(
            f"{name} {m['old']:.2f} -> {m['new']:.2f} ({m['new'] / m['old']:.2f}x)" for name, m in ms.items()),
            flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
