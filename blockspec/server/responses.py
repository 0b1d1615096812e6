"""OpenAI response bodies and stream chunks for /v1/completions and /v1/chat/completions.

Extensions (documented in docs/serving.md): every choice and chunk carries `token_ids` (the generated ids it covers;
the only output of a model without a tokenizer) and `usage.acceptance` summarizes speculative decoding."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from blockspec.engine.outputs import FinishReason


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    acceptance_lengths: list[list[int]]  # per choice: tokens emitted per verify step (empty without a drafter)

    def body(self) -> dict[str, Any]:
        steps = [a for per_choice in self.acceptance_lengths for a in per_choice]
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "acceptance": {
                "mean_acceptance_length": sum(steps) / len(steps) if steps else None,
                "num_verify_steps": len(steps),
                "acceptance_lengths": self.acceptance_lengths,
            },
        }


@dataclass
class ResponseFormat:
    """What differs between the two endpoints: object names and where a choice's text goes."""

    chat: bool
    request_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def _envelope(self, choices: list[dict], chunk: bool) -> dict[str, Any]:
        if self.chat:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def response(self, texts: list[str], token_ids: list[list[int]], reasons: list[FinishReason | None],
                 usage: Usage) -> dict:
        choices = []
        for i, (text, ids, reason) in enumerate(zip(texts, token_ids, reasons)):
            body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
            choices.append({"index": i, **body, "logprobs": None, "finish_reason": _plain(reason), "token_ids": ids})
        return {**self._envelope(choices, chunk=False), "usage": usage.body()}

    def opening_chunks(self, n: int) -> list[str]:
        """Chat streams open each choice with the assistant role, as OpenAI does."""
        if not self.chat:
            return []
        return [self._sse(self._envelope([{"index": i, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None, "token_ids": []}],
                                          chunk=True))
                for i in range(n)]

    def chunk(self, index: int, text: str, token_ids: list[int], reason: FinishReason | None) -> str:
        body = {"delta": {"content": text}} if self.chat else {"text": text}
        choice = {"index": index, **body, "logprobs": None, "finish_reason": _plain(reason), "token_ids": token_ids}
        return self._sse(self._envelope([choice], chunk=True))

    def usage_chunk(self, usage: Usage) -> str:
        return self._sse({**self._envelope([], chunk=True), "usage": usage.body()})

    @staticmethod
    def error_chunk(error_body: dict) -> str:
        return ResponseFormat._sse(error_body)

    @staticmethod
    def _sse(obj: dict) -> str:
        return f"data: {json.dumps(obj)}\n\n"


DONE = "data: [DONE]\n\n"


def _plain(reason: FinishReason | None) -> str | None:
    """OpenAI's JSON carries the plain string ("stop", "length", ...)."""
    return None if reason is None else reason.value
