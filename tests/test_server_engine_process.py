"""The server with its engine in a process of its own, as `tinyvllm serve` runs it (EngineProcess): the engine
process sends token ids, this process turns them into text, looks for stop strings and streams. Greedy and seeded
answers, stop strings (found here, then sent back to stop the completion in the engine), n completions and
logprobs must equal the offline API's; a client that hangs up frees its blocks in the engine process (seen in
/metrics); an engine process that dies fails the requests in flight and /health, and the server stays up."""

from __future__ import annotations

import json
import os
import signal

import httpx
import openai
import pytest

from server_support import MODEL, metric, running_server, slowed_engine, wait_until
from tinyvllm import LLM, SamplingParams
from tinyvllm.server.engine_core import EngineProcess

# 2 ms more a step: the tiny model's steps take well under a millisecond, and a test must act mid-request
OPTIONS = {"backend": "cpu", "step_delay": 0.002}


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return LLM(tiny_model_dir, backend="cpu")


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    engine = EngineProcess(tiny_model_dir, OPTIONS, factory=slowed_engine)
    with running_server(engine) as (url, app):
        yield url, engine
    assert not engine.process.is_alive() and engine.process.exitcode == 0   # stopped with the app


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="none", max_retries=0)


def test_the_engine_runs_in_another_process(served, client):
    url, engine = served
    assert engine.process.pid != os.getpid() and engine.info.backend == "cpu"
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(f"{url}/health").status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_answers_equal_offline(client, offline, stream):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    want = offline.generate([chat, "Once upon a time"], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    reply = client.chat.completions.create(model=MODEL, messages=chat, temperature=0, max_tokens=20, stream=stream)
    text = "".join(c.choices[0].delta.content or "" for c in reply if c.choices) if stream else \
        reply.choices[0].message.content
    assert text == want[0].text and text
    reply = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=20)
    assert reply.choices[0].text == want[1].text
    assert reply.usage.completion_tokens == len(want[1].outputs[0].token_ids)


def test_stop_strings_found_in_the_server_end_where_the_engine_ends_them(client, offline, served):
    full = offline.generate(["Hello"], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].text
    stop = full[10:12]
    want = offline.generate(["Hello"], SamplingParams(temperature=0, max_tokens=40, stop=[stop]), use_tqdm=False)[0]
    for stream in (False, True):
        reply = client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=40, stop=[stop],
                                          stream=stream, stream_options={"include_usage": True} if stream else None)
        chunks = list(reply) if stream else [reply]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        usage = chunks[-1].usage
        assert text == want.text == full[:full.index(stop)]
        assert reasons == [want.outputs[0].finish_reason] == ["stop"]
        assert usage.completion_tokens == len(want.outputs[0].token_ids)   # tokens after the stop are dropped
    # the engine heard: nothing of the requests is left there
    wait_until(lambda: metric(served[0], "tinyvllm:kv_cache_usage_perc") == 0.0, what="the blocks to be freed")


def test_n_seeded_completions_with_a_stop_string_and_logprobs_equal_offline(client, offline):
    free = offline.generate(["Once"], SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=24),
                            use_tqdm=False)[0].outputs
    # a character of completion 1 that completion 0 lacks: one completion stops, another runs on
    stop = next(ch for ch in free[1].text[2:] if ch.isprintable() and ch not in free[0].text)
    params = dict(temperature=1.0, seed=0, max_tokens=24, stop=[stop], logprobs=1)
    want = offline.generate(["Once"], SamplingParams(n=3, **params), use_tqdm=False)[0].outputs
    assert want[0].finish_reason == "length" and want[1].finish_reason == "stop"
    reply = client.completions.create(model=MODEL, prompt="Once", n=3, **params)
    choices = sorted(reply.choices, key=lambda c: c.index)
    assert [c.text for c in choices] == [o.text for o in want]
    assert [c.finish_reason for c in choices] == [o.finish_reason for o in want]
    assert [c.logprobs.token_logprobs for c in choices] == [[next(iter(d.values())).logprob for d in o.logprobs]
                                                            for o in want]
    assert reply.usage.completion_tokens == sum(len(o.token_ids) for o in want)


def test_a_client_that_hangs_up_frees_its_blocks_in_the_engine_process(served):
    url, _ = served
    aborted = 'tinyvllm:request_success_total{finished_reason="abort"}'
    before = metric(url, aborted)
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        wait_until(lambda: metric(url, "tinyvllm:kv_cache_usage_perc") > 0, what="the request to hold blocks")
        assert metric(url, "tinyvllm:num_requests_running") == 1
    wait_until(lambda: metric(url, aborted) == before + 1, what="the abort to be counted")
    wait_until(lambda: metric(url, "tinyvllm:kv_cache_usage_perc") == 0.0, what="the blocks to be freed")
    assert metric(url, "tinyvllm:num_requests_running") == 0


def test_an_engine_process_that_dies_fails_requests_and_health(tiny_model_dir):
    engine = EngineProcess(tiny_model_dir, OPTIONS, factory=slowed_engine)
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with running_server(engine) as (url, _):
        with httpx.stream("POST", f"{url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(engine.process.pid, signal.SIGKILL)
            events = [line for line in lines if line]
        assert events[-1] == "data: [DONE]"
        assert "engine process exited" in json.loads(events[-2][6:])["error"]["message"]
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "engine process exited" in health.json()["error"]["message"]
        refused = httpx.post(f"{url}/v1/completions", json={**body, "stream": False})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_failed"


def test_an_engine_that_cannot_be_built_is_an_error_at_once(tmp_path, tiny_model_dir):
    from tinyvllm.server.engine_core import EngineProcessError

    with pytest.raises(EngineProcessError, match="could not start: .*block_size"):
        EngineProcess(tiny_model_dir, {"backend": "cpu", "block_size": 3})
