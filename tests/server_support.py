"""Running the OpenAI-compatible server inside a test: uvicorn in a thread, on a free port of 127.0.0.1."""

from __future__ import annotations

import contextlib
import time

import httpx

from tinyvllm.server.app import build_app
from tinyvllm.server.launch import serving_in_thread

MODEL = "tiny"


@contextlib.contextmanager
def running_server(engine, **app_options):
    """Serve `engine` as model "tiny"; yields (base URL, the app). The engine loop stops on exit."""
    app = build_app(engine, MODEL, **app_options)
    with serving_in_thread(app, "test-uvicorn", start_timeout=30, timeout_graceful_shutdown=5) as url:
        yield url, app


def slow_down(engine, seconds: float) -> None:
    """Make every engine step the server takes (step_tokens) at least `seconds` longer (the tiny model's steps
    take well under a millisecond), so that a test can act while a request is still running."""
    step = engine.step_tokens

    def slowed():
        time.sleep(seconds)
        return step()

    engine.step_tokens = slowed


def slowed_engine(model_dir, step_delay: float = 0.0, **options):
    """An engine whose steps take `step_delay` seconds longer (slow_down): an EngineProcess factory."""
    from tinyvllm.engine import LLMEngine

    engine = LLMEngine.from_options(model_dir, **options)
    slow_down(engine, step_delay)
    return engine


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
