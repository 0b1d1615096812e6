"""The acceptance figure of `blockspec eval-draft`: histogram of tokens per verify step and per-position acceptance."""

from __future__ import annotations

from pathlib import Path

from blockspec.errors import BlockspecError
from blockspec.evaluation.eval_draft import DraftEvalReport


def write_acceptance_png(report: DraftEvalReport, path: str | Path, title: str) -> Path:
    try:
        from matplotlib.figure import Figure  # a bare Figure renders with Agg: no GUI backend, no global state
    except ImportError:
        raise BlockspecError("the acceptance PNG needs matplotlib: pip install 'blockspec[eval]'") from None
    k = report.num_draft_tokens
    steps = max(report.num_verify_steps, 1)
    fig = Figure(figsize=(11, 4), layout="constrained")
    hist, pos = fig.subplots(1, 2)
    hist.bar(range(1, k + 2), [c / steps for c in report.acceptance_histogram], color="tab:blue")
    if report.mean_acceptance_length is not None:
        hist.axvline(report.mean_acceptance_length, color="tab:red", linestyle="--",
                     label=f"tau = {report.mean_acceptance_length:.2f}")
        hist.legend()
    hist.set(xlabel="tokens emitted per verify step (acceptance length)", ylabel="fraction of verify steps",
             title=f"{report.num_verify_steps} verify steps", xticks=range(1, k + 2))
    pos.plot(range(1, k + 1), report.per_position_acceptance, marker="o", color="tab:green")
    pos.set(xlabel="draft position i", ylabel="fraction of steps accepting draft i", ylim=(0, 1.02),
            title="per-position acceptance", xticks=range(1, k + 1))
    fig.suptitle(title)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out
