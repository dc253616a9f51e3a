"""Shared pytest setup, and the compat-matrix guard.

The guard records every test's outcome; at the end of the session, a row of compat_matrix/*.toml
that claims same/better/partial while a test it names failed or was skipped in this run fails the
session (exit code 1) with a message naming the row. Rows whose tests did not run are not judged; a
test skipped with a reason starting "absent upstream:" (the installed upstream version has no such
API) counts as not run.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

# The suite checks this checkout's matrix, also when acshim is imported from an installed wheel.
os.environ.setdefault("ACSHIM_COMPAT_DIR", str(Path(__file__).resolve().parent.parent / "compat_matrix"))

# One pytest session per process: its test outcomes (node id -> passed/failed/skipped) and the
# rows found over-claiming at the end.
_session: dict[str, dict | list] = {"outcomes": {}, "overclaims": []}


def pytest_configure(config: pytest.Config) -> None:
    _session["outcomes"], _session["overclaims"] = {}, []
    if not hasattr(config, "workerinput") and "TORCH_EXTENSIONS_DIR" not in os.environ:
        # This session's own cache for compiled extensions (acshim's, DeepSpeed's shm op), inherited
        # by xdist workers and test subprocesses: a build another run left half-done (its baton
        # file, on which torch waits forever) cannot stall this one.
        os.environ["TORCH_EXTENSIONS_DIR"] = _session["extensions"] = tempfile.mkdtemp(
            prefix="acshim-tests-extensions-")
    if int(getattr(config, "workerinput", {}).get("workercount", 1)) > 1:
        # Several xdist workers share the cores: torch's intra-op pool, one thread per core in each
        # worker and in each process a test starts, oversubscribes them, and OpenMP's spin-waiting
        # then more than doubles the time of CPU-bound tests (84 engine tests on 2 cores with 2
        # workers: 21 s, against 9.5 s with one thread each). Each worker and the processes it starts
        # run one intra-op thread (most subprocess tests set OMP_NUM_THREADS=1 themselves already);
        # a value the caller set is kept, and a test may still set its own for its subprocess.
        import torch

        torch.set_num_threads(1)
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under several xdist workers, leave out the tests marked ``exclusive``: they measure timing
    under a load they set themselves (idle, then one core kept busy), which another worker's tests
    would change. They run alone after the parallel run (README's test command: ``pytest -m
    exclusive``). Deselected, not skipped: a skip would count against the compat rows naming them."""
    if int(getattr(config, "workerinput", {}).get("workercount", 1)) <= 1:
        return
    exclusive = [item for item in items if item.get_closest_marker("exclusive")]
    if exclusive:
        config.hook.pytest_deselected(items=exclusive)
        items[:] = [item for item in items if not item.get_closest_marker("exclusive")]


def pytest_unconfigure(config: pytest.Config) -> None:
    directory = _session.pop("extensions", None)
    if directory:
        shutil.rmtree(directory, ignore_errors=True)
        os.environ.pop("TORCH_EXTENSIONS_DIR", None)


# A skip whose reason starts with this says the installed upstream version lacks the very API the
# test exercises (e.g. transformers 4.x has no activation_checkpointing_enable): the test did not
# run in this session, so the rows naming it are not judged by it. Use it for nothing else.
ABSENT_UPSTREAM = "absent upstream:"


def _absent_upstream(report: pytest.TestReport) -> bool:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr or "")
    return reason.removeprefix("Skipped: ").startswith(ABSENT_UPSTREAM)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # A test is as good as its worst phase: a failing teardown fails a passed call.
    if report.skipped and _absent_upstream(report):
        return
    if report.failed:
        outcome = "failed"
    elif report.skipped:
        outcome = "skipped"
    elif report.when == "call":
        outcome = "passed"
    else:
        return
    outcomes = _session["outcomes"]
    if outcomes.get(report.nodeid) in ("failed", "skipped") and outcome == "passed":
        return
    outcomes[report.nodeid] = outcome


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    outcomes = _session["outcomes"]
    if not outcomes or hasattr(session.config, "workerinput"):
        return  # under pytest-xdist the controller, which sees every worker's reports, judges
    from acshim import compat

    try:
        rows = compat.load_rows()
    except FileNotFoundError:
        return  # no matrix next to this checkout: nothing to judge
    except compat.CompatError as error:
        messages = [f"compat matrix is invalid: {error}"]
    else:
        messages = compat.overclaims(rows, outcomes)
    if messages:
        _session["overclaims"] = messages
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    messages = _session["overclaims"]
    if messages:
        terminalreporter.section("compat matrix claims more than its tests show", red=True)
        for message in messages:
            terminalreporter.line(message, red=True)
        terminalreporter.line("fix the test, or lower the row's status in compat_matrix/ (then acshim compat --write)")


@pytest.fixture(autouse=True)
def _torchs_cpu_allocator_after_each_test():
    """``acshim.plan`` leaves acshim's CPU allocator installed where it returns a plan (the steps
    after it run the plan on it): each test starts and ends on torch's own."""
    yield
    from acshim import host_allocator

    if host_allocator.installed():
        host_allocator.uninstall()
