"""The command line, on the embedded default model (against HF transformers' tokens) and a tiny random one."""

import io
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


def test_kv_cache_dtype_flag_reaches_the_engine(capsys, tiny_model_dir, monkeypatch):
    """--kv-cache-dtype (generate, chat and serve share the engine options) picks the cache's format;
    argparse refuses a format it does not know, naming the flag."""
    import tinyvllm.llm

    formats = []
    real = tinyvllm.llm.LLMEngine.from_options

    def recording(model=None, **options):
        formats.append(options["kv_cache_dtype"])
        return real(model, **options)

    monkeypatch.setattr(tinyvllm.llm.LLMEngine, "from_options", staticmethod(recording))
    code, out, _ = run_cli(capsys, "generate", "hi", "--model", str(tiny_model_dir), "--backend", "cpu",
                           "--max-tokens", "2", "--kv-cache-dtype", "fp8")
    assert code == 0 and formats == ["fp8"]
    with pytest.raises(SystemExit):
        main(["generate", "hi", "--kv-cache-dtype", "fp16"])
    assert "--kv-cache-dtype: invalid choice: 'fp16'" in capsys.readouterr().err
    for command in ("chat", "serve"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--kv-cache-dtype" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--temperature", "-1"], "--temperature must be >= 0 (0 means greedy), got -1.0"),
    (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["--top-k", "-2"], "--top-k must be -1 or 0 (off) or a positive integer, got -2"),
    (["--max-tokens", "0"], "--max-tokens must be at least 1, got 0"),
    (["--block-size", "12"], "--block-size must be a power of two, got 12"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be at least 1, got 0"),
])
def test_cli_errors_are_one_clear_line_naming_the_flag(capsys, tiny_model_dir, args, message):
    code, out, err = run_cli(capsys, "generate", "hi", "--model", str(tiny_model_dir), *args)
    assert code == 1 and out == ""
    assert err == f"tinyvllm: error: {message}\n"   # the flag typed, not a Python field or a hidden option


@pytest.mark.parametrize("at_a_terminal", [True, False])
def test_generate_says_it_reads_stdin_only_at_a_terminal(capsys, monkeypatch, tiny_model_dir, at_a_terminal):
    class Stdin(io.StringIO):
        def isatty(self):
            return at_a_terminal

    monkeypatch.setattr(sys, "stdin", Stdin("Hello"))
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--backend", "cpu", "--no-chat",
                             "--max-tokens", "3")
    assert code == 0 and "new tokens: 3 (length)" in err
    hint = "tinyvllm: reading the prompt from stdin; end it with Ctrl-D (or pass it as an argument)\n"
    assert err.startswith(hint) == at_a_terminal and (hint in err) == at_a_terminal


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
