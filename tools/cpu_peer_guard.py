"""The busy-machine guard of tools/cpu_peer_bench.py: which repeats of a row (engine x mode x threads) count.

A repeat does not count when the machine was busy around it (other processes kept >= max_busy CPUs busy, sampled just
before and just after that engine's run, or on average during it: the machine's busy CPU time, the hypervisor's steal
included, less this process's and its children's) or when its rate collapsed below half the median of the row's other
counted repeats (a burst of load the samples missed). The median is taken over the repeats that count only; every
discarded repeat is kept in the JSON with its reason."""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path


def busy_cpus(samples: int = 5, interval_s: float = 0.1) -> float:
    """CPUs kept busy by other processes now: runnable tasks (the 4th field of /proc/loadavg) less this one, averaged
    over samples * interval_s (the load average would also count this benchmark's own previous run)."""
    busy = []
    for _ in range(samples):
        busy.append(int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]) - 1)
        time.sleep(interval_s)
    return sum(busy) / samples


def cpu_mark() -> tuple[float, float, float]:
    """(wall clock, CPU seconds all CPUs spent busy since boot (steal included), CPU seconds of this process and its
    waited-for children): the start of a measurement for others_busy_since."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
    t = os.times()
    return (time.perf_counter(), (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"),
            t.user + t.system + t.children_user + t.children_system)


def others_busy_since(mark: tuple[float, float, float]) -> float:
    """CPUs kept busy on average since `mark` by everything but this process and its children."""
    now = cpu_mark()
    return max(0.0, (now[1] - mark[1]) - (now[2] - mark[2])) / max(1e-9, now[0] - mark[0])


def wait_quiet(limit: float, patience_s: float) -> dict:
    """Wait (up to patience_s) until other processes keep fewer than `limit` CPUs busy; what was seen."""
    start = time.time()
    busy = busy_cpus(10)
    while busy >= limit and time.time() - start < patience_s:
        print(f"  machine busy ({busy:.1f} CPUs in use by others): waiting", file=sys.stderr, flush=True)
        time.sleep(30)
        busy = busy_cpus(10)
    return {"busy_cpus": busy, "loadavg_1m": os.getloadavg()[0], "waited_s": round(time.time() - start)}


def judge(repeats: list[dict], max_busy: float) -> list[str | None]:
    """For each repeat ({"rate", "busy_before", "busy_after"[, "busy_during"]}) of one row: None if it counts, else
    why not. First the busy ones (before, during or after >= max_busy), then, among the rest, those whose rate is
    below half the median of the other counted repeats (with at least one other to compare with)."""
    reasons: list[str | None] = []
    for r in repeats:
        busy = max(r["busy_before"], r["busy_after"], r.get("busy_during", 0.0))
        why = (f"busy: others kept {r['busy_before']:.1f} CPUs busy before, {r.get('busy_during', 0):.1f} during, "
               f"{r['busy_after']:.1f} after (limit {max_busy:g})")
        reasons.append(why if busy >= max_busy else None)
    quiet = [i for i, why in enumerate(reasons) if why is None]
    for i in quiet:
        others = [repeats[j]["rate"] for j in quiet if j != i]
        if others and repeats[i]["rate"] < 0.5 * statistics.median(others):
            reasons[i] = (f"collapsed: {repeats[i]['rate']:.1f} tok/s is below half the median "
                          f"{statistics.median(others):.1f} of the row's other quiet repeats")
    return reasons


def summarize(repeats: list[dict], max_busy: float) -> dict:
    """A row's median over the repeats that count, with every repeat's rate and the discarded ones' reasons."""
    reasons = judge(repeats, max_busy)
    kept = [r["rate"] for r, why in zip(repeats, reasons) if why is None]
    return {"tokens_per_second": round(statistics.median(kept), 1) if kept else None,
            "repeats_counted": len(kept),
            "runs_tokens_per_second": [round(r["rate"], 1) for r in repeats],
            "discarded": [{"repeat": i + 1, "tokens_per_second": round(r["rate"], 1), "why": why}
                          for i, (r, why) in enumerate(zip(repeats, reasons)) if why is not None]}
