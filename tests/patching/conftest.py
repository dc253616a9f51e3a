"""Fixtures for the patching tests: a fake upstream package with its facade, and a runner for code
that installs import hooks (always in a fresh subprocess, so hooks cannot leak between tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

FAKE_FILES = {
    # An "upstream" package: checkpoint is defined in core and copied by name into the package root.
    "fakeup/__init__.py": "from . import core\nfrom .core import Helper, checkpoint, untouched\n",
    "fakeup/core.py": """
        def checkpoint(function, *args):
            return ("upstream", function(*args))

        def untouched():
            return "upstream"

        class Helper:
            origin = "upstream"

        VALUE = 1
    """,
    "fakeup/later.py": "from .core import checkpoint as ckpt\n",
    # Its facade, listing the entry points to replace when the upstream package is installed.
    "fakefacade/__init__.py": """
        ACSHIM_PATCHES = [
            ("fakeup.core", "checkpoint", "fakefacade.core.checkpoint"),
            ("fakeup.core", "Helper", "fakefacade.core.Helper"),
            ("fakeup.core", "not_in_this_version", "fakefacade.core.checkpoint"),
        ]
    """,
    "fakefacade/core.py": """
        def checkpoint(function, *args):
            return ("acshim", function(*args))

        class Helper:
            origin = "acshim"
    """,
    "fakefacade/sub/__init__.py": "",
    "fakefacade/sub/mod.py": "NAME = 'fakefacade.sub.mod'\n",
}

PRELUDE = """
import sys, importlib
from acshim.patching import Dialect, install, uninstall, is_installed
FAKE = Dialect("fake", "fakeup", "fakefacade")          # upstream installed: patched in place
GHOST = Dialect("ghost", "ghostpkg", "fakefacade")      # upstream absent: served by the facade
"""


@pytest.fixture
def fake_packages(tmp_path: Path) -> Path:
    root = tmp_path / "site"
    for name, text in FAKE_FILES.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACSHIM_", "PYTEST_"))}
    env.pop("PYTHONPATH", None)
    env.update(extra)
    return env


@pytest.fixture
def plain_env() -> dict[str, str]:
    """The test process's environment without acshim/pytest variables and PYTHONPATH."""
    return clean_env()


RunPython = Callable[..., subprocess.CompletedProcess]


@pytest.fixture
def run_python(tmp_path: Path) -> RunPython:
    """``run_python(code, path=(dirs,), env={...}, argv=[...])``: run ``code`` (dedented, after the
    PRELUDE) in a fresh interpreter; fails the test with its output if it exits non-zero unless
    ``check=False``."""

    def run(code: str, *, path: Sequence[Path] = (), env: dict[str, str] | None = None,
            check: bool = True, prelude: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        script = tmp_path / "snippet.py"
        script.write_text((PRELUDE if prelude else "") + textwrap.dedent(code))
        environment = clean_env(**(env or {}))
        if path:
            environment["PYTHONPATH"] = os.pathsep.join(str(p) for p in path)
        result = subprocess.run([sys.executable, str(script)], env=environment, cwd=tmp_path,
                                capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            pytest.fail(f"subprocess failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
        return result

    return run


@pytest.fixture
def run_acshim() -> Callable[..., subprocess.CompletedProcess]:
    """``run_acshim(*args, cwd=dir, env={...})``: ``python -m acshim args...`` in a clean environment
    (``env`` adds variables)."""

    def run(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "acshim", *args], cwd=cwd, env=clean_env(**(env or {})),
                              capture_output=True, text=True, timeout=timeout)

    return run
