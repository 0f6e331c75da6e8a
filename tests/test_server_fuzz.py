"""Generated request bodies thrown at the server: never a 5xx, every error in OpenAI's shape, and the server
still answers afterwards with nothing leaked.

Bodies are built from the real field names with values of every JSON type (and some near the edges of the
valid ranges), plus arbitrary JSON and bytes, so that most examples get past JSON parsing and reach the
checks behind it. The model's context is cut to 64 tokens to keep the valid requests quick.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_support import MODEL, running_server
from tinyvllm import LLM

json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)


def mostly(valid):
    """`valid` values most of the time, any JSON value otherwise (and shrinking towards valid ones)."""
    return st.integers(0, 9).flatmap(lambda i: json_values if i == 9 else valid)


small_ints = st.integers(-3, 70) | st.sampled_from([2**31, 2**63, 2**64])
fractions = st.floats(-1.0, 3.0) | st.sampled_from([0.0, 1.0, 1e-300, 1e300])
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                 "content": mostly(st.text(max_size=20))})

SHARED = {
    "max_tokens": mostly(small_ints),
    "temperature": mostly(fractions),
    "top_p": mostly(fractions),
    "top_k": mostly(small_ints),
    "min_p": mostly(fractions),
    "seed": mostly(small_ints),
    "n": mostly(st.integers(0, 2)),
    "stop": mostly(st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3)),
    "stop_token_ids": mostly(st.lists(st.integers(-2, 300), max_size=3)),
    "min_tokens": mostly(small_ints),
    "ignore_eos": mostly(st.booleans()),
    "stream": mostly(st.booleans()),
    "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "presence_penalty": mostly(fractions),
    "frequency_penalty": mostly(fractions),
    "repetition_penalty": mostly(fractions),
    "logit_bias": mostly(st.dictionaries(st.sampled_from(["0", "65", "259", "260", "-1", "x"]), fractions,
                                         max_size=2)),
    "user": mostly(st.text(max_size=4)),
    "surprise": json_values,
}
CHAT = {**SHARED, "max_completion_tokens": mostly(small_ints), "logprobs": mostly(st.booleans()),
        "top_logprobs": mostly(small_ints)}
COMPLETION = {**SHARED, "logprobs": mostly(small_ints), "prompt_logprobs": mostly(small_ints),
              "echo": mostly(st.booleans())}


def request_body(required: dict, fields: dict):
    """A body with the required fields (mostly valid) and a few optional ones, as JSON text."""
    optional = st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({n: fields[n] for n in names}))
    return st.tuples(st.fixed_dictionaries(required), optional).map(lambda parts: json.dumps({**parts[0], **parts[1]}))


model = mostly(st.just(MODEL))   # the other JSON values include strings: unknown models
chat_requests = st.tuples(st.just("/v1/chat/completions"),
                          request_body({"model": model, "messages": mostly(st.lists(message, min_size=1, max_size=3))}, CHAT))
completion_requests = st.tuples(st.just("/v1/completions"), request_body(
    {"model": model, "prompt": mostly(st.text(min_size=1, max_size=30) | st.lists(st.integers(-2, 300), max_size=8))},
    COMPLETION))
requests = st.one_of(
    chat_requests, chat_requests, chat_requests, completion_requests, completion_requests, completion_requests,
    # anything at all
    st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
              json_values.map(json.dumps) | st.binary(max_size=40)),
)


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir):
    engine = LLM(tiny_model_dir, backend="cpu", max_model_len=64, max_num_seqs=8).engine
    with running_server(engine) as (url, _):
        with httpx.Client(base_url=url, timeout=30) as http:
            yield http, engine


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(request=requests)
def test_generated_bodies_never_get_a_5xx(fuzz_server, request):
    http, _ = fuzz_server
    endpoint, body = request
    content = body.encode() if isinstance(body, str) else body
    response = http.post(endpoint, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (response.status_code, response.text)
    if response.status_code != 200:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in response.text.splitlines() if line]
        assert events[-1] == "data: [DONE]" and not any('"error"' in e[:12] for e in events), events[-3:]
    else:
        assert response.json()["usage"]["total_tokens"] >= 1


def test_the_server_is_alive_after_the_fuzzing(fuzz_server):
    http, engine = fuzz_server
    assert http.get("/health").status_code == 200
    reply = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
