"""One choice's text as its tokens arrive: incremental detokenization and stop strings (OpenAI semantics: the text
before the first stop string is returned, the stop string itself is not)."""

from __future__ import annotations

from blockspec.loading.detokenizer import IncrementalDecoder
from blockspec.loading.tokenizer import Tokenizer


class ChoiceText:
    """Text of one choice. push() returns text that is final: neither part of a stop string nor held back because
    it could be the start of one. Unless a stop string cut it, the text once finished equals the tokenizer's decode
    of token_ids."""

    def __init__(self, tokenizer: Tokenizer | None, stop: list[str]) -> None:
        self.decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1  # chars that may be a stop string's beginning
        self.text = ""  # everything decoded so far, cut at a stop string once one is found
        self.sent = 0  # chars of self.text already returned
        self.token_ids: list[int] = []  # tokens consumed, up to the one that completed a stop string
        self.stopped = False

    def push(self, ids: list[int]) -> str:
        if self.stopped:
            return ""
        for t in ids:
            self.token_ids.append(t)
            if self.decoder is not None and self._append(self.decoder.push([t])):
                return self._release(len(self.text))
        return self._release(len(self.text) - self.hold)

    def finish(self) -> str:
        """The held-back rest, once no token will follow: the held-back characters and the decoder's held-back
        bytes of a character the last token left unfinished (decoded as U+FFFD, as decoding the ids gives it), which
        may still complete a stop string (then `stopped` is set)."""
        if self.decoder is not None and not self.stopped:
            self._append(_undecoded(self.decoder))
        return self._release(len(self.text))

    def _append(self, piece: str) -> bool:
        """Append decoded text; True when that completed a stop string (the text is then cut before it)."""
        start = max(0, len(self.text) - self.hold)  # a stop string may straddle the old end
        self.text += piece
        cut = min((k for k in (self.text.find(s, start) for s in self.stop) if k >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True
        return self.stopped

    def _release(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:upto], upto
        return out


def _undecoded(decoder: IncrementalDecoder) -> str:
    """The text of the tokens `decoder` has not released yet, partial characters included: what its push would
    return if it did not wait for a character to complete (decoding the same window keeps the spacing)."""
    tok, window = decoder.tokenizer, decoder.ids[decoder.prefix:]
    before, now = tok.decode(window[:decoder.read - decoder.prefix]), tok.decode(window)
    return now[len(before):] if len(now) > len(before) else ""
