"""`tinyvllm serve` as a process: it starts from the command line, and SIGTERM lets the streams in flight end
with their last events, then exits 0."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading

import httpx

from tests_support import TESTS


def test_sigterm_ends_streams_cleanly_and_exits_0(tiny_model_dir):
    proc = subprocess.Popen([sys.executable, "-m", "tinyvllm", "serve", "--model", str(tiny_model_dir),
                             "--backend", "cpu", "--port", "0", "--served-model-name", "tiny"],
                            cwd=TESTS.parent, stderr=subprocess.PIPE, text=True)
    try:
        log = []
        for line in proc.stderr:
            log.append(line)
            found = re.search(r"running on (http://127\.0\.0\.1:\d+)", line)
            if found:
                url = found.group(1)
                break
        else:
            raise AssertionError("the server did not start:\n" + "".join(log))
        threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()  # keep the pipe drained

        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
        streams = [httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) for _ in range(4)]
        responses = [s.__enter__() for s in streams]
        lines = [r.iter_lines() for r in responses]
        for it in lines:
            assert next(it).startswith("data: ")   # every request is in flight
        proc.send_signal(signal.SIGTERM)
        for it, stream in zip(lines, streams):
            events = [line for line in it if line]
            stream.__exit__(None, None, None)
            assert events[-1] == "data: [DONE]"
            assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("length", "abort")
        assert proc.wait(timeout=30) == 0, "".join(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_server_options_are_refused_by_flag_before_loading_a_model(capsys):
    from tinyvllm.cli import main

    for argv, flag in ((["--port", "70000"], "--port"), (["--max-waiting-requests", "-1"], "--max-waiting-requests"),
                       (["--max-request-bytes", "0"], "--max-request-bytes"),
                       (["--shutdown-timeout", "-1"], "--shutdown-timeout")):
        assert main(["serve", "--model", "/nonexistent", *argv]) == 1
        assert capsys.readouterr().err.startswith(f"tinyvllm: error: {flag} ")
