"""tools/course.py, the course's runner: every chapter's ladder runs and each version passes its check against
reference/ (in the simulator at tiny shapes, as CI runs it; on the GPU profile at the same tiny shapes, since
timing is the runner's job, not a test's); the chapters are listed in the course's order, each with its page;
a version that computes the wrong thing is reported as failed, so a chapter's checks can fail."""

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
    assert [c.number for c in course.CHAPTERS] == list(range(1, 12))
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
