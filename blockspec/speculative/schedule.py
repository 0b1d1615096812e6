"""The draft length K for each batch size, from what a step costs and what a draft is worth
(docs/decisions/calibration.md).

A step of B requests with K drafts each costs cost[B][K] seconds (K = 0: a plain step; a drafter that conditions on
the target still appends its context) and emits per request 1 + p_1 + ... + p_K tokens on average, where p_i is the
share of verify steps whose i-th draft was accepted (acceptance is a prefix, so p_i counts the drafts before it too).
The schedule takes, per batch size measured, the K that emits the most tokens per second, (1 + sum p_i) / cost[B][K]
(the smaller K on a tie), and K = 0 where no draft length pays. The engine uses the entry of the largest batch size
<= its running batch (EngineConfig.draft_len). A drafter directory may carry the tables it was measured with, per
device, in SCHEDULE_FILE (`python -m benchmarks.draft_len_schedule --install`): the engine's default schedule on that
device when none is given."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from blockspec.errors import ConfigError

SCHEDULE_FILE = "draft_len_schedule.json"


def expected_tokens(per_position: list[float], k: int) -> float:
    """Tokens a verify step of K drafts emits per request on average: the accepted drafts plus the bonus."""
    return 1.0 + sum(per_position[:k])


def derive_schedule(costs: dict[int, dict[int, float]], per_position: list[float]) -> dict[int, int]:
    """costs[batch][K] (seconds per step), per_position [K_max] -> {batch: K}. Draft lengths past the measured
    positions are not considered (their worth is unknown)."""
    schedule = {}
    for batch, by_k in sorted(costs.items()):
        ks = sorted(k for k in by_k if 0 <= k <= len(per_position))
        if not ks:
            raise ConfigError(f"draft length costs at batch {batch}: no K in 0..{len(per_position)} (measured "
                              f"{sorted(by_k)})")
        schedule[batch] = max(ks, key=lambda k: expected_tokens(per_position, k) / by_k[k])  # first max: smallest K
    return schedule


def schedule_for_batches(step_ms: dict[int, dict[int, float]], per_position: list[float],
                         batches: list[int]) -> dict[int, int]:
    """{batch: K} for every batch size asked from the costs measured (step_ms[batch][K], any unit): a batch not
    measured takes the K of the largest measured one below it (the first measured batch that drafts nothing has
    stopped the measuring: none above it drafts either), K = 0 below the smallest."""
    derived = derive_schedule({b: by_k for b, by_k in step_ms.items() if by_k}, per_position) if step_ms else {}
    out: dict[int, int] = {}
    for b in sorted(set(batches) | set(derived)):
        below = [k for k in derived if k <= b]
        out[b] = derived[b] if b in derived else (derived[max(below)] if below else 0)
    return out


def device_key(device: torch.device) -> str:
    """The name a schedule is recorded under: the GPU's model, or "cpu" (costs differ between machines)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def load_schedule(directory: Path, device: torch.device) -> dict[int, int] | None:
    """The schedule recorded for this device in a drafter directory's SCHEDULE_FILE; None without one."""
    path = directory / SCHEDULE_FILE
    if not path.is_file():
        return None
    try:
        entry = json.loads(path.read_text()).get(device_key(device))
        return None if entry is None else {int(b): int(k) for b, k in entry["schedule"].items()}
    except (json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{path}: not a draft length schedule file ({type(e).__name__}: {e})") from None


def load_step_ms(directory: Path, device: torch.device) -> dict[int, dict[int, float]] | None:
    """The step costs ({batch: {K: ms}}) recorded beside this device's schedule in a drafter directory's
    SCHEDULE_FILE, or None (no file, no entry for the device, or no costs in it)."""
    path = directory / SCHEDULE_FILE
    if not path.is_file():
        return None
    try:
        entry = json.loads(path.read_text()).get(device_key(device)) or {}
        costs = entry.get("step_ms")
        return {int(b): {int(k): float(ms) for k, ms in by_k.items()} for b, by_k in costs.items()} if costs else None
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError) as e:
        raise ConfigError(f"{path}: not a draft length schedule file ({type(e).__name__}: {e})") from None


def recorded_acceptance(directory: Path) -> list[float] | None:
    """The per-position acceptance recorded in a drafter directory's SCHEDULE_FILE (a property of the drafter and
    its target measured over an evaluation set, not of the device: the first entry that has one), or None."""
    path = directory / SCHEDULE_FILE
    if not path.is_file():
        return None
    try:
        tables = json.loads(path.read_text())
        return next((list(map(float, t["per_position_acceptance"])) for t in tables.values()
                     if isinstance(t, dict) and t.get("per_position_acceptance")), None)
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError) as e:
        raise ConfigError(f"{path}: not a draft length schedule file ({type(e).__name__}: {e})") from None


def fingerprint(path: Path | None) -> list:
    """Name, size and modification time of a model's files: a changed checkpoint is calibrated again."""
    if path is None:
        return []
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    return [(f.name, f.stat().st_size, int(f.stat().st_mtime)) for f in files if f.is_file() and f.name !=
    SCHEDULE_FILE]


def install_schedule(directory: Path, device: torch.device, table: dict) -> Path:
    """Record `table` (its "schedule" and how it was measured) for this device in the directory's SCHEDULE_FILE,
    keeping the other devices' entries."""
    path = directory / SCHEDULE_FILE
    tables = json.loads(path.read_text()) if path.is_file() else {}
    tables[device_key(device)] = table
    path.write_text(json.dumps(tables, indent=1) + "\n")
    return path
