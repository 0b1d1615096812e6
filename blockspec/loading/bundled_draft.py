"""The bundled DFlash drafter for the bundled target (SmolLM2-135M-Instruct), shipped inside the package."""

from __future__ import annotations

from pathlib import Path

from blockspec.errors import ModelLoadError

BUNDLED_DRAFT_DIR = Path(__file__).resolve().parent.parent / "drafters" / "smollm2-135m-dflash-b16"
FILES = ("config.json", "model.safetensors")


def bundled_draft_path() -> Path:
    """The drafter's directory (z-lab checkpoint format), or a clear error when this installation lacks it."""
    missing = [f for f in FILES if not (BUNDLED_DRAFT_DIR / f).is_file()]
    if missing:
        raise ModelLoadError(
            f"the bundled SmolLM2-135M-Instruct DFlash drafter is not available: {BUNDLED_DRAFT_DIR} lacks "
            f"{' and '.join(missing)}. Pass a drafter with --draft DIR (e.g. one trained with "
            f"`blockspec train-draft`)"
        )
    return BUNDLED_DRAFT_DIR
