"""The two generation endpoints: a request body in, one JSON response or server-sent events out.

/v1/chat/completions and /v1/completions differ only in how a prompt is made (chat template or raw text /
token ids) and in the shape of a choice (a message or a delta, or plain text); `ChatFormat` and
`CompletionFormat` hold those differences and everything else is shared.

Streaming: each engine output is cumulative, so a chunk carries the text added since the last one. The stream
ends with each choice's finish_reason ("stop", "length", or "abort" when the server stopped the request),
then a usage chunk when stream_options.include_usage asks for it, then `data: [DONE]`. An error after the
response has started comes as one `data: {"error": ...}` event before [DONE].

A client that disconnects is noticed while its request waits or runs, and the request is aborted (its KV
blocks freed before the next step): streams through Starlette's disconnect listener, which cancels the
body iterator; non-streaming requests by racing the wait against the connection's http.disconnect.
"""

from __future__ import annotations

import asyncio
import json
from json.encoder import encode_basestring as _json_string  # json.dumps's, ensure_ascii=False
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from tinyvllm.engine import RequestOutput
from tinyvllm.server.engine_loop import EngineLoop, RequestAborted, RequestStream
from tinyvllm.server.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from tinyvllm.server.prompts import PromptEncoder
from tinyvllm.server.protocol import APIError, ChatCompletionRequest, GenerationRequest
from tinyvllm.server.sampling import to_sampling_params


@dataclass
class ServerContext:
    engine_loop: EngineLoop
    encoder: PromptEncoder
    model_name: str


class ChatFormat:
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"
    # json.dumps(delta(INDEX, TEXT, None, None)) is A + INDEX + B + json.dumps(TEXT) + C
    text_delta_template = ('{"index": ', ', "delta": {"content": ', '}, "logprobs": null, "finish_reason": null}')

    @staticmethod
    def choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish_reason}

    @staticmethod
    def delta(index: int, text: str | None, finish_reason: str | None, logprobs: dict | None) -> dict:
        # text "" (tokens that decode to no text) is content "", as vLLM sends; None (an abort) is no content
        return {"index": index, "delta": {"content": text} if text is not None else {}, "logprobs": logprobs,
                "finish_reason": finish_reason}

    @staticmethod
    def opening(index: int) -> dict | None:
        """The first chunk says who speaks, for each choice (OpenAI's streams do)."""
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}


class CompletionFormat:
    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"
    text_delta_template = ('{"index": ', ', "text": ', ', "logprobs": null, "finish_reason": null}')

    @staticmethod
    def choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    @staticmethod
    def delta(index: int, text: str | None, finish_reason: str | None, logprobs: dict | None) -> dict:
        return CompletionFormat.choice(index, text or "", finish_reason, logprobs)

    @staticmethod
    def opening(index: int) -> dict | None:
        return None


class LogprobWindow:
    """The logprobs of one choice's tokens [start, end) in the format's shape; None when none were asked for.
    Streams send each token's logprobs once, with the chunk after which it was read back."""

    def __init__(self, fmt, num_top: int | None):
        self.fmt = fmt
        self.num_top = num_top
        self.sent: dict[int, int] = {}         # choice index -> tokens whose logprobs were sent
        self.offset: dict[int, int] = {}       # choice index -> characters of those tokens' texts

    def next(self, c) -> dict | None:
        if self.num_top is None or c.logprobs is None:
            return None
        start, end = self.sent.get(c.index, 0), len(c.token_ids)
        if start == end:
            return None
        self.sent[c.index] = end
        if self.fmt is ChatFormat:
            return chat_logprobs(c.token_ids[start:end], c.logprobs[start:end], self.num_top)
        window = completion_logprobs(c.token_ids[start:end], c.logprobs[start:end], self.num_top,
                                     self.offset.get(c.index, 0))
        self.offset[c.index] = window["text_offset"][-1] + len(window["tokens"][-1])
        return window


async def generate(http_request: Request, request: GenerationRequest, ctx: ServerContext) -> Response:
    """Answer one generation request; raises APIError for what the client got wrong."""
    arrival = time.perf_counter()
    if request.model != ctx.model_name:
        raise APIError(404, f"the model {request.model!r} does not exist: this server serves {ctx.model_name!r}",
                       param="model", code="model_not_found")
    chat = isinstance(request, ChatCompletionRequest)
    fmt = ChatFormat if chat else CompletionFormat
    if chat:
        messages = [m.template_message() for m in request.messages]
        prompt_ids = await asyncio.to_thread(ctx.encoder.chat, messages)
    else:
        prompt_ids = await asyncio.to_thread(ctx.encoder.completion, request.single_prompt())
    field, requested = request.max_tokens_field
    info = ctx.engine_loop.info
    params = to_sampling_params(request, ctx.encoder.max_tokens(prompt_ids, requested, field), field,
                                info.config.vocab_size, info.max_num_seqs)
    stream = ctx.engine_loop.submit(prompt_ids, params, final_only=not request.stream, arrival=arrival)
    head = {"id": fmt.id_prefix + uuid.uuid4().hex, "created": int(time.time()), "model": ctx.model_name}
    if request.stream:
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        num_choices = getattr(params, "n", 1)  # an engine without n: one choice
        window = LogprobWindow(fmt, getattr(params, "logprobs", None))
        return EventStream(_events(stream, fmt, head, num_choices, window, len(prompt_ids), include_usage), stream)
    try:
        final = await _unless_disconnected(http_request, _last_output(stream))
    finally:
        stream.close()
    if final is None:
        return Response(status_code=499)  # the client has gone: nobody reads this
    window = LogprobWindow(fmt, getattr(params, "logprobs", None))
    choices = [fmt.choice(c.index, c.text, c.finish_reason, window.next(c)) for c in final.outputs]
    if getattr(params, "prompt_logprobs", None) is not None:  # vLLM's extra, on completions
        for choice in choices:
            choice["prompt_logprobs"] = prompt_logprobs(final.prompt_logprobs)
    return JSONResponse({**head, "object": fmt.object, "choices": choices, "usage": usage(final)})


def usage(out: RequestOutput | None, num_prompt_tokens: int = 0) -> dict:
    """OpenAI's usage block; `out` None (nothing generated yet) counts the prompt only."""
    prompt = len(out.prompt_token_ids) if out is not None else num_prompt_tokens
    completion = sum(len(c.token_ids) for c in out.outputs) if out is not None else 0
    cached = out.num_cached_tokens if out is not None else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def _last_output(stream: RequestStream) -> RequestOutput:
    final = None
    async for final in stream.outputs():
        pass
    return final


async def _unless_disconnected(http_request: Request, work) -> object | None:
    """Run `work` unless the client disconnects first (then cancel it and return None)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(http_request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


async def _disconnected(http_request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect, whenever it comes.
    while (await http_request.receive())["type"] != "http.disconnect":
        pass


def _sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


class ChunkEvent:
    """One stream's token chunks as SSE events: `_sse({**chunk, "choices": choices, **extra})` with the fields
    that never change (id, object, created, model, usage null) rendered once per stream, so each of the
    thousands of chunks per second serializes only its choices.

    A choice that only carries text (no finish_reason, no logprobs: nearly every chunk) is rendered from the
    format's template around the JSON string of the text, json.dumps's own output without its per-call cost
    (a JSONEncoder and a C encoder made for each call, a few microseconds per chunk)."""

    def __init__(self, chunk: dict, include_usage: bool, fmt):
        head = json.dumps(chunk, ensure_ascii=False)
        self._prefix = "data: " + head[:-1] + ', "choices": ['
        self._suffix = '], "usage": null}\n\n' if include_usage else "]}\n\n"
        self._fmt = fmt
        self._a, self._b, self._c = fmt.text_delta_template

    def choice(self, index: int, text: str | None, finish_reason: str | None, logprobs: dict | None) -> str:
        """The JSON of one choice's delta."""
        if finish_reason is None and logprobs is None and text:
            return f"{self._a}{index}{self._b}{_json_string(text)}{self._c}"
        return json.dumps(self._fmt.delta(index, text, finish_reason, logprobs), ensure_ascii=False)

    def __call__(self, choices: list[str]) -> str:
        """The event of choices rendered by `choice`."""
        return self._prefix + ", ".join(choices) + self._suffix


async def _events(stream: RequestStream, fmt, head: dict, num_choices: int, window: LogprobWindow,
                  num_prompt_tokens: int, include_usage: bool) -> AsyncIterator[str]:
    chunk = {**head, "object": fmt.chunk_object}
    extra = {"usage": None} if include_usage else {}
    event = ChunkEvent(chunk, include_usage, fmt)
    sent: dict[int, int] = {}        # choice index -> characters sent
    tokens: dict[int, int] = {}      # choice index -> tokens generated when its last chunk was sent
    done: set[int] = set()           # choices whose finish_reason was sent
    last: RequestOutput | None = None
    openings = [fmt.opening(i) for i in range(num_choices)]
    if openings[0] is not None:
        yield _sse({**chunk, "choices": openings, **extra})
    logprobs = None
    try:
        async for last in stream.outputs():
            choices = []
            for c in last.outputs:
                index = c.index
                if index in done:
                    continue
                text = c.text[sent.get(index, 0):]
                sent[index] = len(c.text)
                # New tokens make a chunk even without new text (special tokens that decoding skips, the first
                # bytes of a UTF-8 character): its text is "", as vLLM's server sends, so that a client sees
                # tokens arrive (a benchmark's TTFT is the first chunk with choices) rather than a silent stream
                num_tokens = len(c.token_ids)
                grew = num_tokens > tokens.get(index, 0)
                tokens[index] = num_tokens
                if window.num_top is not None:
                    logprobs = window.next(c)
                if c.finish_reason is not None:
                    done.add(index)
                if text or grew or logprobs or c.finish_reason is not None:
                    choices.append(event.choice(index, text, c.finish_reason, logprobs))
            if choices:
                yield event(choices)
    except RequestAborted:
        aborted = [fmt.delta(i, None, "abort", None) for i in range(num_choices) if i not in done]
        yield _sse({**chunk, "choices": aborted, **extra})
    except APIError as exc:
        yield _sse(exc.body())
    if include_usage:
        yield _sse({**chunk, "choices": [], "usage": usage(last, num_prompt_tokens)})
    yield _sse("[DONE]")


class EventStream(StreamingResponse):
    """Server-sent events that close their request however the response ends: done, failed, or cancelled by
    a disconnect, even one that comes before the body iterator has started (whose own `finally` would then
    never run, leaving the request running and counted against the server's limit)."""

    def __init__(self, events: AsyncIterator[str], stream: RequestStream):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.close()
