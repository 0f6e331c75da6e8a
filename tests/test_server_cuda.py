"""The OpenAI-compatible server on the CUDA engine (issue 28): the same app as tests/test_server.py, driven by the
official `openai` client, but the engine it steps runs every operation as a Numba kernel, in a process of its own
as `tinyvllm serve` runs it (EngineProcess: the CUDA context is the child's).

Greedy answers, streamed or not, chat or completion, must be exactly the offline API's (`LLM.generate` on a
second CUDA engine of the same model in this process), and 32 concurrent streaming clients all complete with
those answers and leave no KV block behind.

Needs a GPU (TINYVLLM_TEST_PROFILE=gpu). Not run in Numba's simulator: there the tiny model's CUDA engine takes
tens of seconds for a handful of tokens (tests/test_cuda_engine.py), far from a server test's dozens of requests.
"""

from __future__ import annotations

import asyncio
import os

import openai
import pytest

from server_support import MODEL, metric, running_server, wait_until
from tinyvllm import LLM, SamplingParams

GPU = os.environ.get("TINYVLLM_TEST_PROFILE", "sim") == "gpu"
pytestmark = pytest.mark.skipif(not GPU, reason="needs a GPU (TINYVLLM_TEST_PROFILE=gpu); in Numba's simulator the "
                                                "CUDA engine is far too slow for a server's requests")

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
# NOTE: fp32 matmul inputs. The server batches requests as they arrive, the offline engine as they are given, so a
# request's rows go through GEMMs of other sizes (other tiles, other summation orders); with exact inputs the
# logits differ by fp32 rounding only, far below the tiny model's gaps between its two best tokens. Warm-up off:
# kernels compile as first used (fewer, on this small model), and graphs are captured in the engine's thread.
ENGINE = dict(backend="cuda", num_kv_blocks=256, matmul_precision="fp32", warmup=False)


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return LLM(tiny_model_dir, **ENGINE)


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    from tinyvllm.server.engine_core import EngineProcess

    engine = EngineProcess(tiny_model_dir, ENGINE)
    assert engine.info.backend == "cuda"
    with running_server(engine) as (url, app):
        yield url, engine


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="none", max_retries=0)


def offline_answer(offline, prompt, max_tokens):
    """(text, finish reason, prompt tokens, completion tokens) of a greedy request through LLM.generate."""
    out = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]
    return out.text, out.outputs[0].finish_reason, len(out.prompt_token_ids), len(out.outputs[0].token_ids)


def test_chat_and_completions_greedy_equal_offline(client, offline):
    want = offline_answer(offline, CHAT, 24)
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=24)
    assert want[0]
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason, reply.usage.prompt_tokens,
            reply.usage.completion_tokens) == want

    for prompt in ("The capital of France is", [256, 72, 105, 33, 10, 84]):
        want = offline_answer(offline, prompt, 20)
        reply = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=20)
        assert (reply.choices[0].text, reply.choices[0].finish_reason, reply.usage.prompt_tokens,
                reply.usage.completion_tokens) == want


def test_streaming_chat_and_completion_equal_offline(client, offline):
    text, reason, n_prompt, n_out = offline_answer(offline, CHAT, 40)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=40,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reason
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (n_prompt, n_out)

    text, reason, _, _ = offline_answer(offline, "Hello", 40)
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=40, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text and text
    assert chunks[-1].choices[0].finish_reason == reason


def test_concurrent_streaming_clients_all_complete_with_the_offline_answers(served, offline):
    url, engine = served
    prompts = [f"Request number {i}: " + "tell me a story " * (i % 5) for i in range(32)]
    lengths = [8 + 5 * (i % 7) for i in range(32)]   # they finish at different steps: the batch changes shape
    want = offline.generate(prompts, [SamplingParams(temperature=0, max_tokens=n) for n in lengths], use_tqdm=False)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    async def ask(prompt, max_tokens):
        stream = await client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=max_tokens,
                                                 stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens

    async def ask_all():
        try:
            return await asyncio.gather(*(ask(p, n) for p, n in zip(prompts, lengths)))
        finally:
            await client.close()

    answers = asyncio.run(ask_all())
    assert answers == [(o.text, len(o.outputs[0].token_ids)) for o in want]
    wait_until(lambda: metric(url, "tinyvllm:kv_cache_usage_perc") == 0.0, what="every KV block back")
