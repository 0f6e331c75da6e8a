"""The engine end to end on the CPU reference backend: the same request gives the same tokens alone, in a
batch, with chunked prefill, with prefix-cache hits, under static batching and after preemption."""

import json

import numpy as np
import pytest

from tests_support import GOLDEN_FRANCE
from tinyvllm import LLM, SamplingParams
from tinyvllm.engine import RequestError


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, n).tolist() for n in (5, 23, 40, 1, 17, 33)]


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=11, max_tokens=12, ignore_eos=True)


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def alone(tiny_model_dir, prompts):
    llm = LLM(tiny_model_dir, backend="cpu", block_size=4)
    return {name: [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
            for name, params in (("greedy", GREEDY), ("sampled", SAMPLED))}


@pytest.mark.parametrize("options", [
    dict(),                                                   # one continuous batch
    dict(max_num_batched_tokens=7),                           # chunked prefill, decodes mixed in
    dict(max_num_seqs=2),                                     # sequences wait for a free slot
    dict(scheduler="static", max_num_seqs=4),                 # static batches
    dict(num_kv_blocks=24, max_num_batched_tokens=16),        # a cache too small for all: preemption
    dict(enable_prefix_caching=False, block_size=16),
])
def test_batched_tokens_equal_tokens_alone(tiny_model_dir, prompts, alone, options):
    llm = LLM(tiny_model_dir, backend="cpu", **{"block_size": 4, **options})
    for name, params in (("greedy", GREEDY), ("sampled", SAMPLED)):
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert tokens(outs) == alone[name], name
        assert all(o.outputs[0].finish_reason == "length" and o.finished for o in outs)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # nothing leaked
    if "num_kv_blocks" in options:
        assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_cache_reuses_a_shared_prompt(tiny_model_dir, prompts, alone):
    llm = LLM(tiny_model_dir, backend="cpu", block_size=4)
    shared = prompts[2]  # 40 tokens: 9 full blocks are reusable (the last token is always recomputed)
    first = llm.generate([shared], GREEDY, use_tqdm=False)[0]
    again = llm.generate([shared, shared + [7, 8, 9]], GREEDY, use_tqdm=False)
    assert first.num_cached_tokens == 0
    assert [o.num_cached_tokens for o in again] == [36, 40]
    assert again[0].outputs[0].token_ids == alone["greedy"][2]
    reference = LLM(tiny_model_dir, backend="cpu", block_size=4, enable_prefix_caching=False)
    assert again[1].outputs[0].token_ids == reference.generate([shared + [7, 8, 9]], GREEDY,
                                                               use_tqdm=False)[0].outputs[0].token_ids


def test_default_model_tokens_equal_transformers(default_model_dir):
    golden = json.loads(GOLDEN_FRANCE.read_text())
    llm = LLM(default_model_dir, backend="cpu")
    out = llm.generate([golden["messages"]], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert out.prompt_token_ids == golden["prompt_token_ids"]
    assert out.outputs[0].token_ids == golden["generated_token_ids"]
    assert out.text == "The capital of France is Paris." and out.outputs[0].finish_reason == "stop"


def test_streaming_yields_the_text(tiny_model_dir):
    llm = LLM(tiny_model_dir, backend="cpu")
    full = llm.generate(["Hello"], GREEDY, use_tqdm=False)[0].text
    assert "".join(llm.stream("Hello", GREEDY)) == full
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_final_only_requests_are_reported_once_with_the_same_text(tiny_model_dir):
    engine = LLM(tiny_model_dir, backend="cpu").engine
    final = engine.add_request("Hello", GREEDY, final_only=True)
    every = engine.add_request("Hello", GREEDY)
    seen = {final: [], every: []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert len(seen[final]) == 1 and seen[final][0].finished and len(seen[every]) == GREEDY.max_tokens
    assert seen[final][0].text == seen[every][-1].text == "".join(o.new_text for o in seen[every])
    assert seen[final][0].outputs[0].token_ids == seen[every][-1].outputs[0].token_ids
    assert engine.num_generated_tokens == 2 * GREEDY.max_tokens


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_streamed_token_ids_are_snapshots_of_their_step(tiny_model_dir, async_scheduling):
    """A streamed output's ids are a view of the sequence's list (no copy per step): each must still read as
    the ids of its own step after later steps appended to (and a stop cut) that list."""
    engine = LLM(tiny_model_dir, backend="cpu", async_scheduling=async_scheduling).engine
    stop_at = engine.add_request("Hello", SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[0, 1, 2, 3]
                                                           + list(range(4, 260, 3))))
    rid = engine.add_request("Hello", GREEDY)
    seen = {rid: [], stop_at: []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append((out.outputs[0].token_ids, list(out.outputs[0].token_ids)))
    for outs in seen.values():
        final = outs[-1][0]
        assert isinstance(final, list)  # a finished output holds a list of its own
        for view, copied in outs:
            assert view == copied == final[:len(copied)] and list(view) == copied and len(view) == len(copied)
            assert view[-1] == copied[-1] and view[1:] == copied[1:] and view[::2] == copied[::2]
    assert [len(v) for v, _ in seen[rid]] == list(range(1, GREEDY.max_tokens + 1))


def test_stop_strings_and_stop_tokens(tiny_model_dir):
    llm = LLM(tiny_model_dir, backend="cpu")
    full = llm.generate(["Hi"], GREEDY, use_tqdm=False)[0]
    text, ids = full.text, full.outputs[0].token_ids
    cut = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[text[3:5]]),
                       use_tqdm=False)[0]
    assert cut.text == text[: text.index(text[3:5])] and cut.outputs[0].finish_reason == "stop"
    by_token = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                   stop_token_ids=[ids[4]]), use_tqdm=False)[0]
    assert by_token.outputs[0].token_ids == ids[: ids.index(ids[4]) + 1]
    assert by_token.outputs[0].finish_reason == "stop"


def test_abort_frees_blocks(tiny_model_dir):
    llm = LLM(tiny_model_dir, backend="cpu", block_size=4)
    engine = llm.engine
    rid = engine.add_request([1, 2, 3, 4, 5, 6], GREEDY)
    engine.step()
    engine.abort(rid)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_invalid_requests(tiny_model_dir):
    llm = LLM(tiny_model_dir, backend="cpu", num_kv_blocks=8, block_size=4)  # a 32-token cache
    with pytest.raises(RequestError, match="the prompt has 40 tokens, but at most 31 fit"):
        llm.generate([[1] * 40], GREEDY)
    with pytest.raises(RequestError, match="token id 999 is outside the vocabulary"):
        llm.generate([[1, 999]], GREEDY)
    with pytest.raises(RequestError, match="the prompt is empty"):
        llm.generate([""], GREEDY)
    # a request that reaches the end of the cache-limited context stops with "length"
    out = llm.generate([[1] * 20], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 12 and out[0].outputs[0].finish_reason == "length"


def test_bf16_matmul_precision_batches_like_alone_and_is_validated(tiny_model_dir, prompts):
    """The bf16-input numerics keep the engine's invariant: batching changes only summation order, so the
    same greedy tokens come out alone and batched (test_reference_llama checks that the numbers change)."""
    llm = LLM(tiny_model_dir, backend="cpu", block_size=4, matmul_precision="bf16")
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == alone
    assert llm.engine.runner.model.bf16_inputs
    with pytest.raises(ValueError, match="matmul_precision must be .auto. or one of"):
        LLM(tiny_model_dir, backend="cpu", matmul_precision="tf32")


@pytest.mark.parametrize("fmt", ["fp32", "fp8"])
def test_kv_cache_dtype_batches_like_alone_with_preemption_and_forks(tiny_model_dir, prompts, fmt):
    """Each KV format keeps the engine's invariants on the CPU backend: batched (chunked, preempted: blocks
    re-filled from recomputation) gives the tokens alone, n = 2 completions share then copy a block, nothing
    leaks; the cache holds the format's dtype."""
    llm = LLM(tiny_model_dir, backend="cpu", block_size=4, kv_cache_dtype=fmt)
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    small = LLM(tiny_model_dir, backend="cpu", block_size=4, kv_cache_dtype=fmt, num_kv_blocks=24,
                max_num_batched_tokens=16)
    assert tokens(small.generate(prompts, GREEDY, use_tqdm=False)) == alone
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.runner.kv.k[0].dtype == {"fp32": np.float32, "fp8": np.uint8}[fmt]
    forked = small.generate([prompts[0]], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6),
                            use_tqdm=False)[0]
    assert len(forked.outputs) == 2
    bm = small.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_kv_cache_dtype_changes_the_numbers_as_its_roundings_say(tiny_model_dir):
    """On the reference, against an fp32 cache: a bf16 cache moves the first-step logits a little, an fp8 one
    (16 times coarser steps) more; an unknown format is refused, naming the option."""
    from reference.llama import ReferenceLlama, single_sequence_batch
    from tinyvllm.config import ModelConfig
    from tinyvllm.weights import load_weights

    config = ModelConfig.from_dir(tiny_model_dir)
    model = ReferenceLlama(config, load_weights(tiny_model_dir, config))
    ids = np.random.default_rng(3).integers(0, 256, 30)
    batch = single_sequence_batch(ids, 0, np.arange(8), 4)
    logits = {fmt: model.forward(batch, model.new_kv_cache(8, 4, fmt)) for fmt in ("fp32", "bf16", "fp8")}
    bf16, fp8 = (np.abs(logits[f] - logits["fp32"]).max() for f in ("bf16", "fp8"))
    assert 0 < bf16 < fp8 < 0.5 * np.abs(logits["fp32"]).max(), (bf16, fp8)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(tiny_model_dir, backend="cpu", kv_cache_dtype="fp16")


def run_all(engine, requests):
    """Every step's outputs per request (request id -> list of (new_text, token_ids, finished))."""
    seen = {}
    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, request_id=rid)
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append((out.new_text, out.outputs[0].token_ids, out.finished,
                                                        out.outputs[0].finish_reason))
    return seen


def count_chained_launches(engine):
    launches = []
    launch = engine.runner.launch

    def counting(scheduled, chain_src=None):
        launches.append(chain_src is not None)
        return launch(scheduled, chain_src)

    engine.runner.launch = counting
    return launches


@pytest.mark.parametrize("options", [
    dict(),
    dict(max_num_seqs=2),                                     # requests wait while others decode
    dict(scheduler="static", max_num_seqs=3),
    dict(num_kv_blocks=14, max_num_batched_tokens=16),        # preemption
])
def test_async_scheduling_changes_no_output(tiny_model_dir, prompts, options):
    """Launching a decode step before the previous one's tokens are read gives the same streamed outputs,
    step by step, as waiting for them: with sequences that stop on tokens and strings (one token computed
    in vain each), end by length at different steps, wait, and are preempted."""
    sync = LLM(tiny_model_dir, backend="cpu", block_size=4, async_scheduling=False, **options).engine
    free_run = run_all(sync, {str(i): (p, GREEDY) for i, p in enumerate(prompts)})
    ids = free_run["3"][-1][1]
    text = "".join(piece for piece, *_ in free_run["1"])
    requests = {}
    for i, p in enumerate(prompts):
        params = [GREEDY, SAMPLED, SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True),
                  SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[ids[5]], ignore_eos=True),
                  SamplingParams(temperature=0, max_tokens=12, stop=[text[4:6]], ignore_eos=True),
                  SamplingParams(temperature=0.7, seed=3, max_tokens=9, min_tokens=2)][i % 6]
        requests[str(i)] = (p, params)
    want = run_all(LLM(tiny_model_dir, backend="cpu", block_size=4, async_scheduling=False, **options).engine,
                   requests)
    engine = LLM(tiny_model_dir, backend="cpu", block_size=4, **options).engine
    chained = count_chained_launches(engine)
    assert run_all(engine, requests) == want
    assert any(chained)  # the look-ahead really ran
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine._inflight is None
    assert any(r[-1][3] == "stop" for r in want.values()) and any(r[-1][3] == "length" for r in want.values())


def test_abort_while_a_step_is_in_flight(tiny_model_dir, prompts):
    engine = LLM(tiny_model_dir, backend="cpu", block_size=4).engine
    chained = count_chained_launches(engine)
    for i, p in enumerate(prompts[:3]):
        engine.add_request(p, GREEDY, request_id=str(i))
    while not any(chained):
        engine.step()
    assert engine._inflight is not None
    engine.abort("1")
    seen = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    assert "1" not in seen and all(seen[r][-1].finished for r in ("0", "2"))
    alone = LLM(tiny_model_dir, backend="cpu", block_size=4, async_scheduling=False)
    assert seen["2"][-1].outputs[0].token_ids == alone.generate([prompts[2]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_character_cut_by_max_tokens_is_held_back_from_the_text(tiny_model_dir):
    """The tiny model's tokens 0-255 are bytes. Greedy from "Yes", it writes a 3-byte character's lead byte
    and first continuation byte; max_tokens ending after either gives text without the partial character
    (not a trailing U+FFFD), while token_ids still hold every token, on both the generate and stream paths."""
    llm = LLM(tiny_model_dir, backend="cpu")
    run = llm.generate("Yes", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    ids = run.outputs[0].token_ids
    lead = next(i for i in range(len(ids) - 1) if 0xE0 <= ids[i] <= 0xEF and 0x80 <= ids[i + 1] <= 0xBF)
    whole = llm.tokenizer.decode(ids[:lead])
    assert whole and not whole.endswith("\ufffd")     # the text before the cut character ends whole
    for cut in (lead + 1, lead + 2):                  # after 1 and after 2 of the character's 3 bytes
        params = SamplingParams(temperature=0, max_tokens=cut, ignore_eos=True)
        assert llm.tokenizer.decode(ids[:cut]) == whole + "\ufffd"  # what the text was before the fix
        out = llm.generate("Yes", params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == ids[:cut] and out.text == whole
        assert "".join(llm.stream("Yes", params)) == whole


def test_progress_bar_into_a_file_or_pipe_is_not_redrawn_every_step(tiny_model_dir, capsys, monkeypatch):
    """capsys's stderr is no terminal, as a log file or a pipe: the bar is drawn when it starts and when it
    closes, not once per engine step (tqdm writes each redraw after a carriage return)."""
    llm = LLM(tiny_model_dir, backend="cpu")
    steps = []
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: steps.append(1) or step())
    monkeypatch.setattr("tinyvllm.llm.LOG_REDRAW_INTERVAL", 3600.0)   # a slow machine must not reach it
    outs = llm.generate([[1, 2, 3]] * 8, GREEDY)
    err = capsys.readouterr().err
    assert len(outs) == 8 and len(steps) >= GREEDY.max_tokens     # a redraw per step would be a dozen or more
    assert err.count("\r") == 2 and "8/8" in err.split("\r")[-1] and "tok/s" in err.split("\r")[-1]


def test_pack_pads_ragged_block_tables_with_minus_one():
    from tinyvllm.batch import pack
    from tinyvllm.scheduler import ScheduledSequence
    from tinyvllm.sequence import Sequence

    tables = [[7], [3, 9, 4, 11], [6, 8, 1], [5, 2]]
    scheduled = []
    for i, table in enumerate(tables):  # a decode step: each sequence's last token, in its last block's last slot
        seq = Sequence(str(i), list(range(1, 1 + 4 * len(table))), SamplingParams(temperature=0), 0)
        seq.block_table = list(table)
        seq.num_computed_tokens = len(seq.prompt_token_ids) - 1
        scheduled.append(ScheduledSequence(seq, 1))
    batch, _ = pack(scheduled, block_size=4)
    assert batch.block_tables.dtype == np.int32
    assert batch.block_tables.tolist() == [[7, -1, -1, -1], [3, 9, 4, 11], [6, 8, 1, -1], [5, 2, -1, -1]]
    assert batch.slot_mapping.tolist() == [t[-1] * 4 + 3 for t in tables]
