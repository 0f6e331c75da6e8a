"""Running the OpenAI-compatible server inside a test: uvicorn in a thread, on a free port of 127.0.0.1."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import uvicorn

from tinyvllm.server.app import build_app

MODEL = "tiny"


@contextlib.contextmanager
def running_server(engine, **app_options):
    """Serve `engine` as model "tiny"; yields (base URL, the app). The engine loop stops on exit."""
    app = build_app(engine, MODEL, **app_options)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def slow_down(engine, seconds: float) -> None:
    """Make every engine step take at least `seconds` longer (the tiny model's steps take well under a
    millisecond), so that a test can act while a request is still running."""
    step = engine.step

    def slowed():
        time.sleep(seconds)
        return step()

    engine.step = slowed


def metric(url: str, name: str) -> float:
    """One sample of /metrics, by its full name with labels, e.g. 'tinyvllm:request_success_total{...}'."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_until(condition, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)
