"""Logprobs and n through the server: OpenAI's shapes from the engine's {token id: Logprob} dicts, and the
same values and texts as the offline API.

The end-to-end tests run once SamplingParams has the field (the server serves a field from the moment the
engine has it); until then the server refuses it by name (tests/test_server.py).
"""

from __future__ import annotations

from collections import namedtuple

import openai
import pytest

from server_support import MODEL, running_server
from tinyvllm import LLM, SamplingParams
from tinyvllm.server.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from tinyvllm.server.sampling import supported_fields

LP = namedtuple("LP", "logprob rank decoded_token")

# Two positions: the chosen token 5 ranked 3rd (outside the top 2), then token 7, itself the most likely.
TOKENS = [5, 7]
ENTRIES = [{5: LP(-2.0, 3, "a"), 7: LP(-0.1, 1, "b"), 9: LP(-0.5, 2, "c")},
           {7: LP(-0.2, 1, "b"), 8: LP(-1.9, 2, "é")}]


def test_chat_shape():
    out = chat_logprobs(TOKENS, ENTRIES, 2)["content"]
    assert [(t["token"], t["logprob"], t["bytes"]) for t in out] == [("a", -2.0, [97]), ("b", -0.2, [98])]
    assert [[(t["token"], t["logprob"]) for t in o["top_logprobs"]] for o in out] == [
        [("b", -0.1), ("c", -0.5)], [("b", -0.2), ("é", -1.9)]]
    assert out[1]["top_logprobs"][1]["bytes"] == [195, 169]
    assert all(o["top_logprobs"] == [] for o in chat_logprobs(TOKENS, ENTRIES, 0)["content"])


def test_completion_shape():
    out = completion_logprobs(TOKENS, ENTRIES, 1, text_offset=10)
    assert out == {"tokens": ["a", "b"], "token_logprobs": [-2.0, -0.2],
                   "top_logprobs": [{"b": -0.1}, {"b": -0.2}], "text_offset": [10, 11]}


def test_prompt_logprobs_shape():
    assert prompt_logprobs([None, ENTRIES[1]]) == [
        None, {"7": {"logprob": -0.2, "rank": 1, "decoded_token": "b"},
               "8": {"logprob": -1.9, "rank": 2, "decoded_token": "é"}}]


needs = {name: pytest.mark.skipif(name not in supported_fields(), reason=f"SamplingParams has no {name} yet")
         for name in ("logprobs", "n")}


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    with running_server(LLM(tiny_model_dir, backend="cpu").engine) as (url, _):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return LLM(tiny_model_dir, backend="cpu")


MESSAGES = [{"role": "user", "content": "Name a color."}]


def offline_chat_logprobs(offline, messages) -> list[dict]:
    out = offline.generate([messages], SamplingParams(temperature=0, max_tokens=8, logprobs=2),
                           use_tqdm=False)[0].outputs[0]
    return chat_logprobs(out.token_ids, out.logprobs, 2)["content"]


@needs["logprobs"]
def test_chat_logprobs_equal_offline(served, offline):
    # NOTE: each prompt is new to both engines: a prompt found in the prefix cache recomputes its last token
    # over bf16 cached keys and values, which moves the first logprob in its last digits
    expected = offline_chat_logprobs(offline, MESSAGES)
    reply = served.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=8,
                                           logprobs=True, top_logprobs=2)
    assert [t.model_dump() for t in reply.choices[0].logprobs.content] == expected
    assert len(expected) == 8 and all(len(t["top_logprobs"]) == 2 for t in expected)

    other = [{"role": "user", "content": "Name a number."}]
    chunks = served.chat.completions.create(model=MODEL, messages=other, temperature=0, max_tokens=8,
                                            logprobs=True, top_logprobs=2, stream=True)
    streamed = [t.model_dump() for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert streamed == offline_chat_logprobs(offline, other)


@needs["logprobs"]
def test_completion_logprobs_equal_offline(served, offline):
    out = offline.generate(["Hello"], SamplingParams(temperature=0, max_tokens=6, logprobs=1),
                           use_tqdm=False)[0].outputs[0]
    reply = served.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=6, logprobs=1)
    assert reply.choices[0].logprobs.model_dump() == completion_logprobs(out.token_ids, out.logprobs, 1)


@needs["n"]
def test_n_completions_equal_offline(served, offline):
    params = dict(temperature=0.8, seed=3, max_tokens=10)
    outs = offline.generate(["Once"], SamplingParams(n=3, **params), use_tqdm=False)[0].outputs
    reply = served.completions.create(model=MODEL, prompt="Once", n=3, **params)
    assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == [o.text for o in outs]
    assert reply.usage.completion_tokens == sum(len(o.token_ids) for o in outs)
    texts = {}
    for chunk in served.completions.create(model=MODEL, prompt="Once", n=3, stream=True, **params):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(3)] == [o.text for o in outs]
