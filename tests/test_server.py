"""The OpenAI-compatible server, driven over HTTP by the official `openai` client and by raw httpx.

The server runs in this process (uvicorn in a thread) over the tiny random model on the CPU backend; its
greedy answers must be the offline API's (`LLM.generate`) for the same prompts, token for token.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from server_support import MODEL, metric, running_server, slow_down, wait_until
from tinyvllm import LLM, SamplingParams

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return LLM(tiny_model_dir, backend="cpu")


def offline_text(offline, prompt, **params) -> tuple[str, str, int, int]:
    """Text, finish reason, prompt and completion token counts of a greedy request through LLM.generate."""
    out = offline.generate([prompt], SamplingParams(temperature=0, **params), use_tqdm=False)[0]
    return out.text, out.outputs[0].finish_reason, len(out.prompt_token_ids), len(out.outputs[0].token_ids)


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    engine = LLM(tiny_model_dir, backend="cpu").engine
    with running_server(engine, api_key=KEY, max_request_bytes=64 * 1024) as (url, app):
        yield url, engine


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key=KEY, max_retries=0)


# -- answers through the official client -------------------------------------------------------------------


def test_chat_greedy_equals_offline(client, offline):
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=24)
    text, reason, n_prompt, n_out = offline_text(offline, CHAT, max_tokens=24)
    assert reply.choices[0].message.content == text and text
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == reason
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (n_prompt, n_out)
    assert reply.usage.total_tokens == n_prompt + n_out
    assert reply.model == MODEL and reply.object == "chat.completion"


@pytest.mark.parametrize("prompt", ["The capital of France is", [256, 72, 105, 33, 10, 84]])
def test_completion_greedy_equals_offline(client, offline, prompt):
    reply = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=20)
    text, reason, n_prompt, n_out = offline_text(offline, prompt, max_tokens=20)
    assert reply.choices[0].text == text and text
    assert reply.choices[0].finish_reason == reason
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (n_prompt, n_out)


def test_sampling_with_a_seed_is_reproducible_and_matches_offline(client, offline):
    params = dict(temperature=0.9, top_p=0.9, seed=7, max_tokens=16)
    first = client.completions.create(model=MODEL, prompt="Once upon a time", **params).choices[0].text
    again = client.completions.create(model=MODEL, prompt="Once upon a time", **params).choices[0].text
    out = offline.generate(["Once upon a time"], SamplingParams(**params), use_tqdm=False)[0]
    assert first == again == out.text


def test_vllm_extras_are_applied(client, offline):
    reply = client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=12,
                                      extra_body={"min_tokens": 12, "ignore_eos": True, "top_k": 5})
    out = offline.generate(["Hello"], SamplingParams(temperature=0, max_tokens=12, min_tokens=12, ignore_eos=True,
                                                     top_k=5), use_tqdm=False)[0]
    assert reply.choices[0].text == out.text
    assert reply.usage.completion_tokens == 12 and reply.choices[0].finish_reason == "length"


def test_stop_strings_end_the_answer(client, offline):
    text, *_ = offline_text(offline, "Hello", max_tokens=40)
    stop = text[10:12]   # the greedy answer is known to contain it
    reply = client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=40, stop=[stop])
    expected, reason, *_ = offline_text(offline, "Hello", max_tokens=40, stop=[stop])
    assert reply.choices[0].text == expected == text[:text.index(stop)]
    assert reply.choices[0].finish_reason == reason == "stop"


def test_streaming_chat_and_completion_with_usage(client, offline):
    text, reason, n_prompt, n_out = offline_text(offline, CHAT, max_tokens=30)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=30,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reason
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == n_out
    assert chunks[-1].usage.prompt_tokens == n_prompt
    assert all(c.usage is None for c in chunks[:-1])

    text, reason, _, n_out = offline_text(offline, "Hello", max_tokens=30)
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=30, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == reason


def test_stream_ends_with_done(served):
    url, _ = served
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


# Greedy on the tiny tokenizer's <|im_start|> (258): a special token, not EOS, that decoding skips, so every token
# of the answer decodes to no text (as a random model's tokens may, on a real tokenizer). slow_served's 5 ms steps
# keep the stream from being coalesced into its last chunk while the handler lags.
NO_TEXT = {"model": MODEL, "max_tokens": 10, "temperature": 0, "logit_bias": {"258": 100}}


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_tokens_that_decode_to_no_text_are_streamed_as_they_come(slow_served, endpoint):
    """As vLLM's server: a chunk with text "" whenever tokens were generated, not silence until the last chunk,
    so that a client sees the answer start (a benchmark's TTFT is its first chunk with choices)."""
    url, engine, _ = slow_served
    assert engine.tokenizer.decode([258]) == "" and engine.tokenizer.eos_token_id != 258
    prompt = {"prompt": "Hi"} if endpoint == "completions" else {"messages": CHAT}
    body = {**NO_TEXT, **prompt, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/{endpoint}", json=body) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line and line != "data: [DONE]"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 10
    choices = [e["choices"][0] for e in events if e["choices"]]
    if endpoint == "chat/completions":
        assert choices.pop(0)["delta"] == {"role": "assistant", "content": ""}   # the opening, before any token
        assert all(c["delta"] == {"content": ""} for c in choices)
    else:
        assert all(c["text"] == "" for c in choices)
    # chunks before the last one (not one per token: outputs coalesce when the handler falls behind)
    assert len(choices) > 1
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]


def test_the_serving_benchmark_times_the_first_token_of_an_answer_with_no_text(slow_served):
    """tools/bench_serve.py counts TTFT at the first chunk with choices, as vLLM's benchmark, text or not: here
    before the last chunk, so that there are inter-token gaps."""
    from tools import bench_serve

    url, *_ = slow_served
    body = {**bench_serve.request_body(MODEL, "Hi", 10, "tinyvllm"), "logit_bias": NO_TEXT["logit_bias"]}
    result = asyncio.run(bench_serve.one_request(f"{url}/v1/completions", body, {}))
    assert result.ok and result.output_tokens == 10
    assert len(result.itl) >= 1   # TTFT was not the last chunk's time


def test_concurrent_streaming_clients_get_their_answers_alone(served, offline):
    url, engine = served
    prompts = [f"Request number {i}: " + "tell me a story " * (i % 4) for i in range(32)]
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)

    async def ask(prompt):
        stream = await client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=16,
                                                 stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def ask_all():
        try:
            return await asyncio.gather(*(ask(p) for p in prompts))
        finally:
            await client.close()

    answers = asyncio.run(ask_all())
    assert answers == [offline_text(offline, p, max_tokens=16)[0] for p in prompts]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_models_health_and_metrics_names(served, client):
    url, _ = served
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(f"{url}/health").status_code == 200
    text = httpx.get(f"{url}/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "request_success_total", "time_to_first_token_seconds",
                 "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert f"# TYPE tinyvllm:{name} " in text, name


def test_metrics_counters_move(served, client):
    url, _ = served
    names = ["tinyvllm:generation_tokens_total", "tinyvllm:prompt_tokens_total",
             'tinyvllm:request_success_total{finished_reason="length"}',
             "tinyvllm:time_to_first_token_seconds_count", "tinyvllm:time_per_output_token_seconds_count",
             "tinyvllm:e2e_request_latency_seconds_count"]
    before = [metric(url, n) for n in names]
    reply = client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=9,
                                      extra_body={"ignore_eos": True})
    after = [metric(url, n) for n in names]
    assert [a - b for a, b in zip(after, before)] == [9, reply.usage.prompt_tokens, 1, 1, 1, 1]
    assert metric(url, "tinyvllm:num_requests_running") == 0
    assert metric(url, "tinyvllm:kv_cache_usage_perc") == 0.0


# -- what a client gets wrong: a 4xx naming the field ---------------------------------------------------------

MESSAGES = [{"role": "user", "content": "Hi"}]

BAD_REQUESTS = [
    # (endpoint, body, status, param)
    ("chat/completions", b"{not json", 400, None),
    ("chat/completions", b"[1, 2]", 400, None),
    ("chat/completions", {"model": MODEL}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": "Hi"}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, 400, "messages.0.content"),
    ("chat/completions", {"model": "gpt-4", "messages": MESSAGES}, 404, "model"),
    ("chat/completions", {"model": MODEL, "messages": MESSAGES, "temperature": -1}, 400, "temperature"),
    ("chat/completions", {"model": MODEL, "messages": MESSAGES, "temperature": "hot"}, 400, "temperature"),
    ("chat/completions", {"model": MODEL, "messages": MESSAGES, "top_p": 1.5}, 400, "top_p"),
    ("chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": "5"}, 400, "max_tokens"),
    ("chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": True}, 400, "max_tokens"),
    ("chat/completions", {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 100000}, 400, "max_tokens"),
    ("chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "min_tokens": 5}, 400,
     "min_tokens"),
    ("chat/completions", {"model": MODEL, "messages": MESSAGES, "seed": -1}, 400, "seed"),
    ("chat/completions", {"model": MODEL, "messages": MESSAGES, "seed": 2**64}, 400, "seed"),
    ("chat/completions", {"model": MODEL, "messages": MESSAGES, "stop": 5}, 400, "stop"),
    ("chat/completions", {"model": MODEL, "messages": MESSAGES, "stop": [""]}, 400, "stop"),
    ("chat/completions", {"model": MODEL, "messages": MESSAGES, "logit_bias": {"a": 1}}, 400, "logit_bias"),
    ("chat/completions", {"model": MODEL, "messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat/completions", {"model": MODEL, "messages": MESSAGES, "stream_options": {"include_usage": True}},
     400, "stream_options"),
    ("chat/completions", {"model": MODEL, "messages": MESSAGES, "max_token": 5}, 400, "max_token"),
    ("completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": [1, 100000]}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": [7] * 600}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": "ab" * 600}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": ["one", "two"]}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": "Hi", "echo": True}, 400, "echo"),
    ("completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 511}, 400, "max_tokens"),
]


@pytest.mark.parametrize("endpoint, body, status, param", BAD_REQUESTS,
                         ids=[f"{e}-{p}-{i}" for i, (e, _, _, p) in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_an_error_naming_the_field(served, endpoint, body, status, param):
    url, engine = served
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{url}/v1/{endpoint}", content=content, headers=AUTH)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_long_prompt_is_refused_before_it_is_tokenized(served, monkeypatch):
    url, engine = served
    text = "x" * (engine.max_model_len * 40)   # the tiny vocabulary's longest token is far shorter

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("the prompt was tokenized")

    monkeypatch.setattr(engine.tokenizer, "encode", no_tokenizing)
    response = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": text}, headers=AUTH)
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"


def test_api_key(served):
    url, _ = served
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Bearer {KEY[:-1]}"}):
        response = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.post(f"{url}/v1/completions", json=body, headers=AUTH).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200   # open, for load balancers
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()


def test_an_oversized_body_gets_413(served):
    url, _ = served
    big = json.dumps({"model": MODEL, "prompt": "x" * 70_000}).encode()
    assert httpx.post(f"{url}/v1/completions", content=big, headers=AUTH).status_code == 413

    def chunks():  # no Content-Length: the limit is found while reading
        for _ in range(70):
            yield b" " * 1024

    response = httpx.post(f"{url}/v1/completions", content=chunks(), headers=AUTH)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert httpx.get(f"{url}/health").status_code == 200


def test_a_field_the_engine_lacks_is_refused_by_name(served, monkeypatch):
    from tinyvllm.server import sampling

    url, _ = served
    supported = sampling.supported_fields() - {"presence_penalty", "n"}
    monkeypatch.setattr(sampling, "supported_fields", lambda: supported)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    for field, value in (("presence_penalty", 0.5), ("n", 2)):
        response = httpx.post(f"{url}/v1/completions", json={**body, field: value}, headers=AUTH)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == field and "not supported by this server yet" in error["message"]
    # the neutral value asks nothing of the engine
    assert httpx.post(f"{url}/v1/completions", json={**body, "presence_penalty": 0, "n": 1},
                      headers=AUTH).status_code == 200


# -- faults: disconnects, a full queue, a failing engine, shutdown --------------------------------------------


@pytest.fixture
def slow_served(tiny_model_dir):
    """A server whose engine steps take 5 ms more, with room for one running and one waiting request."""
    engine = LLM(tiny_model_dir, backend="cpu", max_num_seqs=1).engine
    slow_down(engine, 0.005)
    with running_server(engine, max_waiting_requests=1) as (url, app):
        yield url, engine, app


LONG = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 400, "ignore_eos": True}


def test_a_client_that_hangs_up_frees_its_request_and_blocks(slow_served):
    url, engine, _ = slow_served
    blocks = engine.block_manager
    aborted = 'tinyvllm:request_success_total{finished_reason="abort"}'
    with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert blocks.num_free_blocks < blocks.num_blocks
        assert metric(url, "tinyvllm:num_requests_running") == 1
    wait_until(lambda: blocks.num_free_blocks == blocks.num_blocks, what="the stream's blocks to be freed")
    wait_until(lambda: metric(url, aborted) == 1, what="the abort to be counted")
    assert metric(url, "tinyvllm:num_requests_running") == 0

    # the same without streaming: the client gives up waiting for the whole answer
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=LONG, timeout=httpx.Timeout(5.0, read=0.3))
    wait_until(lambda: metric(url, aborted) == 2, what="the second abort to be counted")
    wait_until(lambda: blocks.num_free_blocks == blocks.num_blocks, what="the request's blocks to be freed")


def test_beyond_the_waiting_limit_requests_get_503(slow_served):
    url, engine, _ = slow_served
    with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}) as running, \
            httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}) as waiting:
        assert running.status_code == waiting.status_code == 200
        refused = httpx.post(f"{url}/v1/completions", json={**LONG, "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        assert refused.json()["error"]["code"] == "server_busy"
        assert metric(url, "tinyvllm:num_requests_waiting") == 1
    wait_until(lambda: metric(url, "tinyvllm:num_requests_running") == 0, what="both streams to be aborted")
    assert metric(url, "tinyvllm:request_rejected_total") == 1
    ok = httpx.post(f"{url}/v1/completions", json={**LONG, "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_more_requests_than_max_num_seqs_queue_and_complete(slow_served):
    url, *_ = slow_served
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    async def both():
        try:
            return await asyncio.gather(*(client.completions.create(model=MODEL, prompt=p, max_tokens=5)
                                          for p in ("one", "two")))
        finally:
            await client.close()

    assert [r.usage.completion_tokens for r in asyncio.run(both())] == [5, 5]


def test_an_engine_failure_fails_requests_and_health(tiny_model_dir):
    engine = LLM(tiny_model_dir, backend="cpu").engine
    step, calls = engine.step_tokens, []

    def failing_step():
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("device lost")
        return step()

    engine.step_tokens = failing_step
    with running_server(engine) as (url, _):
        with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}) as response:
            events = [line for line in response.iter_lines() if line]
        assert events[-1] == "data: [DONE]"
        assert "device lost" in json.loads(events[-2][6:])["error"]["message"]
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "device lost" in health.json()["error"]["message"]
        refused = httpx.post(f"{url}/v1/completions", json={**LONG, "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_failed"


def test_draining_aborts_requests_in_flight_with_a_last_event(slow_served):
    url, engine, app = slow_served
    with ThreadPoolExecutor(1) as pool:
        with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            waiting = pool.submit(httpx.post, f"{url}/v1/completions", json=LONG)  # not streamed
            wait_until(lambda: metric(url, "tinyvllm:num_requests_waiting") == 1, what="the second request")
            app.state.engine_loop.drain(0.05)
            events = [line for line in lines if line]
        assert waiting.result().status_code == 503 and waiting.result().json()["error"]["code"] == "aborted"
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "abort"
    wait_until(lambda: engine.block_manager.num_free_blocks == engine.block_manager.num_blocks,
               what="the aborted request's blocks to be freed")
    refused = httpx.post(f"{url}/v1/completions", json={**LONG, "max_tokens": 2})
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
