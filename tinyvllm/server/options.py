"""`tinyvllm serve`'s own command-line options (the engine's are the CLI's), and their checks.

Kept apart from launch.py so that building the CLI's parser imports neither FastAPI nor uvicorn.
"""

from __future__ import annotations

import argparse

DEFAULT_MAX_WAITING_REQUESTS = 1024
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
DEFAULT_SHUTDOWN_TIMEOUT = 30.0

SERVE_EPILOG = """\
examples:
  tinyvllm serve                                   # the embedded default model on http://127.0.0.1:8000
  tinyvllm serve --model ~/models/Llama-3.2-1B-Instruct --api-key secret
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"model": "MODEL", "messages": [{"role": "user", "content": "Hi!"}]}'

The API key can also come from TINYVLLM_API_KEY. GET /v1/models names the served model. On SIGTERM or
Ctrl-C the server stops accepting requests, lets those in flight run for --shutdown-timeout seconds, aborts
what is left (each stream gets a last event, finish_reason "abort") and exits 0."""


def add_server_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", metavar="KEY", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $TINYVLLM_API_KEY, or none)")
    p.add_argument("--served-model-name", metavar="NAME", default=None,
                   help="the model name clients send (default: the model directory's name)")
    p.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS, metavar="N",
                   help="requests that may wait beyond --max-num-seqs running ones; more get 503 with "
                        f"Retry-After (default {DEFAULT_MAX_WAITING_REQUESTS})")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="N",
                   help=f"largest request body; larger ones get 413 (default {DEFAULT_MAX_REQUEST_BYTES})")
    p.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT, metavar="SECONDS",
                   help="on SIGTERM, how long requests in flight may still run before they are aborted "
                        f"(default {DEFAULT_SHUTDOWN_TIMEOUT:g})")


def server_option_error(args) -> str | None:
    """The first problem with the server's options, as a message naming the flag, or None."""
    if not 0 <= args.port <= 65535:
        return f"--port must be in [0, 65535], got {args.port}"
    if args.max_waiting_requests < 0:
        return f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}"
    if args.max_request_bytes < 1:
        return f"--max-request-bytes must be >= 1, got {args.max_request_bytes}"
    if not 0 <= args.shutdown_timeout < float("inf"):
        return f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}"
    return None
