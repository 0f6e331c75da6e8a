"""Running the app with uvicorn until SIGTERM or Ctrl-C, then stopping gracefully and exiting 0.

On SIGTERM (or the first Ctrl-C) uvicorn stops accepting connections and the engine loop stops accepting
requests; requests in flight have `shutdown_timeout` seconds to finish, after which each is aborted with a last
event (finish_reason "abort"); then the engine thread stops. A second Ctrl-C quits at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

import uvicorn

from tinyvllm.engine import LLMEngine
from tinyvllm.server.app import build_app
from tinyvllm.server.engine_core import EngineProcess
from tinyvllm.server.engine_loop import EngineLoop


class GracefulServer(uvicorn.Server):
    """uvicorn's Server, but the first SIGTERM or SIGINT also drains the engine loop, and the process then
    exits 0: uvicorn itself re-raises the signal after its graceful stop, so the exit status would say
    "killed" although nothing was lost."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop, shutdown_timeout: float):
        super().__init__(config)
        self.engine_loop = engine_loop
        self.shutdown_timeout = shutdown_timeout

    @contextlib.contextmanager
    def capture_signals(self):
        handlers = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig, frame) -> None:
        if self.should_exit:
            self.force_exit = sig == signal.SIGINT  # a second Ctrl-C: now
            return
        self.should_exit = True
        self.engine_loop.drain(self.shutdown_timeout)


def serve(engine: LLMEngine | EngineProcess, args) -> int:
    """Serve `engine` with the options of `tinyvllm serve` (see options.py) until stopped; returns 0."""
    api_key = args.api_key or os.environ.get("TINYVLLM_API_KEY") or None
    name = args.served_model_name or engine.model_dir.name
    app = build_app(engine, name, api_key, args.max_waiting_requests, args.max_request_bytes)
    # uvicorn's own bound on the graceful stop: past ours, leaving time for the last events to be written
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            timeout_graceful_shutdown=args.shutdown_timeout + 5)
    # uvicorn says where it listens (the port it got, when --port is 0)
    backend = app.state.engine_loop.info.backend
    print(f"tinyvllm: serving {name!r} with the {backend} backend: the OpenAI API under /v1"
          + (", API key required" if api_key else ""), file=sys.stderr)
    GracefulServer(config, app.state.engine_loop, args.shutdown_timeout).run()
    return 0


@contextlib.contextmanager
def serving_in_thread(app, name: str = "uvicorn", start_timeout: float = 60.0, **config):
    """Serve `app` with uvicorn on a free port of 127.0.0.1 in a daemon thread (for tests and benchmarks, which
    drive the server from the same process); yields its base URL. On exit the server stops and its thread is
    joined. config: more uvicorn.Config options."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", **config))
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the server ({name}) did not start within {start_timeout:g} s")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
