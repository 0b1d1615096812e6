"""Validated request -> engine work: prompt token ids, one SamplingParams per choice, stop strings.

Every check that depends on the model (tokenizer, vocabulary, context, KV pool) happens here, before anything reaches
the engine, and fails with APIError(400) naming the field."""

from __future__ import annotations

from dataclasses import dataclass

from blockspec.errors import BlockspecError, ConfigError
from blockspec.engine.sequence import check_prompt
from blockspec.loading.tokenizer import Tokenizer
from blockspec.sampling import SamplingParams
from blockspec.server.protocol import (SAMPLING_FIELDS, APIError, ChatCompletionRequest, CompletionRequest,
                                       SamplingRequest)

MAX_STOP_STRINGS = 16
MAX_CHOICES = 256  # prompts x n in one request


@dataclass
class ModelLimits:
    """What a request is checked against; read once from the engine."""

    name: str  # the served model name clients must send
    tokenizer: Tokenizer | None
    vocab_size: int
    max_model_len: int
    kv_capacity: int  # tokens the KV pool holds
    verify_slots: int  # K + 1 slots a speculative step needs beyond the tokens

    @property
    def servable_len(self) -> int:
        """The longest prompt + completion one request may have: the context, or less where the KV pool (which must
        also hold the verify slots) is smaller."""
        return min(self.max_model_len, self.kv_capacity - self.verify_slots)


@dataclass
class Choice:
    prompt_index: int
    params: SamplingParams


@dataclass
class Prepared:
    prompts: list[list[int]]  # token ids of each prompt
    choices: list[Choice]  # one engine request each; OpenAI's choice index: prompt_index * n + j = position here
    stop: list[str]  # stop strings (the text before the first one is returned)
    stream: bool
    include_usage: bool  # streams end with a usage chunk (non-streamed responses always carry usage)


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


def _check_text(text: str, param: str) -> None:
    """JSON strings may carry lone UTF-16 surrogates ("\\ud800"): not Unicode text, no tokenizer takes them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _bad(param, f"{param} contains a lone UTF-16 surrogate ({text[e.start]!r} at character {e.start}), "
                          f"which is not valid Unicode text") from None


def _stop_strings(stop: object, limits: ModelLimits) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop", "stop must be a non-empty string or a list of non-empty strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise _bad("stop", f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed")
    if stops and limits.tokenizer is None:
        raise _bad("stop", "stop strings need a tokenizer and this model has none; use stop_token_ids")
    return list(stops)


def _check_unsupported(req: SamplingRequest) -> None:
    """Fields OpenAI defines that blockspec does not implement are accepted only at their neutral values."""
    off = {"presence_penalty": req.presence_penalty == 0, "frequency_penalty": req.frequency_penalty == 0,
           "logit_bias": not req.logit_bias}
    if isinstance(req, CompletionRequest):
        off.update(logprobs=req.logprobs is None, echo=not req.echo, suffix=req.suffix is None,
                   best_of=req.best_of in (None, req.n))
    if isinstance(req, ChatCompletionRequest):
        off.update(logprobs=not req.logprobs, top_logprobs=req.top_logprobs is None)
    for name, ok in off.items():
        if not ok:
            raise _bad(name, f"{name} is not supported by blockspec; leave it out (see docs/serving.md)")


def _sampling(req: SamplingRequest, max_tokens: int, seed_offset: int, limits: ModelLimits) -> SamplingParams:
    stop_ids = req.stop_token_ids or []
    bad_ids = [t for t in stop_ids if not 0 <= t < limits.vocab_size]
    if bad_ids:
        raise _bad("stop_token_ids", f"stop_token_ids contains {bad_ids[0]}, outside the vocabulary "
                                     f"[0, {limits.vocab_size})")
    try:
        return SamplingParams(**{name: getattr(req, name) for name in SAMPLING_FIELDS},
                              seed=None if req.seed is None else req.seed + seed_offset,
                              max_tokens=max_tokens, stop_token_ids=list(stop_ids))
    except ConfigError as e:
        raise _bad(e.field or "sampling", str(e)) from None


def _kv_too_small(blamed: str, param: str, prompt_len: int, max_tokens: int, limits: ModelLimits) -> APIError:
    need = prompt_len + max_tokens + limits.verify_slots
    fix = f"lower {param}" if blamed == param else "shorten the prompt"
    return _bad(blamed, f"the request needs up to {need} KV slots (prompt {prompt_len} + {param} {max_tokens} + "
                        f"{limits.verify_slots} verify slots) but the KV pool holds {limits.kv_capacity} "
                        f"(num_kv_blocks x block_size); raise num_kv_blocks / kv_cache_tokens or {fix}")


def _max_tokens(requested: int | None, default: int | None, param: str, prompt_param: str, prompt_len: int,
                limits: ModelLimits) -> int:
    room = limits.max_model_len - prompt_len  # >= 1: check_prompt passed
    if requested is not None and requested < 1:
        raise _bad(param, f"{param}={requested} must be >= 1")
    if requested is not None and requested > room:
        raise _bad(param, f"{param}={requested} is too large: the prompt has {prompt_len} tokens and the context "
                          f"is {limits.max_model_len} tokens, so at most {room} can be generated")
    fits = min(room, limits.kv_capacity - prompt_len - limits.verify_slots)  # what the KV pool can hold too
    if fits < 1:  # not even one token: the prompt is to blame
        raise _kv_too_small(prompt_param, param, prompt_len, requested or 1, limits)
    if requested is None:  # the default, within what the context and the pool allow
        return min(default or fits, fits)
    if requested > fits:
        raise _kv_too_small(param, param, prompt_len, requested, limits)
    return requested


def _build(req: SamplingRequest, prompts: list[list[int]], max_tokens: int | None, param: str,
           default_max: int | None, limits: ModelLimits) -> Prepared:
    if len(prompts) * req.n > MAX_CHOICES:
        raise _bad("n", f"{len(prompts)} prompts x n={req.n} choices is more than {MAX_CHOICES} in one request")
    _check_unsupported(req)
    stop = _stop_strings(req.stop, limits)
    choices = []
    prompt_param = "prompt" if isinstance(req, CompletionRequest) else "messages"
    for p, ids in enumerate(prompts):
        try:
            check_prompt(ids, limits.vocab_size, limits.max_model_len)
        except BlockspecError as e:
            raise _bad(prompt_param, str(e)) from None
        limit = _max_tokens(max_tokens, default_max, param, prompt_param, len(ids), limits)
        choices += [Choice(p, _sampling(req, limit, j, limits)) for j in range(req.n)]
    if req.stream_options is not None and not req.stream:
        raise _bad("stream_options", "stream_options is only allowed with stream: true")
    return Prepared(prompts, choices, stop, req.stream, req.stream_options is not None and
                    req.stream_options.include_usage)


def _check_model(req: SamplingRequest, limits: ModelLimits) -> None:
    if req.model != limits.name:
        raise APIError(400, f"model {req.model!r} is not served here; this server serves {limits.name!r}",
                       param="model", code="model_not_found")


def _prompt_ids(prompt: object, limits: ModelLimits) -> list[list[int]]:
    """OpenAI's prompt forms: a string, a list of strings, a token-id list, or a list of token-id lists."""

    def is_ids(x: object) -> bool:
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(prompt, str):
        texts = {"prompt": prompt}
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        texts = {f"prompt.{i}": p for i, p in enumerate(prompt)}
    elif is_ids(prompt) and prompt:
        return [prompt]
    elif isinstance(prompt, list) and prompt and all(is_ids(p) for p in prompt):
        return prompt
    else:
        raise _bad("prompt", "prompt must be a string, a list of strings, a list of token ids or a list of "
                             "token-id lists, and not empty")
    if limits.tokenizer is None:
        raise _bad("prompt", "this model has no tokenizer: pass the prompt as token ids")
    for param, text in texts.items():
        _check_text(text, param)
    return [limits.tokenizer.encode(t) for t in texts.values()]


def prepare_completion(req: CompletionRequest, limits: ModelLimits) -> Prepared:
    _check_model(req, limits)
    return _build(req, _prompt_ids(req.prompt, limits), req.max_tokens, "max_tokens", 16, limits)


def _message_text(content: object, i: int) -> str:
    param = f"messages.{i}.content"
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) and set(p) == {"type", "text"}
                                         for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise _bad(param, f"messages[{i}].content must be a string or a list of {{\"type\": \"text\", \"text\": "
                          f"...}} parts (only text is supported)")
    _check_text(content, param)
    return content


def prepare_chat(req: ChatCompletionRequest, limits: ModelLimits) -> Prepared:
    _check_model(req, limits)
    if not req.messages:
        raise _bad("messages", "messages must not be empty")
    tok = limits.tokenizer
    if tok is None or not tok.has_chat_template:
        raise _bad("messages", "this model has no chat template: use /v1/completions")
    messages = [{"role": m.role, "content": _message_text(m.content, i)} for i, m in enumerate(req.messages)]
    try:
        ids = tok.apply_chat_template(messages)
    except Exception as e:  # templates raise on message orders they do not accept
        raise _bad("messages", f"the model's chat template rejected the messages: {e}") from None
    use_new = req.max_completion_tokens is not None
    return _build(req, [ids], req.max_completion_tokens if use_new else req.max_tokens,
                  "max_completion_tokens" if use_new else "max_tokens", None, limits)
