"""Incremental detokenization for streaming output: emit only text that is final (no half UTF-8 characters)."""

from __future__ import annotations

from blockspec.loading.tokenizer import Tokenizer


class TextStreamer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.printed = ""

    def push(self, token: int) -> str:
        """Add one token; return the newly completed text (possibly empty)."""
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        if text.endswith("\ufffd") or not text.startswith(self.printed):
            return ""
        delta, self.printed = text[len(self.printed):], text
        return delta
