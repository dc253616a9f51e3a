"""Launch real ranks: torchrun (or another launcher) in a subprocess, gloo on loopback, a
timeout that kills the whole process group, and each rank's ``RESULT {json}`` line parsed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent / "scripts"
ACSHIM = str(Path(sys.executable).with_name("acshim"))
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


@dataclass
class Launch:
    returncode: int
    stdout: str
    stderr: str

    @property
    def results(self) -> list[dict]:
        """One dict per rank, ordered by rank. Ranks share stdout and ``print("RESULT", json)`` writes
        its parts separately, so two ranks' lines can interleave ("RESULTRESULT {...} {...}", seen
        in CI): every JSON object with a ``rank`` after the first ``RESULT`` is one."""
        decoder = json.JSONDecoder()
        text, found = self.stdout, []
        position = text.find("RESULT")
        while position >= 0:
            start = text.find("{", position)
            if start < 0:
                break
            try:
                value, position = decoder.raw_decode(text, start)
            except json.JSONDecodeError:
                position = start + 1
                continue
            if isinstance(value, dict) and "rank" in value:
                found.append(value)
        return sorted(found, key=lambda result: result["rank"])

    def region_counts(self) -> list[str]:
        """The ``acshim: N region forwards, M recomputes`` lines (one per patched rank)."""
        # ranks share the launcher's stderr: their lines may run together, so match, not split
        return re.findall(r"acshim: \d+ region forwards, \d+ recomputes", self.stderr)


def _launch(command: Sequence[str], timeout: float = 150, env: dict[str, str] | None = None,
            cwd: str | None = None) -> Launch:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "ACSHIM_REPORT_REGIONS": "1", **(env or {})}
    # Its own session: on a timeout the launcher and every rank it started are killed together.
    process = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=environment, cwd=cwd, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"launch timed out after {timeout}s: {' '.join(command)}\n{stderr[-3000:]}")
    return Launch(process.returncode, stdout, stderr)


@pytest.fixture(scope="session")  # a function: module-scoped fixtures may launch too
def launch() -> Callable[..., Launch]:
    """``launch(command, timeout=..., env=..., cwd=...)`` runs a launcher command to completion."""
    return _launch


def _torchrun_command(*args: str, nproc: int = 2) -> list[str]:
    return [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", *args]


@pytest.fixture(scope="session")
def torchrun() -> Callable[..., list[str]]:
    """``torchrun(*args, nproc=2)``: the torchrun command on this machine's loopback with a free
    port (``--standalone`` picks one)."""
    return _torchrun_command
