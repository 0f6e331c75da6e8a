"""A request's sampling fields as `SamplingParams`, refusing what the engine cannot do yet.

Which fields the engine supports is read from SamplingParams' own dataclass fields when a request comes in,
so a parameter that SamplingParams gains (penalties, logit_bias, n, logprobs) is served from that moment,
with no change here. Until then a request that sets it to anything but its neutral value (n=1, a penalty
of 0, a repetition_penalty of 1, an empty logit_bias) gets a 400 naming the field: answering as if it had
been applied would be wrong output without a word.

Range checks are SamplingParams' own; its errors are re-worded with the field name the client used. The
server adds the checks that depend on the model (token ids within the vocabulary, n within max_num_seqs) and
keeps top_k within the vocabulary (any top_k >= the vocabulary size keeps every token: it means "off").
"""

from __future__ import annotations

import dataclasses
import re

from tinyvllm.sampling_params import SamplingParams
from tinyvllm.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, GenerationRequest

# A value that asks nothing of the engine: a request may send it even where the engine lacks the field.
NEUTRAL = {"n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": {}}

# Fields passed to SamplingParams under the same name, when the request sets them.
SAME_NAME = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "ignore_eos", "stop",
             "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty")

# The engine draws its own seeds from 63 bits; a larger one is refused here rather than overflow later.
MAX_SEED = 2**63 - 1


def supported_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(SamplingParams)}


def requested_values(request: GenerationRequest, vocab_size: int) -> dict[str, tuple[str, object]]:
    """SamplingParams field -> (the request's field name, value), for each field the request sets."""
    values = {name: (name, getattr(request, name)) for name in SAME_NAME if getattr(request, name) is not None}
    if request.top_k is not None and request.top_k > vocab_size:
        values["top_k"] = ("top_k", vocab_size)  # the same distribution, in the engine's int32
    if request.logit_bias is not None:
        values["logit_bias"] = ("logit_bias", _token_bias(request.logit_bias, vocab_size))
    if isinstance(request, ChatCompletionRequest):
        if request.logprobs:
            # chat: logprobs=true asks for the sampled token's, top_logprobs for that many alternatives
            values["logprobs"] = ("logprobs", request.top_logprobs or 0)
    elif isinstance(request, CompletionRequest):
        if request.logprobs is not None:
            values["logprobs"] = ("logprobs", request.logprobs)
        if request.prompt_logprobs is not None:
            values["prompt_logprobs"] = ("prompt_logprobs", request.prompt_logprobs)
    return values


def to_sampling_params(request: GenerationRequest, max_tokens: int, max_tokens_field: str, vocab_size: int,
                       max_n: int) -> SamplingParams:
    """The request's SamplingParams; `max_tokens` is already resolved against the context (prompts.py)."""
    values = requested_values(request, vocab_size)
    if "seed" in values and not 0 <= request.seed <= MAX_SEED:
        raise APIError(400, f"seed must be in [0, {MAX_SEED}], got {request.seed}", param="seed")
    if request.n is not None and request.n > max_n:
        raise APIError(400, f"n must be at most {max_n} (the server's max_num_seqs), got {request.n}", param="n")
    supported = supported_fields()
    kwargs = {"max_tokens": max_tokens}
    names = {"max_tokens": max_tokens_field}
    for name, (field, value) in values.items():
        if name not in supported:
            if name in NEUTRAL and value == NEUTRAL[name]:
                continue
            raise APIError(400, f"{field} is not supported by this server yet", param=field,
                           code="unsupported_parameter")
        kwargs[name] = value
        names[name] = field
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:  # SamplingParamsError is a ValueError
        raise _reworded(exc, names) from None


def _token_bias(bias: dict[str, float], vocab_size: int) -> dict[int, float]:
    """logit_bias comes keyed by token ids written as strings (JSON keys); SamplingParams keys by int."""
    out = {}
    for key, value in bias.items():
        if not (re.fullmatch(r"\d{1,10}", key) and int(key) < vocab_size):
            raise APIError(400, f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}",
                           param="logit_bias")
        out[int(key)] = value
    return out


def _reworded(exc: Exception, names: dict[str, str]) -> APIError:
    """SamplingParams' error, naming the request's field ("SamplingParams.max_tokens" -> "max_completion_tokens")."""
    message = str(exc)
    found = re.search(r"SamplingParams\.(\w+)", message)
    if found is None:
        return APIError(400, message)
    field = names.get(found.group(1), found.group(1))
    return APIError(400, message.replace(found.group(0), field), param=field)
