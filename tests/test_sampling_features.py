"""Sampling parameters beyond temperature / top-k / top-p / min-p, on the CPU backend (the CUDA engine's are in
test_cuda_engine.py): validation; penalties and logit_bias by their definitions; min_tokens; logprobs and
prompt_logprobs as the raw log-softmax; n completions sharing the prompt's KV blocks.

The runner's logits are recorded as it sees them (`recording`), so each sampled row is checked against the
definition applied to its own raw logits: a wrong row, a stale count or a missed pending token shows up as a
different token, whatever the model's numerics.
"""

import numpy as np
import pytest

import tinyvllm.cpu_runner as cpu_runner
from reference.sampling import apply_penalties, log_softmax, sample
from tinyvllm import LLM, SamplingParams
from tinyvllm.engine import RequestError
from tinyvllm.sampling_params import MAX_LOGPROBS, SamplingParamsError

EOS = 259  # the tiny model's tokenizer eos (config eos ids: 257, 259)
PROMPTS = [[256, 1, 2, 3, 4, 5, 6, 7, 8, 9], [256, 40, 41], [256] + [17] * 6, [256, 100, 101, 102, 103, 104, 105]]


@pytest.mark.parametrize("kwargs, name", [
    (dict(n=0), "n"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(repetition_penalty=1e-50), "repetition_penalty"), (dict(repetition_penalty=1e39), "repetition_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"), (dict(logprobs=-1), "logprobs"),
    (dict(prompt_logprobs=21), "prompt_logprobs"), (dict(logit_bias={5: 101.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"), (dict(min_tokens=5, max_tokens=4), "min_tokens"),
])
def test_invalid_values_are_refused_by_name(kwargs, name):
    with pytest.raises(SamplingParamsError, match=rf"SamplingParams\.{name} "):
        SamplingParams(**kwargs)


def test_valid_edges_and_logit_bias_keys():
    p = SamplingParams(n=4, repetition_penalty=0.01, presence_penalty=-2, frequency_penalty=2, logprobs=0,
                       prompt_logprobs=MAX_LOGPROBS, logit_bias={"12": -100, 3: 100.0})
    assert p.logit_bias == {12: -100.0, 3: 100.0} and p.uses_penalties
    assert not SamplingParams().uses_penalties


def test_requests_are_checked_against_the_engine(tiny_model_dir):
    engine = LLM(tiny_model_dir, backend="cpu", max_num_seqs=4).engine
    with pytest.raises(RequestError, match=r"SamplingParams\.logit_bias has token id 260, outside the vocabulary"):
        engine.add_request([1, 2], SamplingParams(logit_bias={260: 1.0}))
    with pytest.raises(RequestError, match=r"SamplingParams\.n is 5, but at most max_num_seqs = 4"):
        engine.add_request([1, 2], SamplingParams(n=5))
    assert not engine.has_unfinished_requests()


# --- the runner's view of each step --------------------------------------------------------------------------

@pytest.fixture
def recording(monkeypatch):
    """Per CPU step: rows (each sampled row's sequence and output index), raw (their raw logits), prompt (the
    prompt rows' logits), batch, sampling, tokens."""
    steps = []
    launch, sample_step = cpu_runner.CPURunner.launch, cpu_runner.sample_step
    current = {}

    def recording_sample_step(logits, batch, sampling):
        tokens, logprobs = sample_step(logits, batch, sampling)
        n = len(batch.logits_indices)
        current.update(raw=logits[:n].copy(), prompt=logits[n:].copy(), sampling=sampling, tokens=tokens,
                       batch=batch)
        return tokens, logprobs

    def recording_launch(self, scheduled, chain_src=None):
        current.clear()
        rows = []
        for item in scheduled:
            if item.samples:
                rows += [(s, len(s.output_token_ids)) for s in [item.seq] + list(item.seq.forks)]
        handle = launch(self, scheduled, chain_src)
        if current:
            steps.append(dict(current, rows=rows))
        return handle

    monkeypatch.setattr(cpu_runner, "sample_step", recording_sample_step)
    monkeypatch.setattr(cpu_runner.CPURunner, "launch", recording_launch)
    return steps


def processed(raw, seq, index, eos=(257, 259)):
    """The definition (OpenAI's presence / frequency penalties, HF's and vLLM's repetition penalty, logit_bias,
    min_tokens masking), vectorised over the vocabulary in float32, for the draw of output token `index`."""
    p = seq.params
    out = np.asarray(seq.output_token_ids[:index])
    x = raw.astype(np.float32).copy()
    for token, bias in (p.logit_bias or {}).items():
        x[token] += np.float32(bias)
    if index < p.min_tokens:
        x[list(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)))] = -np.inf
    seen = np.zeros(x.size, bool)
    seen[list(seq.prompt_token_ids) + out.tolist()] = True
    r = np.float32(p.repetition_penalty)
    x[seen] = np.where(x[seen] > 0, x[seen] / r, x[seen] * r)
    counts = np.bincount(out.astype(np.int64), minlength=x.size).astype(np.float32)
    x -= np.float32(p.frequency_penalty) * counts
    x -= np.float32(p.presence_penalty) * (counts > 0)
    return x


FEATURES = [
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),                        # no feature: as before
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, repetition_penalty=1.8),
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.9,
                   repetition_penalty=0.7),
    SamplingParams(temperature=0.8, top_k=30, seed=4, max_tokens=6, min_tokens=4, logit_bias={EOS: 60.0, 7: 2.5},
                   frequency_penalty=-0.5),
]


@pytest.mark.parametrize("options", [dict(), dict(max_num_batched_tokens=6), dict(num_kv_blocks=9),
                                     dict(async_scheduling=False)])
def test_each_row_is_drawn_from_its_processed_logits(tiny_model_dir, recording, options):
    """Greedy rows take the argmax of the processed logits, sampled rows draw from them, with the prompt and
    every earlier output counted (the async look-ahead's pending token included), under chunked prefill and
    preemption; rows with none of these features see their raw logits."""
    llm = LLM(tiny_model_dir, backend="cpu", block_size=4, **options)
    outs = llm.generate(PROMPTS, FEATURES, use_tqdm=False)
    checked = 0
    for step in recording:
        sampling, batch = step["sampling"], step["batch"]
        engine_view = step["raw"]   # the processed logits the draw saw: the packed entries through the reference
        if sampling.processes_logits:
            engine_view = apply_penalties(step["raw"], batch.token_ids, batch.logits_indices, sampling.pending,
                                          sampling.repetition_penalty, sampling.presence_penalty,
                                          sampling.frequency_penalty, sampling.entry_offsets, sampling.entries)
        for r, (seq, index) in enumerate(step["rows"]):
            x = processed(step["raw"][r], seq, index)
            np.testing.assert_array_equal(engine_view[r], x)
            p = seq.params
            want = sample(x[None], np.float32([p.temperature]), np.int32([p.top_k]), np.float32([p.top_p]),
                          np.float32([p.min_p]), step["sampling"].uniform[r: r + 1])[0]
            assert step["tokens"][r] == want, (seq.request_id, index)
            if seq.params is FEATURES[0]:
                assert not step["sampling"].pending[r] if step["sampling"].pending is not None else True
            checked += 1
    assert checked >= 23 and [len(o.outputs[0].token_ids) for o in outs] == [6, 6, 6, 5]
    assert outs[3].outputs[0].token_ids[-1] == EOS and outs[3].outputs[0].finish_reason == "stop"  # min_tokens 4
    if "num_kv_blocks" in options:
        assert llm.engine.scheduler.num_preemptions > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    # the penalties change the answers, and the plain request's tokens are its tokens alone
    assert len({tuple(o.outputs[0].token_ids) for o in outs[:3]}) == 3
    alone = LLM(tiny_model_dir, backend="cpu", block_size=4).generate([PROMPTS[0]], FEATURES[0], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_min_tokens_masks_eos_and_stop_ids_and_defers_stop_strings(tiny_model_dir):
    llm = LLM(tiny_model_dir, backend="cpu")
    forced = {EOS: 100.0}
    assert llm.generate([[1, 2]], SamplingParams(temperature=0, logit_bias=forced), use_tqdm=False)[0].outputs[
        0].token_ids == [EOS]
    out = llm.generate([[1, 2]], SamplingParams(temperature=0, logit_bias=forced, min_tokens=3),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and EOS not in out.token_ids[:3] and out.token_ids[3] == EOS
    assert out.finish_reason == "stop"
    # a stop id is masked too; with ignore_eos EOS is an ordinary token
    out = llm.generate([[1, 2]], SamplingParams(temperature=0, logit_bias={65: 100.0}, stop_token_ids=[65],
                                                min_tokens=2), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:2] != [65, 65] and 65 not in out.token_ids[:2] and out.token_ids[2] == 65
    out = llm.generate([[1, 2]], SamplingParams(temperature=0, logit_bias=forced, min_tokens=2, max_tokens=3,
                                                ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [EOS] * 3
    # stop strings: not looked for in the first min_tokens tokens' text
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = llm.generate([[1, 2]], greedy, use_tqdm=False)[0].outputs[0]
    stop = full.text[0]
    assert llm.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]),
                        use_tqdm=False)[0].text == ""
    late = llm.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop],
                                                 min_tokens=3), use_tqdm=False)[0].outputs[0]
    assert late.token_ids[:3] == full.token_ids[:3] and late.text.startswith(full.text[:1])
    assert late.finish_reason == ("stop" if stop in full.text[len(llm.tokenizer.decode(full.token_ids[:3])):]
                                  else "length")


def assert_logprob_row(entry, raw, chosen, num):
    """A {token: Logprob} dict against the float64 log-softmax of the row's raw logits."""
    lp = log_softmax(raw[None])[0].astype(np.float32)
    top = np.argsort(-raw, kind="stable")[:num]
    assert list(entry) == [chosen] + [t for t in top.tolist() if t != chosen] or list(entry)[1:] == top.tolist()
    assert set(entry) == {chosen, *top.tolist()}
    for k, token in enumerate(top.tolist()):
        assert entry[token].rank == k + 1 and entry[token].logprob == float(lp[token])
    if chosen not in top:
        assert entry[chosen].rank == int(np.count_nonzero(raw >= raw[chosen]))
    assert entry[chosen].logprob == float(lp[chosen])


@pytest.mark.parametrize("options", [dict(), dict(max_num_batched_tokens=4, num_kv_blocks=8)])
def test_logprobs_are_the_raw_log_softmax(tiny_model_dir, recording, options):
    """logprobs=N: the chosen token and the N most likely, from the logits before penalties and temperature;
    prompt_logprobs=N: each prompt token given the ones before (the first: None), through chunked prefill
    and preemption; requests without logprobs get None."""
    params = [SamplingParams(temperature=0.7, seed=1, max_tokens=5, ignore_eos=True, logprobs=3,
                             repetition_penalty=1.5, prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0, prompt_logprobs=0)]
    llm = LLM(tiny_model_dir, backend="cpu", block_size=4, **options)
    outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert outs[1].outputs[0].logprobs is None and outs[1].prompt_logprobs is None
    raw = {}
    for step in recording:
        for r, (seq, index) in enumerate(step["rows"]):
            raw[seq.request_id, index] = step["raw"][r]
    for i in (0, 2):
        out = outs[i].outputs[0]
        assert len(out.logprobs) == 5
        for index, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            assert_logprob_row(entry, raw[outs[i].request_id, index], token, params[i].logprobs)
            assert entry[token].decoded_token == llm.tokenizer.decode([token], skip_special_tokens=False)
        assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))
    # prompt logprobs: against a whole-prompt forward of the reference
    from reference.llama import single_sequence_batch
    model = llm.engine.runner.model
    for i in (0, 2):
        prompt = PROMPTS[i]
        kv = model.new_kv_cache(8, 4)
        batch = single_sequence_batch(prompt, 0, np.arange(8), 4)
        batch.logits_indices = np.arange(len(prompt))
        lp = log_softmax(model.forward(batch, kv))
        got = outs[i].prompt_logprobs
        assert got[0] is None and len(got) == len(prompt)
        for j in range(1, len(prompt)):
            entry = got[j]
            assert prompt[j] in entry and len(entry) <= params[i].prompt_logprobs + 1
            for token, value in entry.items():   # bf16 KV roundings may differ from the whole-prompt forward
                assert abs(value.logprob - lp[j - 1, token]) < 1e-2
            assert entry[prompt[j]].rank == int(np.count_nonzero(lp[j - 1] >= lp[j - 1, prompt[j]] - 1e-2)) or \
                abs(entry[prompt[j]].rank - np.count_nonzero(lp[j - 1] >= lp[j - 1, prompt[j]])) <= 1
    assert outs[0].num_cached_tokens == 0


def test_prompt_logprobs_skip_the_prefix_cache(tiny_model_dir):
    llm = LLM(tiny_model_dir, backend="cpu", block_size=4)
    prompt = list(range(30, 50))
    first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1), use_tqdm=False)[0]
    again = llm.generate([prompt, prompt], [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1),
                                            SamplingParams(temperature=0, max_tokens=2)], use_tqdm=False)
    assert again[0].num_cached_tokens == 0 and again[1].num_cached_tokens == 16
    assert again[0].prompt_logprobs == first.prompt_logprobs


def test_n_completions_are_the_seeded_requests_they_stand_for(tiny_model_dir):
    """n=3 with seed s: completion i is what one request with seed s + i gives (vLLM's seeds), here drawn from
    one prompt computation; batched with others, under preemption too."""
    sampled = dict(temperature=0.9, top_p=0.95, max_tokens=7, ignore_eos=True)
    llm = LLM(tiny_model_dir, backend="cpu", block_size=4)
    singles = llm.generate([PROMPTS[0]] * 3, [SamplingParams(seed=9 + i, **sampled) for i in range(3)],
                           use_tqdm=False)
    want = [o.outputs[0].token_ids for o in singles]
    assert len({tuple(t) for t in want}) == 3
    for options in (dict(), dict(num_kv_blocks=10, max_num_batched_tokens=8)):
        llm = LLM(tiny_model_dir, backend="cpu", block_size=4, **options)
        outs = llm.generate([PROMPTS[1], PROMPTS[0]], [SamplingParams(temperature=0, max_tokens=7),
                                                     SamplingParams(n=3, seed=9, logprobs=1, **sampled)],
                            use_tqdm=False)
        assert [c.index for c in outs[1].outputs] == [0, 1, 2]
        assert [c.token_ids for c in outs[1].outputs] == want
        assert all(len(c.logprobs) == 7 for c in outs[1].outputs) and outs[1].finished
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks and llm.engine.scheduler.num_slots == 0


def peak_blocks(llm, prompts, params):
    engine = llm.engine
    for prompt, p in zip(prompts, params):
        engine.add_request(prompt, p)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.block_manager.num_blocks - engine.block_manager.num_free_blocks)
    return peak


def test_n_8_shares_the_prompt_blocks(tiny_model_dir):
    """A 30-token prompt, 8 completions of 6 tokens, blocks of 4: shared, the prompt's 7 full blocks are stored
    once and each completion owns its copy of the partly filled 8th and one more (7 + 8 * 2 = 23); as 8
    separate requests (no prefix cache) each holds all 9 of its blocks (72)."""
    prompt = list(range(40, 70))
    sampled = dict(temperature=1.0, max_tokens=6, ignore_eos=True)
    shared = peak_blocks(LLM(tiny_model_dir, backend="cpu", block_size=4), [prompt], [SamplingParams(n=8, seed=1,
                                                                                                     **sampled)])
    separate = peak_blocks(LLM(tiny_model_dir, backend="cpu", block_size=4, enable_prefix_caching=False),
                           [prompt] * 8, [SamplingParams(seed=1 + i, **sampled) for i in range(8)])
    assert (shared, separate) == (23, 72)


def test_default_model_repetition_penalty_equals_transformers(default_model_dir):
    """SmolLM2-135M-Instruct, greedy with repetition_penalty 1.3: Hugging Face generate's 32 tokens (recorded
    by tools/make_goldens.py), which differ from the unpenalised answer (a list that repeats itself)."""
    import json

    from tests_support import GOLDENS

    golden = json.loads((GOLDENS / "smollm2_repetition_penalty.json").read_text())
    llm = LLM(default_model_dir, backend="cpu")
    params = SamplingParams(temperature=0, max_tokens=golden["max_new_tokens"],
                            repetition_penalty=golden["repetition_penalty"])
    out = llm.generate([golden["messages"]], params, use_tqdm=False)[0]
    assert out.prompt_token_ids == golden["prompt_token_ids"]
    assert out.outputs[0].token_ids == golden["generated_token_ids"]
    plain = llm.generate([golden["messages"]], SamplingParams(temperature=0, max_tokens=golden["max_new_tokens"]),
                         use_tqdm=False)[0]
    assert plain.outputs[0].token_ids != golden["generated_token_ids"]


def test_rows_whose_logits_overflow_sample_greedily(tiny_model_dir):
    """A temperature so small, or a repetition penalty so extreme, that some l / T is infinite leaves no
    probability defined: the draw is the greedy token (the GPU kernel's documented fallback), not an error
    (the server's fuzz test stopped the engine with one)."""
    llm = LLM(tiny_model_dir, backend="cpu")
    greedy = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].outputs[0]
    tiny = llm.generate(["Hi"], SamplingParams(temperature=1e-40, max_tokens=3, seed=1), use_tqdm=False)[0]
    assert tiny.outputs[0].token_ids == greedy.token_ids
    extreme = SamplingParams(temperature=1e-30, repetition_penalty=1e-30, max_tokens=3, seed=1)
    assert len(llm.generate(["Hi"], extreme, use_tqdm=False)[0].outputs[0].token_ids) == 3
