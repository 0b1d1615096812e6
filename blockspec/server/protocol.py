"""OpenAI request bodies (strict types, unknown fields rejected, null for an optional field meaning its default), the
body read under a size limit, and the OpenAI-style error.

Fields whose JSON type is a union in OpenAI's API (`prompt`, `stop`, message `content`) are taken as raw JSON here
and checked by hand in prepare.py, so that their errors read as one sentence about the field instead of one pydantic
error per union member."""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator
from starlette.requests import Request

from blockspec.sampling import SamplingParams

MAX_N = 128  # choices per request, as OpenAI
MAX_SEED = 2**63 - 1  # torch generators take 64-bit seeds
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20  # several 128k-token contexts of text; big batches of token ids may need more


class APIError(Exception):
    """An error answered to one request, with OpenAI's body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def internal_error(request_id: str) -> APIError:
    return APIError(500, f"internal error while serving request {request_id}; the server log has the traceback",
                    type_="internal_error")


class _Body(BaseModel):
    """Strict types, unknown fields rejected, and `null` for an optional field means its default, as in OpenAI's API
    (its clients send null for parameters set to None)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        optional = {name for name, f in cls.model_fields.items() if not f.is_required()}
        return {k: v for k, v in data.items() if v is not None or k not in optional}


class StreamOptions(_Body):
    include_usage: bool = False


def _sampling_fields() -> dict[str, Any]:
    """The SamplingParams fields a request sets as they are (metadata "api": temperature, top_p, and the extensions
    top_k and min_p): name -> (type, default), the default OpenAI's where it differs ("api_default")."""
    hints = typing.get_type_hints(SamplingParams)
    return {f.name: (hints[f.name], f.metadata.get("api_default", f.default))
            for f in dataclasses.fields(SamplingParams) if f.metadata.get("api")}


SAMPLING_FIELDS = tuple(_sampling_fields())  # handed to SamplingParams under their own names (prepare.py)
_SamplingFields: Any = create_model("_SamplingFields", __base__=_Body, **_sampling_fields())


class SamplingRequest(_SamplingFields):
    """Fields shared by /v1/completions and /v1/chat/completions: the sampling fields above, and these."""

    model: str
    max_tokens: int | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Any = None  # str | list[str]
    seed: int | None = Field(None, ge=0, le=MAX_SEED)  # choice j of n samples with seed + j
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop_token_ids: list[int] | None = None  # extension: stop on these ids too (models without a tokenizer)
    user: str | None = None  # accepted and ignored
    # Accepted at their neutral values only (prepare._check_unsupported).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None


class CompletionRequest(SamplingRequest):
    prompt: Any  # str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: Any  # str | list of {"type": "text", "text": str}
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or APIError(413) once it is known to exceed `limit` bytes: from Content-Length before any
    of it is read, else as soon as the chunks received pass the limit (the rest is never read)."""

    def too_large() -> APIError:
        return APIError(413, f"the request body is larger than {limit} bytes, the limit of this server "
                             f"(blockspec serve --max-request-bytes)", code="request_too_large")

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large()
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large()
    return bytes(body)


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """Request bytes -> a validated request model, or APIError(400) naming the field."""

    def no_constants(name: str) -> None:
        raise ValueError(f"{name} is not valid JSON")

    try:
        data = json.loads(raw, parse_constant=no_constants)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = [str(p) for p in err["loc"]]
        field = ".".join(loc)
        if err["type"] == "extra_forbidden":
            raise APIError(400, f"unsupported request field {field!r}", param=field) from None
        if err["type"] == "missing":
            raise APIError(400, f"missing required field {field!r}", param=field) from None
        shown = json.dumps(err.get("input"))[:80]
        raise APIError(400, f"invalid value for {field!r}: {err['msg']} (got {shown})", param=field) from None
