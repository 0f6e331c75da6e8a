"""The streaming path's parts, without HTTP: how an SSE chunk is rendered, and how a request's outputs reach
its handler (RequestStream: the newest output, errors first, an abort only for an unfinished request)."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyvllm.sampling_params import SamplingParams
from tinyvllm.server.engine_loop import EngineLoop, RequestAborted
from tinyvllm.server.metrics import Metrics
from tinyvllm.server.protocol import APIError
from tinyvllm.server.serving import ChatFormat, ChunkEvent, CompletionFormat

HEAD = {"id": "cmpl-1", "created": 1700000000, "model": "tiny"}


def dumped(fmt, include_usage: bool, choices: list[dict]) -> str:
    """The event as plain json.dumps writes it (what ChunkEvent must reproduce byte for byte)."""
    chunk = {**HEAD, "object": fmt.chunk_object, "choices": choices, **({"usage": None} if include_usage else {})}
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


@settings(max_examples=200, deadline=None)
@given(text=st.text(min_size=1), index=st.integers(0, 300), fmt=st.sampled_from([ChatFormat, CompletionFormat]),
       include_usage=st.booleans())
def test_a_text_chunk_is_rendered_as_json_dumps_renders_it(text, index, fmt, include_usage):
    # text: any code points, quotes, backslashes, control characters, lone surrogates
    event = ChunkEvent({**HEAD, "object": fmt.chunk_object}, include_usage, fmt)
    assert event([event.choice(index, text, None, None)]) == \
        dumped(fmt, include_usage, [fmt.delta(index, text, None, None)])


@pytest.mark.parametrize("fmt", [ChatFormat, CompletionFormat])
def test_chunks_with_finish_reasons_logprobs_or_several_choices(fmt):
    event = ChunkEvent({**HEAD, "object": fmt.chunk_object}, True, fmt)
    logprobs = {"content": [{"token": "a", "logprob": -0.5}]}
    cases = [[(0, "end", "stop", None)], [(0, "", "length", None)], [(1, "x", None, logprobs)],
             [(0, "a\"b", None, None), (2, "c", "stop", None)]]
    for case in cases:
        got = event([event.choice(*args) for args in case])
        assert got == dumped(fmt, True, [fmt.delta(*args) for args in case])
        assert json.loads(got[len("data: "):])["choices"][-1]["index"] == case[-1][0]


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir):
    from tinyvllm import LLM

    return LLM(tiny_model_dir, backend="cpu").engine


def unstarted_engine_loop(engine) -> tuple[EngineLoop, list]:
    """An EngineLoop whose core never starts: the test plays the core's messages; the commands it would have
    been sent are collected in the list."""
    loop = EngineLoop(engine, Metrics(), max_waiting_requests=4)
    loop._loop = asyncio.get_running_loop()
    sent = []
    loop.core.send = sent.append
    return loop, sent


def letters(engine, text: str) -> list[int]:
    """A token id per character (the tiny model's tokenizer has one per byte)."""
    ids = [engine.tokenizer.encode(ch, add_special_tokens=False) for ch in text]
    assert all(len(i) == 1 for i in ids)
    return [i[0] for i in ids]


def test_a_stream_gets_each_output_or_only_the_newest_when_behind(tiny_engine):
    async def main():
        loop, sent = unstarted_engine_loop(tiny_engine)
        stream = loop.submit([1, 2], SamplingParams(max_tokens=5), final_only=False, arrival=0.0)
        rid = stream.request_id
        assert sent == [("add", rid, [1, 2], SamplingParams(max_tokens=5))]
        a, b, c, d, e = letters(tiny_engine, "abcde")
        outputs = stream.outputs()
        got = asyncio.ensure_future(outputs.__anext__())
        await asyncio.sleep(0)               # the handler waits for its first output
        loop._on_message(("step", [(rid, 0, a, None, None), ("other", 0, b, None, None)], (1, 0, 0.5)))
        assert (await got).text == "a"
        assert loop.stats() == (1, 0, 0.5)
        # three steps before the handler looks again: it is handed the newest only
        for token in (b, c, d):
            loop._on_message(("step", [(rid, 0, token, None, None)], (1, 0, 0.5)))
        newest = await outputs.__anext__()
        assert newest.text == "abcd" and list(newest.outputs[0].token_ids) == [a, b, c, d]
        loop._on_message(("step", [(rid, 0, e, "length", None)], (0, 0, 0.0)))
        last = await outputs.__anext__()
        assert last.text == "abcde" and last.finished and last.outputs[0].finish_reason == "length"
        with pytest.raises(StopAsyncIteration):
            await outputs.__anext__()
        assert stream.finished
        stream.close()
        assert rid not in loop._streams
        assert [command[0] for command in sent] == ["add"]   # finished: nothing to abort

    asyncio.run(main())


def test_a_stop_string_found_here_ends_the_completion_and_tells_the_core(tiny_engine):
    """The core does not look for stop strings: the front end finds one, cuts the text there, tells the core how
    many tokens the completion keeps, and drops the tokens the core computed before it heard."""
    async def main():
        loop, sent = unstarted_engine_loop(tiny_engine)
        stream = loop.submit([1, 2], SamplingParams(max_tokens=9, stop=["cd"]), final_only=True, arrival=0.0)
        rid = stream.request_id
        outputs = stream.outputs()
        for token in letters(tiny_engine, "abcdef"):
            loop._on_message(("step", [(rid, 0, token, None, None)], (1, 0, 0.5)))
        last = await outputs.__anext__()
        assert last.finished and last.text == "ab" and last.outputs[0].finish_reason == "stop"
        assert list(last.outputs[0].token_ids) == letters(tiny_engine, "abcd")
        assert sent[1:] == [("stop", rid, 0, 4)]
        stream.close()
        assert len(sent) == 2   # finished: nothing to abort

    asyncio.run(main())


def test_an_error_is_raised_before_a_pending_output_and_close_aborts_an_unfinished_request(tiny_engine):
    async def main():
        loop, sent = unstarted_engine_loop(tiny_engine)
        stream = loop.submit([1, 2], SamplingParams(max_tokens=5), final_only=False, arrival=0.0)
        rid = stream.request_id
        loop._on_message(("step", [(rid, 0, letters(tiny_engine, "a")[0], None, None)], (1, 0, 0.5)))
        loop._on_message(("rejected", rid, "bad"))
        loop.abort_all()                     # a second error: the first one wins
        outputs = stream.outputs()
        with pytest.raises(APIError) as caught:
            await outputs.__anext__()
        assert caught.value.status == 400 and "bad" in caught.value.body()["error"]["message"]
        # the error was handed over once; the output that waited behind it is still there
        assert (await stream.outputs().__anext__()).text == "a"
        # a server abort wakes a handler that waits
        waiting = asyncio.ensure_future(stream.outputs().__anext__())
        await asyncio.sleep(0)
        loop.abort_all()
        with pytest.raises(RequestAborted):
            await waiting
        stream.close()
        stream.close()                       # once only
        other = loop.submit([3], SamplingParams(max_tokens=5), final_only=False, arrival=0.0)
        other.close()
        assert [c for c in sent if c[0] == "abort"] == [("abort", other.request_id)]  # rejected: not in the engine

    asyncio.run(main())


def test_while_serving_the_startup_heap_is_frozen_out_of_garbage_collection(tiny_model_dir):
    import gc

    from server_support import running_server
    from tinyvllm import LLM
    from tinyvllm.server.engine_core import GC_GEN0_THRESHOLD

    before = gc.get_threshold()
    engine = LLM(tiny_model_dir, backend="cpu").engine
    with running_server(engine) as (url, app):
        assert gc.get_freeze_count() > 1000                 # the engine, the app, the modules...
        assert gc.get_threshold() == (max(before[0], GC_GEN0_THRESHOLD), *before[1:])
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_engine_idle_holds_a_chunk_back_only_while_the_engine_thread_works_and_within_a_budget(monkeypatch):
    import threading
    import time

    from tinyvllm.server import engine_core

    def waited(idle) -> float:
        start = time.perf_counter()
        idle.wait()
        return time.perf_counter() - start

    off = engine_core.EngineIdle(enabled=False)   # a runner that computes in launch(): never held back
    off.working()
    assert off._event.is_set() and waited(off) < 0.01
    idle = engine_core.EngineIdle(enabled=True)
    assert waited(idle) < 0.01                    # the engine thread waits (for requests): at once
    monkeypatch.setattr(engine_core, "ENGINE_FIRST_WINDOW_S", 1.0)
    monkeypatch.setattr(engine_core, "ENGINE_FIRST_SHARE", 0.3)
    idle.working()                                # it works, and goes on working
    assert 0.25 < waited(idle) < 0.9              # the budget: 0.3 s of each second
    assert waited(idle) < 0.05                    # spent: not again in this window
    time.sleep(1.0)
    threading.Timer(0.05, idle.waiting).start()   # a new window; the engine thread waits 50 ms later
    assert 0.03 < waited(idle) < 0.25
    assert waited(idle) < 0.01


def test_the_event_loop_waits_for_the_engine_thread_only_while_it_works(tiny_model_dir):
    """Over a runner that waits for its device in collect() (tools/sim_runner.py, as the GPU's), EngineIdle is
    clear while the engine thread packs and launches a step and set while it waits; the CPU runner never
    clears it. The engine's device_wait is the engine loop's only while it runs."""
    import contextlib

    import httpx

    from server_support import MODEL, running_server, wait_until
    from tinyvllm import LLM
    from tools.sim_runner import sim_llm

    engine = sim_llm(tiny_model_dir, base_ms=1.0).engine
    runner, seen = engine.runner, {"launch": set(), "collect": set()}
    launch, collect = runner.launch, runner.collect

    def spying(name, call):
        def spied(*args):
            seen[name].add(app.state.engine_loop.engine_idle._event.is_set())
            return call(*args)
        return spied

    runner.launch, runner.collect = spying("launch", launch), spying("collect", collect)
    with running_server(engine) as (url, app):
        assert engine.device_wait is app.state.engine_loop.engine_idle
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 8, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body) as response:
            assert response.status_code == 200 and response.read().endswith(b"data: [DONE]\n\n")
        wait_until(app.state.engine_loop.engine_idle._event.is_set, what="the engine thread to wait for requests")
    assert seen == {"launch": {False}, "collect": {True}}
    assert isinstance(engine.device_wait, contextlib.nullcontext)
    cpu = LLM(tiny_model_dir, backend="cpu").engine
    with running_server(cpu) as (url, app):
        assert not app.state.engine_loop.engine_idle.enabled
