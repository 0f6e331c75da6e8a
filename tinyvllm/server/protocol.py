"""The request bodies the server accepts and the error body it answers with, as in the OpenAI API.

Bodies are validated strictly: a field of the wrong JSON type is refused rather than coerced ("5" is not an
integer, true is not a number), NaN and infinities are refused, and an unknown field is refused by name, as
OpenAI's own API does ("max_token" is a typo the client should hear about, not a silently ignored field).
Sampling fields beyond OpenAI's are vLLM's extras (top_k, min_p, min_tokens, ignore_eos, repetition_penalty,
stop_token_ids). Whether the engine supports a field is decided in sampling.py, not here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class APIError(Exception):
    """A request the server refuses: the HTTP status and OpenAI's error body {"error": {...}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class TextPart(_Body):
    """One part of a message's content given as a list of parts (only text parts: the models are text-only)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart]
    name: str | None = None    # accepted as OpenAI's clients send it; chat templates do not use it

    def template_message(self) -> dict[str, str]:
        """The message as a chat template sees it: its text parts joined."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": content}


class StreamOptions(_Body):
    include_usage: bool = False


class GenerationRequest(_Body):
    """The fields both endpoints share; None means "not given" (the engine's default applies)."""

    model: str
    stream: bool | None = False          # null, as some clients send, means false
    stream_options: StreamOptions | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None    # an end-user id for the caller's own bookkeeping; not used
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None

    def check(self) -> None:
        """Rules between fields that pydantic's types do not express."""
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None               # OpenAI's older name of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def check(self) -> None:
        super().check()
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise APIError(400, "give max_tokens or max_completion_tokens, not both", param="max_completion_tokens")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")

    @property
    def max_tokens_field(self) -> tuple[str, int | None]:
        """The name the client used for the output limit, and its value."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


class CompletionRequest(GenerationRequest):
    # One prompt: text or token ids. A list of prompts is accepted when it holds exactly one.
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16                 # the API's default for completions (chat has none)
    logprobs: int | None = None
    prompt_logprobs: int | None = None          # vLLM's extra
    echo: bool | None = None
    suffix: str | None = None

    def check(self) -> None:
        super().check()
        if self.echo:
            raise APIError(400, "echo is not supported by this server yet", param="echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server (no insertion models)", param="suffix")
        if self.stream and self.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs come with non-streaming requests only", param="prompt_logprobs")

    @property
    def max_tokens_field(self) -> tuple[str, int | None]:
        return "max_tokens", self.max_tokens

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"prompt holds {len(prompt)} prompts; this server takes one per request "
                                    "(send one request each; they run batched)", param="prompt")
            return prompt[0]
        return prompt


def parse_body(model: type[GenerationRequest], raw: bytes) -> GenerationRequest:
    """The request body as `model`, or an APIError naming the first problem (its field, as a dotted path)."""
    try:
        request = model.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None
    request.check()
    return request


def validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first['ctx'].get('error', first['msg'])}")
    # Of the errors of a union's members, the one that got deepest into the body names the real problem
    # (content [{"type": "text", "text": 1}] is a bad text part, not a bad string).
    paths = [_field_path(e["loc"]) for e in errors]
    depth = max(len(p) for p in paths)
    deepest = [(e, p) for e, p in zip(errors, paths) if len(p) == depth]
    error, path = deepest[0]
    name = ".".join(map(str, path))
    kind = error["type"]
    if not name and kind in ("model_type", "model_attributes_type"):
        return APIError(400, "the body must be a JSON object")
    if kind == "extra_forbidden":
        return APIError(400, f"unknown field {name!r}", param=name)
    if kind == "missing":
        return APIError(400, f"{name} is required", param=name)
    alternatives = [_union_member(e["loc"]) for e, p in deepest if p == path]
    if len(alternatives) > 1 and all(alternatives):
        return APIError(400, f"{name}: expected {' or '.join(alternatives)}, got {_json_type(error['input'])}",
                        param=name)
    return APIError(400, f"{name}: {error['msg']}", param=name or None)


def _is_union_member(part) -> bool:
    # pydantic names a union's member in the error's location by its type: 'str', 'list[int]', 'TextPart'
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part or part[:1].isupper())


def _field_path(loc: tuple) -> tuple:
    return tuple(part for part in loc if not _is_union_member(part))


def _union_member(loc: tuple) -> str | None:
    members = [part for part in loc if _is_union_member(part)]
    return members[-1] if members else None


def _json_type(value) -> str:
    for python, json in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                         (list, "array"), (dict, "object"), (type(None), "null")):
        if isinstance(value, python):
            return json
    return type(value).__name__
