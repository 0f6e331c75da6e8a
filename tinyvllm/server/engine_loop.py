"""The front end of the engine: HTTP handlers submit requests here and read their outputs; the engine core
(engine_core.py: in a process of its own, or in a thread of this one) steps the engine.

Per step the core sends the token ids it read back; here they become text, stop strings are looked for (a found
one is sent back to the core, which ends the completion there), and each request's output goes to its
RequestStream, all on the event loop. Outputs are cumulative, so a handler that falls behind gets only the newest:
the event loop's lag costs nothing but chunk count, while the core steps on.

A request whose handler goes away (the client hung up) is aborted: the command reaches the core before its next
step, which frees its KV blocks. If the core fails, every request in flight gets the error, /health reports it,
and new requests are refused, instead of hanging.

With an EngineThread the engine thread and the event loop share one interpreter lock, and only the engine
thread's host work is on the critical path. So, over a runner that computes asynchronously (the GPU), the event
loop does not contend for the lock while the engine thread works: before each chunk it waits, the lock released,
until the engine thread waits for the device or for commands (engine_core.EngineIdle).
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import sys
import time
from typing import AsyncIterator

from tinyvllm.engine import LLMEngine, RequestOutput
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.server.engine_core import EngineProcess, EngineThread, freeze_startup_heap
from tinyvllm.server.metrics import Metrics
from tinyvllm.server.protocol import APIError
from tinyvllm.server.request_state import RequestState


# Measured with tools/serve_benchmark.py --backend sim (256 requests at once, an EngineThread): 0.5 ms instead of
# 5 ms served 1.7x the output tokens/s; each forced switch costs a few microseconds.
SWITCH_INTERVAL_S = 0.0005

# A full queue drains at the engine's pace, a request every few steps: a second is a fair time to come back.
RETRY_AFTER_SECONDS = 1


class ServerBusy(APIError):
    """No room for the request now (the queue is full, or the server is stopping): 503 with Retry-After."""

    def __init__(self, message: str):
        super().__init__(503, message, type="server_error", code="server_busy",
                         headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


class EngineFailed(APIError):
    """A step raised (or the engine process died): the engine's state is unknown, so the server serves nothing
    more (503). `cause`: what the core said."""

    def __init__(self, cause: str):
        super().__init__(503, f"the engine failed and stopped: {cause}", type="server_error", code="engine_failed")


class RequestAborted(APIError):
    """The server stopped the request (the shutdown deadline passed): a stream gets a last event with
    finish_reason "abort", a non-streaming request this 503."""

    def __init__(self):
        super().__init__(503, "the server shut down before this request finished", type="server_error",
                         code="aborted")


class RequestStream:
    """One submitted request, seen from its handler: iterate `outputs()`, and always `close()` it (in a
    finally): closing before the last output aborts the request in the engine, which frees its KV blocks.

    NOTE: a mailbox of one output, not a queue: outputs are cumulative, so a consumer that falls behind needs
    only the newest, and at saturation (hundreds of streams, an output each every step) an asyncio.Queue's
    put and get were a good part of the event loop's cost per chunk."""

    __slots__ = ("_owner", "request_id", "finished", "_open", "_latest", "_error", "_waiter")

    def __init__(self, owner: "EngineLoop", request_id: str):
        self._owner = owner
        self.request_id = request_id
        self.finished = False
        self._open = True
        self._latest: RequestOutput | None = None   # the newest output not yet handed over
        self._error: BaseException | None = None    # the first error, handed over before any output
        self._waiter: asyncio.Future | None = None  # set while outputs() waits

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The outputs as the engine produces them (with final_only, just the last one). Each is cumulative,
        so when the consumer falls behind only the newest is handed over; an error (the request failed, was
        aborted by the server, or the engine stopped) is raised instead."""
        while not self.finished:
            if self._latest is None and self._error is None:
                self._waiter = self._owner._loop.create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            item, self._latest = self._latest, None
            self.finished = item.finished
            self._owner.engine_idle.wait()  # the engine thread first (see the module's docstring)
            yield item

    def close(self) -> None:
        if self._open:
            self._open = False
            self._owner._release(self.request_id, abort=not self.finished)

    # -- the event loop's side: what the engine thread's callbacks hand over

    def _put(self, output: RequestOutput) -> None:
        self._latest = output
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class EngineLoop:
    """The front end over an engine core: `submit` hands it a request and returns the request's RequestStream.
    `engine`: an LLMEngine (the core runs in a thread of this process) or an EngineProcess.

    At most `max_num_seqs + max_waiting_requests` requests are held at once (running or waiting); beyond that
    `submit` raises ServerBusy (503 with Retry-After) instead of queueing without bound.
    """

    def __init__(self, engine: LLMEngine | EngineProcess, metrics: Metrics, max_waiting_requests: int):
        self.core = engine if isinstance(engine, EngineProcess) else EngineThread(engine)
        self.info = self.core.info
        self.metrics = metrics
        self.max_requests = self.info.max_num_seqs + max_waiting_requests
        self.error: str | None = None
        self.accepting = True
        self.engine_idle = self.core.idle
        self._streams: dict[str, RequestStream] = {}   # requests whose handler listens
        self._requests: dict[str, RequestState] = {}   # requests in the engine
        self._stats = (0, 0, 0.0)                      # the core's last (running, waiting, KV cache used)
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._switch_interval: float | None = None   # the interpreter's, restored on stop
        self._gc_threshold: tuple[int, ...] | None = None   # the collector's, restored on stop

    # -- life cycle (event loop) ------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, SWITCH_INTERVAL_S))
        self._gc_threshold = freeze_startup_heap()
        self.core.start(self._loop, self._on_message)

    async def stop(self) -> None:
        """Stop the core after the step it is in; requests still held get RequestAborted."""
        self.accepting = False
        self.abort_all()
        await self.core.stop()
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
        if self._gc_threshold is not None:
            gc.set_threshold(*self._gc_threshold)
            gc.unfreeze()  # what this process frees from now on is collected again

    def drain(self, timeout: float) -> None:
        """Stop accepting requests; those in flight have `timeout` seconds to finish, then are aborted. Safe
        to call from a signal handler or another thread: the work is done on the event loop."""
        self._loop.call_soon_threadsafe(self._drain, timeout)

    def _drain(self, timeout: float) -> None:
        self.accepting = False
        self._loop.call_later(timeout, self.abort_all)

    def abort_all(self) -> None:
        for stream in self._streams.values():
            stream._fail(RequestAborted())

    @property
    def healthy(self) -> bool:
        return self.error is None and self.core.alive

    def stats(self) -> tuple[int, int, float]:
        """Requests running and waiting, and the KV cache's used fraction, as of the core's last message."""
        return self._stats

    # -- one request (event loop) -----------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, final_only: bool,
               arrival: float) -> "RequestStream":
        """Queue a request, or refuse it at once (503 when full, shutting down, or after an engine failure),
        before any response has started."""
        if self.error is not None:
            raise EngineFailed(self.error)
        if not self.accepting:
            raise ServerBusy("the server is shutting down")
        if len(self._streams) >= self.max_requests:
            self.metrics.request_rejected()
            raise ServerBusy(f"the server holds {len(self._streams)} requests, its limit: retry later")
        request_id = str(next(self._ids))
        stream = self._streams[request_id] = RequestStream(self, request_id)
        self._requests[request_id] = RequestState(self.info.tokenizer, request_id, prompt_ids, params, final_only,
                                                  arrival)
        self.core.send(("add", request_id, prompt_ids, params))
        self.metrics.request_added(len(prompt_ids))
        return stream

    def _release(self, request_id: str, abort: bool) -> None:
        del self._streams[request_id]
        if abort and self._requests.pop(request_id, None) is not None:
            self.core.send(("abort", request_id))  # frees its KV blocks before the next step
            self.metrics.request_finished("abort", 0.0, None, None, 0, time.perf_counter())

    # -- the core's messages (event loop) -----------------------------------------------------------------

    def _on_message(self, message) -> None:
        kind = message[0]
        if kind == "step":
            self._on_step(message[1])
            self._stats = message[2]
        elif kind == "stats":
            self._stats = message[1]
        elif kind == "rejected":
            _, request_id, problem = message
            self._requests.pop(request_id, None)
            self._deliver_error(request_id, APIError(400, problem))
        elif kind == "failed":
            self._fail(message[1])

    def _on_step(self, rows) -> None:
        """A step's token rows: each request's text and stop strings, then its output to its handler."""
        requests, changed, now = self._requests, {}, time.perf_counter()
        self.metrics.tokens_generated(len(rows))
        for request_id, index, token, reason, extra in rows:
            state = requests.get(request_id)
            if state is None:
                continue  # aborted: its tokens computed meanwhile are nobody's
            if state.add(index, token, reason, extra, now):
                self.core.send(("stop", request_id, index, len(state.completions[index].token_ids)))
            changed[request_id] = state
        streams = self._streams
        for request_id, state in changed.items():
            if state.finished:
                del requests[request_id]
                self.metrics.request_finished(state.completions[0].finish_reason, state.arrival,
                                              state.first_token_time, state.last_token_time,
                                              state.num_output_tokens, now)
            elif state.final_only:
                continue  # the handler wants the last output only
            stream = streams.get(request_id)
            if stream is not None:  # else its handler is gone and its abort is on the way
                stream._put(state.output())

    def _deliver_error(self, request_id: str, error: Exception) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream._fail(error)

    def _fail(self, cause: str) -> None:
        if self.error is None:
            self.error = cause
        self._requests.clear()
        for stream in self._streams.values():
            stream._fail(EngineFailed(self.error))
