"""tinyvllm/warmup.py: after the engine reports ready, no step compiles a kernel or captures a graph.

In the simulator the CUDA engine runs the tiny model with small limits, so that the warm-up walks every
class of shapes quickly; kernels count by signature there (cuda_kernels.launch.prepared), graphs do not
exist. On a GPU the same holds on the Llama-3.2-1B-shaped model, graphs included (tests/test_cuda_engine.py
uses the warmed engine's counters too)."""

import numpy as np
import pytest

from cuda_kernels import launch
from tests_support import LLAMA_1B_MATMULS
from tinyvllm import LLM, SamplingParams, cuda_graph
from tinyvllm.warmup import token_counts


def test_token_counts_cover_every_class_of_the_matmul_policies():
    assert token_counts(8192)[:12] == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128]
    assert token_counts(8192)[12:14] == [192, 256] and token_counts(8192)[-1] == 8192
    assert token_counts(5) == [1, 2, 3, 4, 5] and token_counts(100) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 100]


def gpu_matmul_kernel(mp, m, n, k, gated):
    """What decides the kernel a GPU engine's matmul compiles for x (m, k) @ W (n, k)^T, bf16 inputs, planes and
    split workspaces given: the family and its compile-time configuration (a split count is a launch argument,
    not a kernel: only whether K is split counts)."""
    if mp.uses_gemv(m, n):
        return "gemv", mp.gemv_config(m, n, k)
    if mp.uses_gemv_tc(m, n, k, True):
        return "gemv_tc", mp.gemv_tc_config(m, n, k)
    plan = mp.wgmma_plan(m, n, k, True, split_workspace=())
    if plan and mp.uses_tma(m):
        tile, splits = mp.tma_plan(m, n, k)
        return "gemm_tma", tile, splits > 1
    if plan:
        return "gemm_wgmma", plan[0], plan[1] > 1
    tile, splits = mp.pipelined_plan(m, n, k, True, gated, split_workspace=())
    return "gemm_pipelined", tile, splits > 1


@pytest.mark.parametrize("tma_decode", [False, True], ids=["tma-prefill", "tma-decode-too"])
def test_every_row_count_takes_the_kernels_of_its_warm_up_class(monkeypatch, tma_decode):
    """The warm-up compiles one representative M per class (token_counts); every other M of the class must take
    the same kernels, or a request would compile one after ready. Checked for the 1B model's weights with the
    matmul policies of an H100 or H200 (gemv, gemv_tc, gemm_pipelined's skinny plans and tiles, gemm_wgmma's
    split plans and tiles, gemm_tma's tiles and, with TMA_DECODE_IN_ENGINE, its split plans), which this
    machine's simulator settings would otherwise hide."""
    from cuda_kernels import matmul_policy as mp
    from cuda_kernels import wgmma

    for name, value in [("SIMULATOR", False), ("GEMV_MAX_M", 8), ("GEMV_WIDE_MAX_M", 4), ("GEMV_TC_IN_ENGINE", True),
                        ("WGMMA_IN_ENGINE", True), ("WGMMA_SPLIT_IN_ENGINE", True), ("TMA_IN_ENGINE", True),
                        ("TMA_DECODE_IN_ENGINE", tma_decode)]:
        monkeypatch.setattr(mp, name, value)
    monkeypatch.setattr(wgmma, "device_has_wgmma", lambda: True)
    limit = 2048
    classes = token_counts(limit)
    seen = set()
    for m in range(1, limit + 1):
        representative = min(c for c in classes if c >= m)
        for n, k, gated in LLAMA_1B_MATMULS:
            kernel = gpu_matmul_kernel(mp, m, n, k, gated)
            assert kernel == gpu_matmul_kernel(mp, representative, n, k, gated), (m, representative, n, k)
            seen.add(kernel[0])
    assert seen == {"gemv", "gemv_tc", "gemm_pipelined", "gemm_tma"} | (set() if tma_decode else {"gemm_wgmma"})


def test_no_kernel_is_prepared_after_the_warm_up(tiny_model_dir):
    llm = LLM(tiny_model_dir, backend="cuda", block_size=4, max_num_seqs=3, max_num_batched_tokens=8,
              num_kv_blocks=24, warmup=True, matmul_precision="fp32")
    ready_kernels, ready_graphs = launch.prepared(), cuda_graph.captures()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in (1, 7, 13)]   # chunked: the budget is 8 tokens
    # NOTE: each simulated step costs seconds, so no request decodes further than it takes to meet its last
    # new step shape: a third token of the logprobs row, or of the prompt alone, repeated the second's
    # decode step (same tokens, rows, block-table width and sampling mode: the same kernel signatures)
    params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=2)]
    llm.generate(prompts, params, use_tqdm=False)        # one batch: greedy, sampled and logprobs rows
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                 use_tqdm=False)                          # alone: batch 1, a prefill and a chained decode
    # prompt logprobs of 13 rows: the LM head over them 3 rows (max_num_seqs) at a time, the last chunk of 1
    llm.generate(prompts[2:], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    # two completions of one prompt share its blocks and copy the partly filled one on first write
    llm.generate(prompts[1:2], SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=2, ignore_eos=True),
                 use_tqdm=False)
    assert launch.prepared() == ready_kernels
    assert cuda_graph.captures() == ready_graphs
