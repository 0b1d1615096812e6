"""Tokenizer + chat template behind one small interface (transformers' tokenizer classes only, never its models)."""

from __future__ import annotations

from typing import Any

from blockspec.errors import ModelLoadError


class Tokenizer:
    def __init__(self, hf_tokenizer: Any, source: str) -> None:
        self.hf = hf_tokenizer
        self.source = source

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=True))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        if not self.has_chat_template:
            raise ModelLoadError(f"{self.source}: the tokenizer has no chat template (drop --chat or use a chat model)")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        # The template already contains any BOS it wants; do not add special tokens a second time.
        return list(self.hf.encode(text, add_special_tokens=False))


def load_hf_tokenizer(model_dir: str) -> Tokenizer | None:
    """The tokenizer of a local HF directory, or None when it ships no tokenizer files."""
    from pathlib import Path

    d = Path(model_dir)
    if not any((d / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True, trust_remote_code=False)
    except Exception as e:
        raise ModelLoadError(f"{d}: cannot load the tokenizer ({type(e).__name__}: {e})") from None
    return Tokenizer(tok, str(d))
