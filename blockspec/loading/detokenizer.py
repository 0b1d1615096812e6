"""Incremental detokenization of a growing token list (CLI streaming, the demo, the server's choices)."""

from __future__ import annotations

from blockspec.loading.tokenizer import Tokenizer


class IncrementalDecoder:
    """Decodes a growing token list in a sliding window instead of from the start every time.

    Decoding the window [prefix, end) and subtracting the decoded [prefix, read) keeps the spacing a tokenizer gives
    a token from its left neighbours, and text is released only once it does not end in a partial UTF-8 character
    (decoded as U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start: tokens before it are settled text
        self.read = 0  # tokens whose text has been released

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        now = self.tokenizer.decode(self.ids[self.prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return now[len(before):]
