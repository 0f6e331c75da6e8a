"""The command line's sampling flags beyond temperature / top-k / top-p / min-p (--min-tokens,
--repetition-penalty, --presence-penalty, --frequency-penalty, --logprobs, --n) on the tiny random model: what
they print is what LLM.generate gives for the same SamplingParams."""

import re

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.cli import main


def run_cli(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_penalties_and_logprobs_flags(capsys, tiny_model_dir):
    args = ["generate", "Hello", "--model", str(tiny_model_dir), "--backend", "cpu", "--no-chat", "--max-tokens", "6",
            "--repetition-penalty", "1.5", "--presence-penalty", "0.5", "--frequency-penalty", "-0.5",
            "--min-tokens", "3", "--logprobs", "2"]
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    params = SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.5, presence_penalty=0.5,
                            frequency_penalty=-0.5, min_tokens=3, logprobs=2)
    want = LLM(tiny_model_dir, backend="cpu").generate(["Hello"], params, use_tqdm=False)[0].outputs[0]
    assert out == want.text + "\n"
    lines = err[err.index("logprobs:\n"):].splitlines()[1:1 + len(want.token_ids)]
    assert len(lines) == len(want.token_ids) == 6
    for entry, token, line in zip(want.logprobs, want.token_ids, lines):  # the chosen token's value and rank
        assert f"{entry[token].logprob:9.4f}  rank {entry[token].rank}" in line


def test_n_prints_every_completion(capsys, tiny_model_dir):
    code, out, err = run_cli(capsys, "generate", "Hello", "--model", str(tiny_model_dir), "--backend", "cpu",
                             "--no-chat", "--max-tokens", "5", "--n", "3", "--temperature", "0.9", "--seed", "4")
    assert code == 0, err
    params = SamplingParams(n=3, temperature=0.9, seed=4, max_tokens=5)
    want = LLM(tiny_model_dir, backend="cpu").generate(["Hello"], params, use_tqdm=False)[0]
    assert out == "".join(f"--- completion {c.index + 1} of 3 ({c.finish_reason}) ---\n{c.text}\n"
                          for c in want.outputs)


@pytest.mark.parametrize("args, name, problem", [
    (["--presence-penalty", "3"], "presence-penalty", "must be in [-2, 2]"),
    (["--frequency-penalty", "-2.5"], "frequency-penalty", "must be in [-2, 2]"),
    (["--repetition-penalty", "0"], "repetition-penalty", "must be > 0"),
    (["--n", "0"], "n", "must be at least 1"),
    (["--logprobs", "21"], "logprobs", "must be None or in [0, 20]"),
    (["--min-tokens", "9", "--max-tokens", "4"], "min-tokens", "must be in [0, "),
])
def test_bad_values_are_refused_by_name(capsys, tiny_model_dir, args, name, problem):
    code, _, err = run_cli(capsys, "generate", "Hi", "--model", str(tiny_model_dir), "--backend", "cpu", *args)
    assert code == 1
    # the flag, or the parameter's Python name (the CLI words messages in flags where it can)
    assert re.search(rf"(--{name}|SamplingParams\.{name.replace('-', '_')}) {re.escape(problem)}", err), err


def test_chat_refuses_n(capsys, tiny_model_dir):
    code, _, err = run_cli(capsys, "chat", "--model", str(tiny_model_dir), "--backend", "cpu", "--n", "2")
    assert code == 1 and "--n above 1 works with generate" in err
