"""The command line and the CPU generation loop, on the embedded default model and on a tiny random one."""

import json
import subprocess
import sys

import pytest

from tests_support import GOLDEN_FRANCE
from tinyvllm.cli import main
from tinyvllm.generate import CPUGenerator, GenerationStats, PromptTooLongError
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.tokenizer import Tokenizer


def run_cli(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN_FRANCE.read_text())


@pytest.fixture(scope="module")
def default_generator(default_model_dir):
    return CPUGenerator(default_model_dir, Tokenizer.from_dir(default_model_dir))


def test_default_model_greedy_tokens_equal_transformers(default_generator, golden):
    tokenizer = default_generator.tokenizer
    prompt_ids = tokenizer.encode_chat(golden["messages"])
    assert prompt_ids == golden["prompt_token_ids"]
    stats = GenerationStats()
    text = "".join(default_generator.stream(prompt_ids, SamplingParams(temperature=0, max_tokens=32), stats))
    assert stats.token_ids == golden["generated_token_ids"]
    assert text == "The capital of France is Paris." and stats.finish_reason == "stop"


def test_cli_answers_the_capital_of_france(capsys, default_model_dir):
    code, out, err = run_cli(capsys, "generate", "What is the capital of France?", "--backend", "cpu")
    assert code == 0
    assert out == "The capital of France is Paris.\n"
    assert "[cpu] prompt tokens: 37, new tokens: 8 (stop)" in err and "tokens/s" in err


def test_cli_runs_as_a_console_script_and_reads_stdin(tiny_model_dir):
    result = subprocess.run([sys.executable, "-m", "tinyvllm", "generate", "--model", str(tiny_model_dir),
                             "--no-chat", "--max-tokens", "5", "--backend", "auto"],
                            input="Hello", capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "using the CPU reference backend" in result.stderr
    assert "new tokens: 5 (length)" in result.stderr


def test_sampling_is_reproducible_with_a_seed(tiny_model_dir):
    generator = CPUGenerator(tiny_model_dir, Tokenizer.from_dir(tiny_model_dir))
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=12, ignore_eos=True)
    runs = []
    for _ in range(2):
        stats = GenerationStats()
        list(generator.stream([256, 72, 105], params, stats))
        runs.append(stats.token_ids)
    assert runs[0] == runs[1] and len(runs[0]) == 12
    other = GenerationStats()
    list(generator.stream([256, 72, 105], SamplingParams(temperature=1.0, seed=8, max_tokens=12, ignore_eos=True),
                          other))
    assert other.token_ids != runs[0]


def test_stop_strings_cut_the_text(tiny_model_dir):
    generator = CPUGenerator(tiny_model_dir, Tokenizer.from_dir(tiny_model_dir))
    stats = GenerationStats()
    full = "".join(generator.stream([256, 72], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), stats))
    stop = full[3:5]
    assert len(stop) == 2
    stats2 = GenerationStats()
    cut = "".join(generator.stream([256, 72], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                            stop=[stop]), stats2))
    assert cut == full[: full.index(stop)] and stats2.finish_reason == "stop"


def test_prompt_longer_than_the_context_is_refused(tiny_model_dir):
    generator = CPUGenerator(tiny_model_dir, Tokenizer.from_dir(tiny_model_dir))
    with pytest.raises(PromptTooLongError, match="the prompt has 600 tokens; the model's context"):
        list(generator.stream([65] * 600, SamplingParams(), GenerationStats()))


@pytest.mark.parametrize("args, message", [
    (["--temperature", "-1"], "SamplingParams.temperature must be >= 0"),
    (["--top-p", "0"], "SamplingParams.top_p must be in (0, 1]"),
    (["--max-tokens", "0"], "SamplingParams.max_tokens must be at least 1"),
    (["--backend", "cuda"], "--backend cuda:"),
])
def test_cli_errors_are_one_clear_line(capsys, tiny_model_dir, args, message):
    code, out, err = run_cli(capsys, "generate", "hi", "--model", str(tiny_model_dir), *args)
    assert code == 1 and out == ""
    assert err.startswith("tinyvllm: error: ") and message in err and "Traceback" not in err


def test_cli_model_errors(capsys, tmp_path):
    code, _, err = run_cli(capsys, "generate", "hi", "--model", str(tmp_path / "nope"))
    assert code == 1 and "not a directory" in err
    code, _, err = run_cli(capsys, "generate", "hi", "--model", str(tmp_path))
    assert code == 1 and "tokenizer.json" in err


def test_help_reads_like_a_tool(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    for flag in ("--model", "--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--no-chat",
                 "--backend", "examples:"):
        assert flag in text
    assert main([]) == 2
