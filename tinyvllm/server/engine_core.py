"""The engine's side of the server: a loop that owns the LLMEngine and steps it, in a process of its own or in
a thread of the server's (vLLM V1's EngineCore and its in-process variant).

The server's host work at saturation is two things: the engine's (scheduling, packing, launching, reading back
a step's tokens), on the critical path of every step, and the front end's (turning tokens into text, looking for
stop strings, writing server-sent events), which can lag a step without cost because outputs coalesce. In one
process both share one interpreter lock, so every chunk written delays the next step. In a process of its own
(EngineProcess, what `tinyvllm serve` runs) the engine does only its part: per step it sends the front end the
token ids it read back (`LLMEngine.step_tokens`, a few bytes a token), and the front end (engine_loop.py) does
the rest. EngineThread runs the same loop in a thread of the server's process, over an engine built there (the
tests drive it so, and tools that want the engine at hand).

Messages, core to front end: ("ready", facts) once, from a process; ("step", rows, stats) per step, rows being
the step's TokenRows; ("stats", stats) after commands leave the engine idle; ("rejected", request id, message);
("failed", message), after which the core is gone. stats = (running, waiting, KV cache used fraction).
Commands, front end to core: ("add", request id, prompt ids, SamplingParams), ("abort", request id),
("stop", request id, completion index, tokens kept: the front end found a stop string there) and STOP.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing
import queue
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tinyvllm.config import ModelConfig
from tinyvllm.tokenizer import Tokenizer

log = logging.getLogger("tinyvllm.server")

STOP = ("stop-core",)

# The collector while serving: what a step allocates is acyclic and freed by reference counting, yet at hundreds
# of streams the collector ran hundreds of times a run, its full collections walking the whole startup heap
# (modules, Numba, the tokenizer), and reclaimed nothing (BENCHMARKS.md, "The server's own cost"). So while a
# server runs, the heap it started with is frozen out of collections (gc.freeze, as vLLM's and SGLang's servers
# do after startup) and the first generation is collected after this many net allocations instead of 700.
GC_GEN0_THRESHOLD = 10_000


def freeze_startup_heap() -> tuple[int, ...]:
    """Freeze the heap as it is now out of garbage collection and raise the first generation's threshold (see
    GC_GEN0_THRESHOLD); returns the thresholds to restore."""
    before = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(max(before[0], GC_GEN0_THRESHOLD), *before[1:])
    return before


# An EngineThread's event loop waits for the engine thread's host work (EngineIdle) at most this share of each
# window of this many seconds, so that it never starves, whatever the engine thread does (a host-bound engine,
# whose device is never waited for). A larger share buys a host-bound engine throughput at the cost of
# inter-token latency; the trade measured at 0.3, 0.5 and none: BENCHMARKS.md, "The server's own cost".
ENGINE_FIRST_SHARE = 0.3
ENGINE_FIRST_WINDOW_S = 0.010


@dataclass
class EngineInfo:
    """What the front end knows of the engine: enough to check and encode requests and to name the model."""

    model_dir: Path
    tokenizer: Tokenizer
    config: ModelConfig
    max_model_len: int
    max_num_seqs: int
    backend: str                 # the runner's name: cpu, cuda, sim

    @classmethod
    def of(cls, engine) -> "EngineInfo":
        return cls(engine.model_dir, engine.tokenizer, engine.config, engine.max_model_len,
                   engine.options.max_num_seqs, engine.runner.name)


class EngineCore:
    """Applies the front end's commands between steps, steps the engine while it has requests, and sends each
    step's token rows; `send` and `receive` are the transport's."""

    def __init__(self, engine, send):
        self.engine = engine
        self.send = send

    def run(self, receive) -> None:
        """Until STOP. receive(block) returns the commands that arrived (waiting for one if block)."""
        engine = self.engine
        try:
            while True:
                commands = receive(not engine.has_unfinished_requests())
                if not self._apply(commands):
                    return
                if engine.has_unfinished_requests():
                    rows = engine.step_tokens()
                    self.send(("step", rows, self.stats()))
                elif commands:
                    self.send(("stats", self.stats()))  # an abort freed blocks: /metrics shows it
        except Exception as exc:  # the engine is in an unknown state: stop, and tell the front end
            log.exception("the engine failed; the server stops serving requests")
            with contextlib.suppress(OSError, RuntimeError):  # unless the front end is gone too
                self.send(("failed", f"{type(exc).__name__}: {exc}"))

    def _apply(self, commands) -> bool:
        """Apply commands in order; False on STOP."""
        engine = self.engine
        for command in commands:
            kind = command[0]
            if kind == "add":
                _, request_id, prompt_ids, params = command
                try:
                    engine.add_request(prompt_ids, params, request_id, detokenize=False)
                except ValueError as exc:  # RequestError and the like: this request's fault, not the engine's
                    self.send(("rejected", request_id, str(exc)))
            elif kind == "abort":
                engine.abort(command[1])  # frees its KV blocks now
            elif kind == "stop":
                engine.stop_completion(*command[1:])
            elif command == STOP:
                return False
        return True

    def stats(self) -> tuple[int, int, float]:
        scheduler, blocks = self.engine.scheduler, self.engine.block_manager
        return len(scheduler.running), len(scheduler.waiting), 1.0 - blocks.num_free_blocks / blocks.num_blocks


class EngineIdle:
    """Set while the engine thread waits (for the device, or for commands), clear while it does host work; as a
    context manager, the engine's `device_wait`. Only an EngineThread over a runner that computes asynchronously
    (the GPU) enables it: the event loop then waits for it before each chunk (see engine_loop.py)."""

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
        """The event loop's: return when the engine thread waits, or when this window's budget is spent."""
        if self._event.is_set():
            return
        now = time.perf_counter()
        if now - self._window >= ENGINE_FIRST_WINDOW_S:
            self._window, self._waited = now, 0.0
        budget = ENGINE_FIRST_SHARE * ENGINE_FIRST_WINDOW_S - self._waited
        if budget > 0:
            self._event.wait(budget)
            self._waited += time.perf_counter() - now


def _drain(source: queue.SimpleQueue, into: list) -> list:
    """`into` with every item waiting in `source` appended, without waiting for more."""
    while True:
        try:
            into.append(source.get(block=False))
        except queue.Empty:
            return into


class EngineThread:
    """The core in a thread of this process, over an engine built here. Messages come to the event loop by
    call_soon_threadsafe."""

    def __init__(self, engine):
        self.engine = engine
        self.info = EngineInfo.of(engine)
        self.idle = EngineIdle(getattr(engine.runner, "launches_async", False))
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop, on_message) -> None:
        self.engine.device_wait = self.idle
        core = EngineCore(self.engine, lambda message: loop.call_soon_threadsafe(on_message, message))
        self._thread = threading.Thread(target=self._run, args=(core,), name="tinyvllm-engine", daemon=True)
        self._thread.start()

    def _run(self, core: EngineCore) -> None:
        self.idle.working()
        try:
            core.run(self._receive)
        finally:
            self.idle.waiting()  # gone: nothing to wait for

    def _receive(self, block: bool) -> list:
        commands = []
        if block:
            with self.idle:
                commands.append(self._commands.get())
        return _drain(self._commands, commands)

    def send(self, command) -> None:
        self._commands.put(command)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def stop(self) -> None:
        self.send(STOP)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self.engine.device_wait = contextlib.nullcontext()


class EngineProcessError(RuntimeError):
    """The engine process could not build its engine, or died before it was ready."""


# Bytes the pipe from the engine process holds before the engine waits for the front end to read (Linux; ~64 KiB
# elsewhere): a step's message is a few KiB at hundreds of streams, and the front end may lag some steps without
# cost (outputs coalesce), but not without bound.
PIPE_BYTES = 1 << 20


# The longest the event loop reads the engine's messages at once (EngineProcess._read).
READ_BUDGET_S = 0.020


def _widen_pipe(connection) -> None:
    """Let the pipe under `connection` hold PIPE_BYTES where the system allows (fcntl's F_SETPIPE_SZ)."""
    try:
        import fcntl

        fcntl.fcntl(connection.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (ImportError, AttributeError, OSError):  # not Linux, or above /proc/sys/fs/pipe-max-size: as it is
        pass


def _process_main(factory, model_dir: Path, options: dict, commands, outputs) -> None:
    """The engine process: build the engine (its CUDA context is this process's), say it is ready, run the core."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle: it stops this process
    try:
        engine = factory(model_dir, **options)
    except Exception as exc:
        outputs.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    outputs.send(("ready", {"max_model_len": engine.max_model_len, "max_num_seqs": engine.options.max_num_seqs,
                            "backend": engine.runner.name}))
    freeze_startup_heap()

    def receive(block: bool) -> list:
        commands_in = []
        try:
            while block or commands.poll():
                commands_in += commands.recv()
                block = False
        except EOFError:  # the server is gone
            commands_in.append(STOP)
        return commands_in

    EngineCore(engine, outputs.send).run(receive)


def build_engine(model_dir: Path, **options):
    """EngineProcess's default factory: the engine `tinyvllm serve` builds from its options."""
    from tinyvllm.engine import LLMEngine

    return LLMEngine.from_options(model_dir, **options)


class EngineProcess:
    """The core in a child process (started with 'spawn': a CUDA context cannot cross a fork), which builds its
    engine with `factory(model_dir, **options)` (a module-level function: it is pickled by name). The
    constructor returns once the engine is ready, raising EngineProcessError if it could not be built.

    Commands go out through a thread of their own (a pipe's buffer holds ~64 KiB, and the event loop must never
    wait for the engine to read); messages come in on the event loop, which reads the pipe when it is readable."""

    def __init__(self, model_dir: str | Path, options: dict | None = None, factory=build_engine):
        self.model_dir = model_dir = Path(model_dir)
        config = ModelConfig.from_dir(model_dir)
        tokenizer = Tokenizer.from_dir(model_dir)
        context = multiprocessing.get_context("spawn")
        self._commands_in, self._commands = context.Pipe(duplex=False)
        self._outputs, outputs_out = context.Pipe(duplex=False)
        _widen_pipe(self._outputs)
        self.process = context.Process(target=_process_main, name="tinyvllm-engine", daemon=True,
                                       args=(factory, model_dir, options or {}, self._commands_in, outputs_out))
        self.process.start()
        outputs_out.close()  # the child's end: EOF here once the child is gone
        self._commands_in.close()
        kind, facts = self._first_message()
        if kind != "ready":
            self.process.join(timeout=10)
            raise EngineProcessError(f"the engine process could not start: {facts}")
        self.info = EngineInfo(model_dir, tokenizer, config, facts["max_model_len"], facts["max_num_seqs"],
                               facts["backend"])
        self.idle = EngineIdle(False)  # another interpreter: nothing to yield to
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_commands, name="tinyvllm-engine-commands", daemon=True)
        self._sender.start()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_message = None

    def _first_message(self):
        while not self._outputs.poll(0.5):
            if not self.process.is_alive():
                return "failed", f"it exited with code {self.process.exitcode}"
        try:
            return self._outputs.recv()
        except EOFError:
            return "failed", f"it exited with code {self.process.join(5) or self.process.exitcode}"

    def start(self, loop: asyncio.AbstractEventLoop, on_message) -> None:
        self._loop, self._on_message = loop, on_message
        loop.add_reader(self._outputs.fileno(), self._read)

    def _read(self) -> None:
        """The event loop's, when the pipe is readable: the messages that have arrived, in order (the core writes
        each at once, so one that has begun to arrive is read whole without waiting). All of them: a stream's
        outputs of several steps then go out as one chunk; but for at most READ_BUDGET_S, so that an event loop
        that has fallen behind still writes chunks between steps."""
        deadline = time.perf_counter() + READ_BUDGET_S
        try:
            while True:
                self._on_message(self._outputs.recv())
                if not self._outputs.poll() or time.perf_counter() > deadline:
                    return
        except (EOFError, OSError):
            self._loop.remove_reader(self._outputs.fileno())
            self.process.join(timeout=1)  # it has closed its end: it is exiting
            self._on_message(("failed", f"the engine process exited (code {self.process.exitcode})"))

    def _send_commands(self) -> None:
        while True:
            batch = _drain(self._outbox, [self._outbox.get()])
            try:
                self._commands.send(batch)
            except OSError:  # the engine process is gone: its failure reaches the front end through _read
                return
            if STOP in batch:
                return

    def send(self, command) -> None:
        self._outbox.put(command)

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    async def stop(self, timeout: float = 30.0) -> None:
        """Stop the core after the step it is in, and the process with it."""
        self.send(STOP)
        await asyncio.to_thread(self.process.join, timeout)
        if self.process.is_alive():
            log.warning("the engine process did not stop within %g s: terminating it", timeout)
            self.process.terminate()
            await asyncio.to_thread(self.process.join, 5)
        if self._loop is not None:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(self._outputs.fileno())
        self._sender.join(timeout=5)
        self._outputs.close()
        self._commands.close()
