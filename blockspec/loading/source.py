"""Resolve what the user passed as a model (local HF dir, .gguf file, hub id, or nothing) into config + weights."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from blockspec.errors import ModelLoadError
from blockspec.loading.tokenizer import Tokenizer

if TYPE_CHECKING:  # annotations only: check_source runs before the CLI imports torch (`--help` and bad inputs fast)
    import torch


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


def _hub_id(src: str) -> bool:
    """Whether `src`, found neither as a directory nor as a file, is read as a hub id 'org/name': not when it ends in
    .gguf (a local file that is missing) or when its org part is a local directory (then it names a missing entry of
    that directory, not a repository)."""
    return bool(_HUB_ID.match(src)) and not src.endswith(".gguf") and not Path(src.partition("/")[0]).is_dir()


def _not_found(src: str) -> str:
    """Why `src`, which is neither a directory nor a file, is not taken as a model source either."""
    org, _, name = src.partition("/")
    if _HUB_ID.match(src) and Path(org).is_dir():  # read as a hub id but for this directory: say why not the hub
        return (f"{org}/ is a local directory without {name} (a hub id is looked up only when no local directory "
                f"has its org's name)")
    if src.startswith((".", "/", "~")) or src.endswith(".gguf"):
        return "no such file or directory"
    return "not a directory, not a .gguf file, not a hub id (org/name)"


def _not_gguf(src: str) -> str:
    return f"{src}: a model file must be .gguf; for safetensors pass the directory holding config.json"


def check_source(src: str | None, flag: str) -> None:
    """What resolve_source would refuse without reading a weight, checked before anything loads: a local path that
    does not exist, a directory without config.json, a file that is not .gguf. The message starts with `flag` (the
    flag or argument the source came from) so that the user knows which input it is. Hub ids and None (the bundled
    default) pass: they cannot be checked offline cheaply."""
    if src is None:
        return
    p = Path(src).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"{flag} {src}: not a model directory: {p / 'config.json'} is missing")
    elif p.is_file():
        if p.suffix != ".gguf":
            raise ModelLoadError(f"{flag} {_not_gguf(src)}")
    elif not _hub_id(src):
        raise ModelLoadError(f"{flag} {src}: not found: {_not_found(src)}")


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
        raise ModelLoadError(_not_gguf(src))
    if _hub_id(src):
        return from_hub(src)
    raise ModelLoadError(f"model source {src!r} not found: {_not_found(src)}")
