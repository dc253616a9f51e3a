"""README.md's code is run as written: every ``python`` snippet in a fresh interpreter, every
``acshim run`` / ``acshim plan`` line on the README's ``# train.py`` snippet, the set-up's
``acshim demo``; the two test commands are where ``.ci/run`` reads them; every link between README.md
and docs/*.md lands on a file and a heading that exist; every docs page is reachable from README.

A snippet that cannot run here (more than one process, a GPU) is skipped by a
``<!-- readme-test: skip REASON -->`` comment on the line before its fence, and the skip names REASON.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
TIMEOUT_SECONDS = 300
SKIP_MARKER = re.compile(r"<!-- readme-test: skip (.+?) -->")


class Snippet(NamedTuple):
    language: str
    code: str
    line: int  # 1-based line of the opening fence
    skip_reason: str | None


def snippets(text: str) -> list[Snippet]:
    """The fenced code blocks of a Markdown text, with the skip reason the line before may give."""
    found, lines, index = [], text.split("\n"), 0
    while index < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[index])
        if not fence:
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
        skip = SKIP_MARKER.search(lines[index - 1]) if index else None
        found.append(Snippet(fence.group(1), "\n".join(lines[index + 1:end]) + "\n", index + 1,
                             skip.group(1) if skip else None))
        index = end + 1
    return found


README_SNIPPETS = snippets(README.read_text(encoding="utf-8"))
PYTHON_SNIPPETS = [s for s in README_SNIPPETS if s.language == "python"]
SHELL_LINES = [line.split("#", 1)[0].strip() for s in README_SNIPPETS if s.language == "bash"
               for line in s.code.splitlines()]


def _run(argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_SECONDS,
                          env={**os.environ, **env})


def _acshim_argv(command: str) -> list[str]:
    """``acshim ...`` as this interpreter runs it (the tree under test, not an installed script)."""
    words = shlex.split(command)
    assert words[0] == "acshim", command
    return [sys.executable, "-m", "acshim", *words[1:]]


def test_readme_has_python_snippets_and_one_train_script() -> None:
    assert len(PYTHON_SNIPPETS) >= 2
    assert sum(s.code.startswith("# train.py") for s in PYTHON_SNIPPETS) == 1


@pytest.mark.parametrize("snippet", PYTHON_SNIPPETS, ids=lambda s: f"README.md:{s.line}")
def test_every_python_snippet_in_the_readme_runs(snippet: Snippet, tmp_path: Path) -> None:
    if snippet.skip_reason:
        pytest.skip(f"README.md:{snippet.line}: {snippet.skip_reason}")
    result = _run([sys.executable, "-c", snippet.code], tmp_path)
    assert result.returncode == 0, f"README.md:{snippet.line} failed:\n{result.stdout}{result.stderr}"


def _train_script(tmp_path: Path) -> Path:
    (train,) = (s for s in PYTHON_SNIPPETS if s.code.startswith("# train.py"))
    path = tmp_path / "train.py"
    path.write_text(train.code, encoding="utf-8")
    return path


ACSHIM_ON_TRAIN = [line for line in SHELL_LINES if re.match(r"acshim (run|plan)\b.*\btrain\.py$", line)]


def test_readme_shows_acshim_run_report_and_budget_on_train_py() -> None:
    flags = {word for line in ACSHIM_ON_TRAIN for word in shlex.split(line)}
    assert {"run", "plan", "--report", "--budget"} <= flags, ACSHIM_ON_TRAIN


@pytest.mark.parametrize("command", ACSHIM_ON_TRAIN)
def test_every_acshim_line_in_the_readme_runs_on_its_train_script(command: str, tmp_path: Path) -> None:
    _train_script(tmp_path)
    result = _run(_acshim_argv(command), tmp_path, ACSHIM_REPORT_REGIONS="1")
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{command}:\n{output}"
    words = shlex.split(command)
    if words[1] == "run" and "--budget" not in words:  # the script's 8 wrappers, 4 steps: all on the engine
        assert "acshim: 32 region forwards, 32 recomputes" in output, output
    if "--report" in words:  # the report lists the script's regions under the API that made them
        assert re.search(r"torch checkpoint_wrapper +8 region\(s\), 32 forwards, 32 recomputes", output), output
    if words[1] == "run" and "--budget" in words:  # the script's own recipe replaced by a plan
        assert re.search(r"replaced 8 region\(s\) \(8 torch checkpoint_wrapper: recompute\) by the plan", output), output
    if words[1] == "plan":
        assert "acshim plan: budget" in result.stdout, output


def test_the_set_up_demo_runs_and_confirms_identical_gradients(tmp_path: Path) -> None:
    (demo,) = (line for line in SHELL_LINES if line.endswith("acshim demo"))
    result = _run(_acshim_argv(demo.rsplit("&&", 1)[1].strip()), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "bitwise identical to the run without checkpointing: yes" in result.stdout


@pytest.mark.parametrize("marker", ["ci:test-command", "ci:test-command-hf4"])
def test_ci_reads_each_test_command_from_the_readme(marker: str) -> None:
    """``.ci/run``'s own ``readme_command`` finds an install-then-pytest line after each marker."""
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    function = re.search(r"^readme_command\(\) \{.*?^\}", ci, re.S | re.M)
    assert function, ".ci/run no longer defines readme_command"
    result = subprocess.run(["bash", "-c", f"{function.group(0)}\nreadme_command {marker}"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    command = result.stdout.strip()
    assert result.returncode == 0 and command.startswith("pip install torch==2.13.0 && "), result
    assert re.search(r"&& pytest -n 2\b", command), command


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_link_to_a_heading_lands_on_one(page: Path) -> None:
    for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text(encoding="utf-8")):
        if "://" in target:
            continue
        linked = (page.parent / target).resolve() if target else page
        assert linked.exists(), f"{page.name} links to {target}, which is not in the repository"
        assert anchor in _anchors(linked), f"{page.name} links to {target}#{anchor}: no such heading"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = set(re.findall(r"\]\(docs/([^)#\s]+\.md)", README.read_text(encoding="utf-8")))
    pages = {p.name for p in (REPO / "docs").glob("*.md")}
    assert pages - linked == set(), f"docs pages README.md does not link: {sorted(pages - linked)}"
