"""The engine loop: one thread owns the LLMEngine and steps it; HTTP handlers talk to it through queues.

A step runs the model (NumPy on the CPU; kernel launches and a device sync on the GPU). On the event loop it
would stall every connection for its duration, so it runs in a thread of its own, and nothing else touches the
engine. Handlers post commands (add, abort) to a thread-safe queue, which the thread applies between steps;
each request's outputs come back through its RequestStream, all of a step's in one call_soon_threadsafe.

The engine thread and the event loop share one interpreter lock, and only the engine thread's host work is on
the critical path: once the GPU runs out of launched steps it idles, while a chunk sent a few milliseconds late
only carries more text (outputs are cumulative and coalesce). So, with a runner that computes asynchronously
(the GPU), the event loop does not contend for the lock while the engine thread works: before each chunk it
waits, the lock released, until the engine thread waits for the device or for requests (EngineIdle).

A request whose handler goes away (the client hung up) is aborted before the next step, which frees its KV
blocks. If a step raises, the loop stops: every request in flight gets the error, /health reports it, and new
requests are refused, instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator

from tinyvllm.engine import LLMEngine, RequestOutput
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.server.metrics import Metrics
from tinyvllm.server.protocol import APIError

log = logging.getLogger("tinyvllm.server")


# Measured with tools/serve_benchmark.py --backend sim (256 requests at once): 0.5 ms instead of 5 ms served
# 1.7x the output tokens/s; each forced switch costs a few microseconds.
SWITCH_INTERVAL_S = 0.0005

# Python's cyclic garbage collector while serving: what a step allocates is acyclic and freed by reference
# counting, yet at hundreds of streams the collector ran hundreds of times a run, stopping both threads, its full
# collections walking the whole startup heap (modules, Numba, the tokenizer), and reclaimed nothing
# (BENCHMARKS.md, "The server's own cost"). So while the loop runs, the heap it started with is frozen out of
# collections (gc.freeze, as vLLM's and SGLang's servers do after startup) and the first generation is collected
# after this many net allocations instead of 700 (a step's outputs, alive until the event loop has sent them,
# crossed 700 several times a step).
GC_GEN0_THRESHOLD = 10_000

# The event loop waits for the engine thread's host work (EngineIdle) at most this share of each window of this
# many seconds, so that it never starves, whatever the engine thread does (a host-bound engine, whose device is
# never waited for). A larger share buys a host-bound engine throughput at the cost of inter-token latency; the
# trade measured at 0.3, 0.5 and none: BENCHMARKS.md, "The server's own cost".
ENGINE_FIRST_SHARE = 0.3
ENGINE_FIRST_WINDOW_S = 0.010

# A full queue drains at the engine's pace, a request every few steps: a second is a fair time to come back.
RETRY_AFTER_SECONDS = 1


class ServerBusy(APIError):
    """No room for the request now (the queue is full, or the server is stopping): 503 with Retry-After."""

    def __init__(self, message: str):
        super().__init__(503, message, type="server_error", code="server_busy",
                         headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


class EngineFailed(APIError):
    """A step raised: the engine's state is unknown, so the server serves nothing more (503)."""

    def __init__(self, cause: BaseException):
        super().__init__(503, f"the engine failed and stopped: {type(cause).__name__}: {cause}",
                         type="server_error", code="engine_failed")


class RequestAborted(APIError):
    """The server stopped the request (the shutdown deadline passed): a stream gets a last event with
    finish_reason "abort", a non-streaming request this 503."""

    def __init__(self):
        super().__init__(503, "the server shut down before this request finished", type="server_error",
                         code="aborted")


class EngineIdle:
    """Set while the engine thread waits (for the device, or for requests), clear while it does host work; as a
    context manager, the engine's `device_wait`. `wait()` is the event loop's: it returns at once when the engine
    thread waits, else when it next does (the interpreter lock released meanwhile), but the event loop waits at
    most ENGINE_FIRST_SHARE of each ENGINE_FIRST_WINDOW_S. A no-op unless `enabled` (a runner that computes in
    launch(), as the CPU backend's, never waits in collect())."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._event = threading.Event()
        self._event.set()
        self._window = 0.0        # when the event loop's current window of waiting began
        self._waited = 0.0        # seconds it waited in that window

    def waiting(self) -> None:
        if self.enabled:
            self._event.set()

    def working(self) -> None:
        if self.enabled:
            self._event.clear()

    def __enter__(self) -> None:
        self.waiting()

    def __exit__(self, *exc) -> None:
        self.working()

    def wait(self) -> None:
        if self._event.is_set():
            return
        now = time.perf_counter()
        if now - self._window >= ENGINE_FIRST_WINDOW_S:
            self._window, self._waited = now, 0.0
        budget = ENGINE_FIRST_SHARE * ENGINE_FIRST_WINDOW_S - self._waited
        if budget > 0:
            self._event.wait(budget)
            self._waited += time.perf_counter() - now


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


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    final_only: bool
    arrival: float


@dataclass
class _Abort:
    request_id: str


_STOP = object()


class EngineLoop:
    """Runs `engine` in a thread; `submit` hands it a request and returns the request's RequestStream.

    At most `max_num_seqs + max_waiting_requests` requests are held at once (running or waiting); beyond that
    `submit` raises ServerBusy (503 with Retry-After) instead of queueing without bound.
    """

    def __init__(self, engine: LLMEngine, metrics: Metrics, max_waiting_requests: int):
        self.engine = engine
        self.metrics = metrics
        self.max_requests = engine.options.max_num_seqs + max_waiting_requests
        self.error: BaseException | None = None
        self.accepting = True
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}   # event-loop side: requests whose handler listens
        self._live: dict[str, float] = {}              # engine-thread side: request id -> arrival time
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._switch_interval: float | None = None   # the interpreter's, restored on stop
        self._gc_threshold: tuple[int, ...] | None = None   # the collector's, restored on stop
        self.engine_idle = EngineIdle(getattr(engine.runner, "launches_async", False))

    # -- life cycle (event loop) ------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, SWITCH_INTERVAL_S))
        self._gc_threshold = gc.get_threshold()
        gc.collect()
        gc.freeze()
        gc.set_threshold(max(self._gc_threshold[0], GC_GEN0_THRESHOLD), *self._gc_threshold[1:])
        self.engine.device_wait = self.engine_idle
        self._thread = threading.Thread(target=self._run, name="tinyvllm-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the thread after the step it is in; requests still held get RequestAborted."""
        self.accepting = False
        self.abort_all()
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join)
        self.engine.device_wait = contextlib.nullcontext()
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
        return self.error is None and self._thread is not None and self._thread.is_alive()

    def stats(self) -> tuple[int, int, float]:
        """Requests running and waiting, and the KV cache's used fraction: a snapshot read across threads
        (lengths of the scheduler's lists), good for a gauge."""
        scheduler, blocks = self.engine.scheduler, self.engine.block_manager
        waiting = len(scheduler.waiting) + self._commands.qsize()
        return len(scheduler.running), waiting, 1.0 - blocks.num_free_blocks / blocks.num_blocks

    # -- one request (event loop) -----------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, final_only: bool,
               arrival: float) -> "RequestStream":
        """Queue a request, or refuse it at once (503 when full or shutting down, 500 after an engine failure),
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
        self._commands.put(_Add(request_id, prompt_ids, params, final_only, arrival))
        return stream

    def _release(self, request_id: str, abort: bool) -> None:
        del self._streams[request_id]
        if abort:
            self._commands.put(_Abort(request_id))

    # -- the engine thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        self.engine_idle.working()
        try:
            while self._apply_commands(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    before = self.engine.num_generated_tokens
                    outputs = self.engine.step()
                    self.metrics.tokens_generated(self.engine.num_generated_tokens - before)
                    self._account(outputs)
                    if outputs:
                        self._loop.call_soon_threadsafe(self._deliver, outputs)
        except Exception as exc:  # the engine is in an unknown state: stop, and tell everyone
            log.exception("the engine failed; the server stops serving requests")
            self._loop.call_soon_threadsafe(self._fail, exc)
        finally:
            self.engine_idle.waiting()  # gone: nothing to wait for

    def _apply_commands(self, block: bool) -> bool:
        """Apply the queued commands (waiting for one when idle); False on stop."""
        while True:
            try:
                if block:
                    with self.engine_idle:
                        command = self._commands.get()
                else:
                    command = self._commands.get(block=False)
            except queue.Empty:
                return True
            block = False
            if command is _STOP:
                return False
            if isinstance(command, _Add):
                self._add(command)
            elif command.request_id in self._live:
                self.engine.abort(command.request_id)  # frees its KV blocks now
                self._live.pop(command.request_id)
                self.metrics.request_finished("abort", 0.0, None, None, 0, time.perf_counter())

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(command.prompt_ids, command.params, command.request_id, command.final_only)
        except ValueError as exc:  # RequestError and the like: this request's fault, not the engine's
            self._loop.call_soon_threadsafe(self._deliver_error, command.request_id, APIError(400, str(exc)))
            return
        self._live[command.request_id] = command.arrival
        self.metrics.request_added(len(command.prompt_ids))

    def _account(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for out in outputs:
            if out.finished and out.request_id in self._live:
                arrival = self._live.pop(out.request_id)
                m = out.metrics
                num_tokens = max(len(c.token_ids) for c in out.outputs)
                self.metrics.request_finished(out.outputs[0].finish_reason, arrival, m.get("first_token_time"),
                                              m.get("last_token_time"), num_tokens, now)

    # -- back on the event loop -----------------------------------------------------------------------------

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        streams = self._streams
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is not None:  # else its handler is gone and its abort is on the way
                stream._put(out)

    def _deliver_error(self, request_id: str, error: Exception) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream._fail(error)

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        for stream in self._streams.values():
            stream._fail(EngineFailed(exc))
