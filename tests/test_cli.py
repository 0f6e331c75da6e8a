"""The command line, on the embedded default model (against HF transformers' tokens) and a tiny random one."""

import json
import os
import subprocess
import sys

import pytest

from tests_support import GOLDEN_FRANCE
from tinyvllm.cli import main


def run_cli(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN_FRANCE.read_text())


def test_cli_answers_the_capital_of_france_like_transformers(capsys, default_model_dir, golden):
    code, out, err = run_cli(capsys, "generate", golden["prompt"], "--backend", "cpu", "--max-tokens", "32")
    assert code == 0
    # the golden's text ends with <|im_end|>, the eos token, which the CLI does not print
    assert out == golden["text"].removesuffix("<|im_end|>") + "\n" == "The capital of France is Paris.\n"
    assert f"prompt tokens: {len(golden['prompt_token_ids'])}, " in err
    assert f"new tokens: {len(golden['generated_token_ids'])} (stop)" in err and "tokens/s" in err


def test_cli_runs_as_a_module_and_reads_stdin(tiny_model_dir):
    result = subprocess.run([sys.executable, "-m", "tinyvllm", "generate", "--model", str(tiny_model_dir),
                             "--no-chat", "--max-tokens", "5", "--backend", "auto"],
                            input="Hello", capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # auto takes a usable GPU (the gpu test profile) and never the simulator (the sim profile, CI's)
    on_gpu = os.environ.get("TINYVLLM_TEST_PROFILE", "sim") == "gpu"
    picked = "using the CUDA engine on " if on_gpu else "no usable GPU ("
    assert picked in result.stderr and ("using the CPU reference backend" in result.stderr) != on_gpu
    assert f"[{'cuda' if on_gpu else 'cpu'}] prompt tokens: " in result.stderr
    assert "new tokens: 5 (length)" in result.stderr


def test_chat_keeps_the_conversation(tiny_model_dir):
    result = subprocess.run([sys.executable, "-m", "tinyvllm", "chat", "--model", str(tiny_model_dir),
                             "--max-tokens", "4", "--backend", "cpu"],
                            input="Hello\nAnd again\n/exit\n", capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") == 2  # two replies, one line each


@pytest.mark.parametrize("args, message", [
    (["--temperature", "-1"], "SamplingParams.temperature must be >= 0"),
    (["--top-p", "0"], "SamplingParams.top_p must be in (0, 1]"),
    (["--max-tokens", "0"], "SamplingParams.max_tokens must be at least 1"),
    (["--block-size", "12"], "block_size must be a power of two, got 12"),
])
def test_cli_errors_are_one_clear_line(capsys, tiny_model_dir, args, message):
    code, out, err = run_cli(capsys, "generate", "hi", "--model", str(tiny_model_dir), *args)
    assert code == 1 and out == ""
    assert err.startswith("tinyvllm: error: ") and message in err and "Traceback" not in err


def test_cli_model_errors(capsys, tmp_path, tiny_model_dir):
    code, _, err = run_cli(capsys, "generate", "hi", "--model", str(tmp_path / "nope"))
    assert code == 1 and "not a directory" in err
    code, _, err = run_cli(capsys, "generate", "hi", "--model", str(tmp_path))
    assert code == 1 and "config.json: not found" in err
    code, _, err = run_cli(capsys, "generate", "x" * 3000, "--model", str(tiny_model_dir), "--no-chat")
    assert code == 1 and "the prompt has 3000 tokens, but at most 511 fit" in err


def test_help_reads_like_a_tool(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    for flag in ("--model", "--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--no-chat",
                 "--backend", "--scheduler", "--block-size", "--max-num-seqs", "examples:"):
        assert flag in text
    assert main([]) == 2
