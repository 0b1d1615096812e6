"""Resolve what the user passed as a model (local HF dir, .gguf file, hub id, or nothing) into config + weights."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from blockspec.errors import ModelLoadError
from blockspec.loading.tokenizer import Tokenizer


@dataclass
class ModelSource:
    name: str  # what the user passed (for messages)
    path: Path  # the directory or .gguf file it resolved to
    config: dict[str, Any]  # HF config.json-style dict
    tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]  # HF-named tensors, lazily
    load_tokenizer: Callable[[], Tokenizer | None]
    generation_config: dict[str, Any] = field(default_factory=dict)


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]


def _read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.exists():
        raise ModelLoadError(f"{path}: {what} is missing")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: {what} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: {what} must be a JSON object")
    return data


def from_hf_dir(d: Path, name: str) -> ModelSource:
    from blockspec.loading.safetensors_io import iter_safetensors, safetensors_files
    from blockspec.loading.tokenizer import load_hf_tokenizer

    config = _read_json(d / "config.json", "config.json")
    files = safetensors_files(d)
    gen_path = d / "generation_config.json"
    gen = _read_json(gen_path, "generation_config.json") if gen_path.exists() else {}
    return ModelSource(name, d, config, lambda: iter_safetensors(files), lambda: load_hf_tokenizer(str(d)), gen)


def from_gguf(f: Path, name: str) -> ModelSource:
    from blockspec.loading.gguf_io import load_gguf_tokenizer, read_gguf

    g = read_gguf(f)

    def tok() -> Tokenizer:
        return Tokenizer(load_gguf_tokenizer(f), str(f))

    return ModelSource(name, f, g.config, g.tensors, tok, {})


def from_hub(repo_id: str) -> ModelSource:
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS)
    except Exception as e:
        raise ModelLoadError(
            f"cannot download {repo_id!r} from the Hugging Face Hub ({type(e).__name__}). If this machine is "
            f"offline, download the model elsewhere and pass its local directory: --model /path/to/model_dir "
            f"(config.json + *.safetensors + tokenizer files), or a .gguf file"
        ) from None
    return from_hf_dir(Path(local), repo_id)


def resolve_source(src: str | None) -> ModelSource:
    """None -> the bundled default (SmolLM2-135M-Instruct); a directory; a .gguf file; or a hub id 'org/name'."""
    if src is None:
        from blockspec.loading.bundled import bundled_default_path

        path = bundled_default_path()
        return from_gguf(path, "SmolLM2-135M-Instruct (bundled default)")
    p = Path(src).expanduser()
    if p.is_dir():
        return from_hf_dir(p, src)
    if p.is_file():
        if p.suffix == ".gguf":
            return from_gguf(p, src)
        raise ModelLoadError(f"{src}: a model file must be .gguf; for safetensors pass the directory holding config.json")
    if _HUB_ID.match(src) and not src.startswith((".", "/")):
        return from_hub(src)
    raise ModelLoadError(f"model source {src!r} not found: not a directory, not a .gguf file, not a hub id (org/name)")
