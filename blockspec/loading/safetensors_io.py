"""Read HF safetensors weights, single-file or sharded, lazily and with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from blockspec.errors import ModelLoadError


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from None
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"{index} lists shard files that do not exist: {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    others = sorted(model_dir.glob("*.safetensors"))
    if others:
        return others
    raise ModelLoadError(
        f"{model_dir}: no weights found (expected model.safetensors or model.safetensors.index.json)"
    )


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
            raise ModelLoadError(f"{f}: cannot read safetensors file ({e})") from None
        with handle:
            for name in handle.keys():
                try:
                    yield name, handle.get_tensor(name)
                except Exception as e:
                    raise ModelLoadError(f"{f}: tensor {name!r} is corrupt ({e})") from None
