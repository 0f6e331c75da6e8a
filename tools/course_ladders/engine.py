"""Chapters about the engine around the kernels, run on the CPU backend (the NumPy reference) with the tiny
random Llama (2 layers, hidden 64, vocabulary 256): 1 (tokens in, tokens out), 2 (weights), 10 (batching) and
11 (paged KV management). Every version gives the reference's tokens (checked); what it counts (tokens through
the model, engine steps, preemptions, KV blocks) depends on the algorithm, not on the machine.
"""

from __future__ import annotations

import json
import struct
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np

from reference.bf16 import bf16_to_f32, f32_to_bf16
from reference.llama import ReferenceLlama, single_sequence_batch
from tinyvllm.config import ModelConfig
from tinyvllm.engine import LLMEngine
from tinyvllm.random_model import make_random_model
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.weights import load_weights
from tools.course_ladders.common import HostStep

BLOCK = 4   # KV block size of these workloads: small, so that prompts span several blocks


@lru_cache(maxsize=None)
def tiny_model(layout: str = "legacy") -> Path:
    """The tiny random model, written once per process (and config layout) into a temporary directory."""
    return make_random_model(Path(tempfile.mkdtemp(prefix="course-")) / layout, "tiny", seed=0,
                             config_layout=layout)


def _greedy(engine: LLMEngine, prompts, max_tokens, n=1, every_step=None) -> dict:
    """Run every prompt (token ids) to its max_tokens greedily; {request id: [token ids of each completion]}."""
    for i, (prompt, count) in enumerate(zip(prompts, max_tokens)):
        engine.add_request([int(t) for t in prompt],
                           SamplingParams(temperature=0, max_tokens=count, ignore_eos=True, n=n), request_id=str(i))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
        if every_step:
            every_step(engine)
    return done


# --- chapter 1: tokens in, tokens out -------------------------------------------------------------------------

def token_steps(real: bool) -> list[HostStep]:
    config = ModelConfig.from_dir(tiny_model())
    model = ReferenceLlama(config, load_weights(tiny_model(), config))
    prompt, new = np.random.default_rng(1).integers(0, config.vocab_size, 12).tolist(), 8
    table = np.arange(-(-(len(prompt) + new) // BLOCK))
    expected = []

    def recompute():
        tokens, through = list(prompt), 0
        for _ in range(new):
            kv = model.new_kv_cache(len(table), BLOCK)   # nothing kept between steps
            logits = model.forward(single_sequence_batch(tokens, 0, table, BLOCK), kv)
            through += len(tokens)
            tokens.append(int(np.argmax(logits[0])))
        expected.append(tokens[len(prompt):])
        return {"new tokens": new, "tokens through the model": through}

    def with_cache():
        kv = model.new_kv_cache(len(table), BLOCK)
        tokens = list(prompt)
        logits = model.forward(single_sequence_batch(tokens, 0, table, BLOCK), kv)   # prefill
        through = len(tokens)
        for _ in range(new - 1):
            tokens.append(int(np.argmax(logits[0])))
            logits = model.forward(single_sequence_batch(tokens[-1:], len(tokens) - 1, table, BLOCK), kv)  # decode
            through += 1
        tokens.append(int(np.argmax(logits[0])))
        assert tokens[len(prompt):] == expected[0], "the KV cache changed the greedy tokens"
        return {"new tokens": new, "tokens through the model": through}

    def engine():
        got = _greedy(LLMEngine.from_options(tiny_model(), backend="cpu", block_size=BLOCK), [prompt], [new])
        assert got["0"][0] == expected[0], "the engine's greedy tokens differ from the reference loop's"
        return {"new tokens": new, "tokens through the model": len(prompt) + new - 1}

    return [HostStep("1a recompute", "the whole sequence through the model for every new token", recompute),
            HostStep("1b prefill + decode", "the prompt once, then one token a step, K and V cached", with_cache),
            HostStep("1c the engine", "the same loop as LLM.generate runs it (CPU backend)", engine)]


# --- chapter 2: weights -----------------------------------------------------------------------------------------

def weight_steps(real: bool) -> list[HostStep]:
    def bf16_bits():
        x = np.random.default_rng(2).standard_normal(10_000).astype(np.float32)
        bits = f32_to_bf16(x)
        u = x.view(np.uint32)
        rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
        assert np.array_equal(bits, rounded), "not round-to-nearest-even"
        back = bf16_to_f32(bits)
        assert np.all(np.abs(back - x) <= 2.0 ** -8 * np.abs(x)), "a bf16 is within half an ulp (2^-8 relative)"
        return {"values": x.size, "bytes as fp32": x.nbytes, "bytes as bf16": bits.nbytes}

    def safetensors_load():
        model_dir = tiny_model()
        config = ModelConfig.from_dir(model_dir)
        weights = load_weights(model_dir, config)
        # the file read by hand: 8 bytes of header length, the JSON header, then the raw tensor bytes
        raw = (model_dir / "model.safetensors").read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        for name, array in weights.items():
            begin, end = header[name]["data_offsets"]
            stored = np.frombuffer(raw[8 + n + begin:8 + n + end], np.uint16).reshape(header[name]["shape"])
            assert header[name]["dtype"] == "BF16" and np.array_equal(array, stored), name
        return {"tensors": len(weights), "values": sum(a.size for a in weights.values()),
                "bytes as bf16": sum(a.nbytes for a in weights.values())}

    def config_layouts():
        legacy, new = ModelConfig.from_dir(tiny_model("legacy")), ModelConfig.from_dir(tiny_model("transformers5"))
        assert legacy == new, "the two config.json layouts must give the same model"
        return {"config fields": len(json.loads((tiny_model() / "config.json").read_text()))}

    return [HostStep("2a bf16 as uint16", "round to nearest even; widening back is exact", bf16_bits),
            HostStep("2b safetensors -> weights", "a Hugging Face checkpoint's tensors, bit for bit", safetensors_load),
            HostStep("2c config.json, two layouts", "legacy and transformers-5 fields, one ModelConfig",
                     config_layouts)]


# --- chapter 10: batching -----------------------------------------------------------------------------------

def _requests():
    """12 requests of 6-30 prompt tokens and 3-16 new tokens (seeded): more than the 4 sequence slots."""
    rng = np.random.default_rng(10)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(6, 31, 12)]
    return prompts, [int(n) for n in rng.integers(3, 17, 12)]


def batching_steps(real: bool) -> list[HostStep]:
    prompts, max_tokens = _requests()
    reference = {}

    def run(version, **options):
        def step():
            engine = LLMEngine.from_options(tiny_model(), backend="cpu", block_size=BLOCK, max_num_seqs=4,
                                            enable_prefix_caching=False, **options)
            rows, steps = [], [0]

            def count(e):
                steps[0] += 1
                rows.append(len(e.scheduler.running))

            got = _greedy(engine, prompts, max_tokens, every_step=count)
            if not reference:
                reference.update(got)
            assert got == reference, f"{version}: tokens differ from the static batch's"
            return {"engine steps": steps[0], "running sequences per step (mean)": round(float(np.mean(rows)), 2),
                    "preemptions": engine.scheduler.num_preemptions}
        return step

    def preempting():
        counts = run("preemption", num_kv_blocks=20)()
        assert counts["preemptions"] > 0, "the cache was meant to be too small for four sequences at once"
        return counts

    return [HostStep("10a static", "a batch runs until its longest member ends", run("static", scheduler="static")),
            HostStep("10b continuous", "a finished sequence's slot is refilled at the next step", run("continuous")),
            HostStep("10c chunked prefill", "prompts cut to a budget of 8 tokens a step, decodes mixed in",
                     run("chunked", max_num_batched_tokens=8)),
            HostStep("10d preemption", "a cache of 20 blocks: the youngest sequence is recomputed later",
                     preempting)]


# --- chapter 11: paged KV management ------------------------------------------------------------------------

def paged_kv_steps(real: bool) -> list[HostStep]:
    rng = np.random.default_rng(11)
    prefix = rng.integers(0, 256, 24).tolist()
    prompts = [prefix + rng.integers(0, 256, 3).tolist() for _ in range(4)]
    reference = {}

    def shared_prefix(caching):
        def step():
            engine = LLMEngine.from_options(tiny_model(), backend="cpu", block_size=BLOCK,
                                            enable_prefix_caching=caching)
            first = _greedy(engine, prompts[:1], [6])   # its full prompt blocks enter the prefix cache
            cached = []
            for i, prompt in enumerate(prompts[1:], 1):
                engine.add_request([int(t) for t in prompt],
                                   SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), request_id=f"r{i}")
            got = dict(first)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id.startswith("r"):
                        got[out.request_id[1:]] = [c.token_ids for c in out.outputs]
                        cached.append(out.num_cached_tokens)
            if not reference:
                reference.update(got)
            assert got == reference, "prefix caching changed the tokens"
            computed = sum(len(p) for p in prompts) - sum(cached)
            return {"prompt tokens computed": computed, "prompt tokens from the cache": sum(cached)}
        return step

    def forks(n_at_once):
        def step():
            engine = LLMEngine.from_options(tiny_model(), backend="cpu", block_size=BLOCK, enable_prefix_caching=False)
            peak = [0]

            def watch(e):
                peak[0] = max(peak[0], e.block_manager.num_blocks - e.block_manager.num_free_blocks)

            requests = 1 if n_at_once else 3
            got = _greedy(engine, [prompts[0]] * requests, [8] * requests, n=3 if n_at_once else 1, every_step=watch)
            completions = [c for r in sorted(got) for c in got[r]]
            assert len(completions) == 3 and all(c == completions[0] for c in completions), "greedy: all equal"
            return {"completions": 3, "peak KV blocks": peak[0]}
        return step

    return [HostStep("11a no prefix cache", "every prompt's KV computed and stored for itself", shared_prefix(False)),
            HostStep("11b prefix caching", "full blocks found by hash of their tokens and shared", shared_prefix(True)),
            HostStep("11c 3 requests", "the same prompt three times: three copies of its blocks", forks(False)),
            HostStep("11d n = 3", "one prompt, three completions: blocks shared, copy-on-write", forks(True))]
