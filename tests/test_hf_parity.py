"""Where torch and transformers are installed (never tinyvllm dependencies; skipped otherwise): greedy decoding
with repetition_penalty gives Hugging Face generate(repetition_penalty=...)'s tokens on a random tiny Llama.
tests/test_sampling_features.py checks the same on the default model against a golden that
tools/make_goldens.py recorded from transformers, without needing either."""

import numpy as np
import pytest

from tinyvllm import LLM, SamplingParams

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TIE = 2 ** -6   # a top-2 gap below this may flip with the bf16 KV cache (transformers keeps K and V in fp32)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("length, penalty", [(5, 1.3), (5, 2.0), (5, 0.8), (12, 1.3), (12, 2.0), (30, 1.3),
                                             (30, 2.0), (30, 0.8)])
def test_greedy_repetition_penalty_equals_transformers(tiny_model_dir, hf_model, length, penalty):
    """Up to the first step where transformers' own processed logits have their two largest within TIE (the
    prompts were picked to give at least 8 tokens before one), the tokens are the same; and the penalty decides
    some of them (plain greedy differs)."""
    prompt = np.random.default_rng(length).integers(0, 256, length).tolist()
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, length, dtype=torch.long),
                                max_new_tokens=24, do_sample=False, repetition_penalty=penalty, eos_token_id=None,
                                pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    want = out.sequences[0, length:].tolist()
    gaps = [float(top[0] - top[1]) for top in (torch.topk(scores[0], 2).values for scores in out.scores)]
    limit = next((k for k, gap in enumerate(gaps) if gap < TIE), len(gaps))
    assert limit >= 8, gaps
    llm = LLM(tiny_model_dir, backend="cpu", matmul_precision="fp32")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=penalty)
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got[:limit] == want[:limit]
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert plain[0].outputs[0].token_ids[:limit] != want[:limit]
