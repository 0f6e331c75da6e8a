"""tools/course.py, the course's runner: every chapter's ladder runs and each version passes its check against
reference/ (in the simulator at tiny shapes, as CI runs it; on the GPU profile at the same tiny shapes, since
timing is the runner's job, not a test's); the chapters are listed in the course's order, each with its page;
a version that computes the wrong thing is reported as failed, so a chapter's checks can fail. Chapter 12's
checks catch a kernel left out of the step and a graph whose output is not the eager step's."""

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
    assert [c.number for c in course.CHAPTERS] == list(range(1, 13))
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
