"""tools/course.py, the course's runner: every chapter's ladder runs and each version passes its check against
reference/ (in the simulator at tiny shapes, as CI runs it; on the GPU profile at the same tiny shapes, since
timing is the runner's job, not a test's); the chapters are listed in the course's order, each with its page;
a version that computes the wrong thing is reported as failed, so a chapter's checks can fail. Chapter 12's
checks catch a kernel left out of the step and a graph whose output is not the eager step's; chapter 13's
arithmetic (tools/serving_cost.py) is checked on a small results file and on the committed run."""

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # tools/ (`python -m pytest` from the root has it already; plain pytest does not)
    sys.path.insert(0, str(REPO))

from tools import course  # noqa: E402

COURSE = REPO / "docs" / "course"


@pytest.mark.parametrize("number", [c.number for c in course.CHAPTERS])
def test_every_version_of_the_chapter_passes_its_check(number):
    report, ok = course.run(number, "tiny")
    assert ok, report
    rows = [line for line in report.splitlines()
            if line.startswith("| ") and not line.startswith(("| version", "| ---"))]
    assert rows and all("| ok |" in row for row in rows), report


def test_the_chapters_are_the_course_in_order_and_each_has_its_page():
    assert [c.number for c in course.CHAPTERS] == list(range(1, 15))
    index = (COURSE / "README.md").read_text()
    linked = re.findall(r"\]\((\d\d-[a-z0-9-]+\.md)\)", index)
    assert linked == [c.page for c in course.CHAPTERS]
    for c in course.CHAPTERS:
        page = (COURSE / c.page).read_text()
        assert page.startswith(f"# {c.number}. "), c.page
        assert f"python tools/course.py {c.number}" in page, f"{c.page} names the command that runs it"


def test_a_wrong_version_is_reported_as_failed(monkeypatch):
    """The plain warp-per-row GEMV replaced by one that writes nothing: its row fails, the others pass."""
    from cuda_kernels import gemv

    monkeypatch.setattr(gemv, "gemv_warp", lambda x, weight, out, stream=0, **kwargs: None)
    report, ok = course.run(5, "tiny")
    assert not ok
    failed = [line for line in report.splitlines() if "FAILED" in line]
    assert len(failed) == 1 and failed[0].startswith("| 2a gemv_warp |"), report


# --- chapter 12: launch overhead ------------------------------------------------------------------------------


def test_a_step_missing_a_kernel_fails_its_check(monkeypatch):
    """Every residual add but the first dropped: launches.py's count and the reference both disagree."""
    from cuda_kernels import rmsnorm
    from tools.course_ladders import launches

    steps = launches.launch_steps(False)
    monkeypatch.setattr(rmsnorm, "fused_add_rmsnorm", lambda *args, **kwargs: None)
    with pytest.raises(AssertionError, match="launches, expected"):
        steps[1].case.check()


def test_a_replay_that_differs_from_the_eager_step_in_one_bit_fails():
    """12d's output must equal the first rung's bit for bit: one ulp of difference fails it."""
    import numpy as np

    from tools.course_ladders import launches

    steps = launches.launch_steps(False)
    steps[0].case.check()
    first = steps[3].case.check.__self__.first
    first["out"] = np.nextafter(first["out"], np.float32(np.inf))
    with pytest.raises(AssertionError, match="bit for bit"):
        steps[3].case.check()


def test_pdl_is_switched_for_a_capture_and_restored(monkeypatch):
    from cuda_kernels import launch
    from tools.course_ladders.launches import _pdl

    monkeypatch.setenv("TINYVLLM_PDL", "1")
    with _pdl(False):
        assert os.environ["TINYVLLM_PDL"] == "0" and not launch.pdl_enabled()
    assert os.environ["TINYVLLM_PDL"] == "1"
    monkeypatch.delenv("TINYVLLM_PDL")
    with _pdl(True):
        assert os.environ["TINYVLLM_PDL"] == "1"
    assert "TINYVLLM_PDL" not in os.environ


# --- chapter 13: serving economics ---------------------------------------------------------------------------

# A results file in tools/bench.py's layout, with round numbers: at $3.60 an hour a second costs $0.001
SMALL_RESULTS = {
    "device": "a test card", "date": "2026-12-06", "command": "python3 tools/bench.py goals",
    "tinyvllm": {
        "latency": {"prompt_tokens": 128, "new_tokens": 256, "decode_tok_s": 1000.0, "runs_decode_tok_s": [1000.0]},
        "step": {"context": 256, "batches": {"1": {"step_s": 0.001, "ratio": 1.0},
                                             "64": {"step_s": 0.0025, "ratio": 2.5}}},
        "static": {"64": {"requests": 64, "prompt_tokens": 8192, "output_tokens": 16384, "elapsed_s": 0.8192,
                          "output_tok_s": 20000.0}},
        "throughput": {"continuous": {"requests": 256, "output_tokens": 100000, "elapsed_s": 4.0,
                                      "output_tok_s": 25000.0}},
    },
    "torch_peer": {"static": {"64": {"new_tokens": 256, "elapsed_s": 2.048, "output_tok_s": 8000.0}}},
}


def test_cost_per_million_tokens_is_the_price_of_a_second_over_its_tokens():
    from tools.serving_cost import cost_per_million_tokens

    assert cost_per_million_tokens(3.60, 1000.0) == pytest.approx(1.0)        # $0.001 a second / 1,000 tokens
    assert cost_per_million_tokens(2.50, 31324.086835331695) == pytest.approx(0.0221695, rel=1e-5)


def test_serving_points_of_a_small_results_file():
    from tools.serving_cost import serving_points, table

    points = {(p.engine, p.workload, p.batch): p for p in serving_points(SMALL_RESULTS)}
    step64 = points["tinyvllm", "decode step", 64]
    assert step64.tokens_per_s == pytest.approx(25600.0) and step64.seconds_per_token == 0.0025
    assert step64.usd_per_million(3.60) == pytest.approx(0.0390625)
    static = points["tinyvllm", "static", 64]
    assert static.seconds_per_token == pytest.approx(0.0032)          # 0.8192 s / 256 tokens of each sequence
    assert static.usd_per_million(3.60) == pytest.approx(0.05)
    assert points["tinyvllm", "latency", 1].usd_per_million(3.60) == pytest.approx(1.0)
    assert points["tinyvllm", "throughput", 256].seconds_per_token is None
    peer = points["PyTorch compiled (peer)", "static", 64]
    assert peer.seconds_per_token == pytest.approx(0.008) and peer.usd_per_million(3.60) == pytest.approx(0.125)
    rows = table(list(points.values()), 3.60).splitlines()
    assert "$ per 1M output tokens at $3.60/h" in rows[0]
    assert "| tinyvllm | decode step (context 256) | 64 | 25,600 | 2.50 | 0.039 |" in rows


def test_a_results_file_that_contradicts_itself_is_refused():
    from tools.serving_cost import serving_points

    bad = json.loads(json.dumps(SMALL_RESULTS))
    bad["tinyvllm"]["static"]["64"]["output_tok_s"] = 30000.0   # 16,384 tokens in 0.8192 s are 20,000 a second
    with pytest.raises(ValueError, match="output_tok_s"):
        serving_points(bad)


def test_the_committed_run_at_the_default_price(tmp_path, capsys):
    """The committed H100 run: 892 tokens/s at batch 1 cost $0.78 per million at $2.50 an hour, 50,186 at
    static batch 256 $0.014; the plot is written where matplotlib is installed, else the tool says why."""
    from tools import serving_cost

    assert serving_cost.main(["--plot", str(tmp_path / "cost.png")]) == 0
    out = capsys.readouterr()
    assert "| tinyvllm | latency (prompt 128, 256 new) | 1 | 892 | 1.12 | 0.779 |" in out.out
    assert "| tinyvllm | static (prompt 128, 256 new, prefill included) | 256 | 50,186 | 5.10 | 0.014 |" in out.out
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "cost.png").stat().st_size > 10_000
    else:
        assert "matplotlib is not installed" in out.err and not (tmp_path / "cost.png").exists()
