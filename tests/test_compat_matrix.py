"""The compat matrix is evidence: every row names a real test, every public facade name has a row,
the generated README is current, and bad rows are rejected with the file and row named."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import subprocess
import sys
import textwrap
import types
from functools import cache
from pathlib import Path

import pytest

import acshim.facades
from acshim import compat
from acshim.patching.dialects import DIALECTS

REPO = Path(__file__).resolve().parent.parent
PROTOCOL_NAMES = {"ACSHIM_PATCHES"}  # read by acshim.patching, not an upstream name


# --------------------------------------------------------------------------------------------------
# helpers


@cache
def _test_names(path: Path) -> frozenset[str]:
    """``name`` and ``Class::name`` for every test function/class defined in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names.update(f"{node.name}::{item.name}" for item in node.body
                             if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef))
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return frozenset(names)


def _missing_test(row: compat.Row) -> str | None:
    file, _, inside = row.test.partition("::")
    path = REPO / file
    if not path.is_file():
        return f"{row.source}: test file {file} does not exist"
    parts = inside.split("::")
    parts[-1] = parts[-1].split("[", 1)[0]  # a parametrization id cannot be checked statically
    if "::".join(parts) not in _test_names(path):
        return f"{row.source}: {file} has no test {'::'.join(parts)}"
    return None


def _upstream_name(module_name: str) -> str:
    return module_name.removeprefix("acshim.facades.")


def _is_private_facade_module(upstream: str) -> bool:
    """Modules below a dialect's import name with a ``_private`` component are helpers, and
    modules outside every dialect (``acshim.facades.torch``) are only containers."""
    for dialect in DIALECTS:
        if upstream == dialect.upstream:
            return False
        if upstream.startswith(dialect.upstream + "."):
            return any(part.startswith("_") for part in upstream[len(dialect.upstream) + 1:].split("."))
    return True


def _facade_modules() -> list[types.ModuleType]:
    modules = [acshim.facades]
    for info in pkgutil.walk_packages(acshim.facades.__path__, "acshim.facades."):
        modules.append(importlib.import_module(info.name))
    return [m for m in modules if not _is_private_facade_module(_upstream_name(m.__name__))]


def _public_names(module: types.ModuleType) -> dict[str, object]:
    """A facade module's public names: ``__all__`` if it has one, else every non-underscore
    function or class defined in acshim (imports of torch, typing & co. are not its names)."""
    if hasattr(module, "__all__"):
        names = list(module.__all__)
    else:
        names = [n for n, v in vars(module).items()
                 if not n.startswith("_") and (inspect.isclass(v) or inspect.isroutine(v))
                 and str(getattr(v, "__module__", "")).startswith("acshim")]
    return {n: getattr(module, n) for n in names if n not in PROTOCOL_NAMES and not inspect.ismodule(getattr(module, n))}


def _objects_named_by(keys: set[str]) -> list[object]:
    """What each row name resolves to below ``acshim.facades`` (functions, classes, modules...);
    constants are left out: equal constants are not the same name."""
    objects = []
    for key in keys:
        try:
            obj = pkgutil.resolve_name("acshim.facades." + key)
        except Exception:
            continue
        if not isinstance(obj, str | int | float | bool | type(None)):
            objects.append(obj)
    return objects


# --------------------------------------------------------------------------------------------------
# the real matrix


def test_matrix_loads_and_every_row_names_an_existing_test() -> None:
    rows = compat.load_rows()
    assert rows, "compat_matrix/ holds no rows"
    problems = [p for p in map(_missing_test, rows) if p]
    assert not problems, "rows name tests that do not exist:\n" + "\n".join(problems)


def test_every_public_facade_name_has_a_row() -> None:
    keys = {row.key for row in compat.load_rows()}
    named = {id(obj) for obj in _objects_named_by(keys)}
    uncovered = []
    for module in _facade_modules():
        for name, obj in _public_names(module).items():
            dotted = f"{_upstream_name(module.__name__)}.{name}"
            if dotted in keys or id(obj) in named:
                continue
            uncovered.append(dotted)
    assert not uncovered, (f"{len(uncovered)} public facade names have no compat_matrix row (add one to "
                           "compat_matrix/<dialect>.toml):\n" + "\n".join(sorted(uncovered)))


def test_generated_readme_is_current() -> None:
    assert compat.readme_is_current(), "compat_matrix/README.md is stale: run `acshim compat --write`"


# --------------------------------------------------------------------------------------------------
# validation and rendering, on a matrix of our own


def _write_matrix(directory: Path, body: str, name: str = "x.toml") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(textwrap.dedent(body), encoding="utf-8")
    return directory


GOOD_ROW = """
[[row]]
dialect = "fairscale"
name = "fairscale.nn.checkpoint_wrapper"
status = "better"
reason = "pickles | deep-copies"
test = "tests/t.py::test_a"
"""


def test_unknown_status_is_rejected_naming_file_and_row(tmp_path: Path) -> None:
    _write_matrix(tmp_path, GOOD_ROW + GOOD_ROW.replace("better", "great").replace("_wrapper", "_x"))
    with pytest.raises(compat.CompatError, match=r"x\.toml row 2 \(fairscale\.nn\.checkpoint_x\): unknown status 'great'"):
        compat.load_rows(tmp_path)


def test_missing_field_is_rejected_naming_file_and_row(tmp_path: Path) -> None:
    _write_matrix(tmp_path, GOOD_ROW.replace('test = "tests/t.py::test_a"\n', ""))
    with pytest.raises(compat.CompatError, match=r"x\.toml row 1 \(fairscale\.nn\.checkpoint_wrapper\): missing field\(s\) test"):
        compat.load_rows(tmp_path)


def test_duplicate_rows_across_files_are_rejected(tmp_path: Path) -> None:
    _write_matrix(tmp_path, GOOD_ROW, "a.toml")
    _write_matrix(tmp_path, GOOD_ROW, "b.toml")
    with pytest.raises(compat.CompatError, match=r"b\.toml row 1: duplicate of .*a\.toml row 1"):
        compat.load_rows(tmp_path)


def test_markdown_groups_by_dialect_counts_statuses_and_escapes_pipes(tmp_path: Path) -> None:
    _write_matrix(tmp_path, GOOD_ROW + GOOD_ROW.replace("fairscale", "deepspeed").replace("better", "not yet"))
    text = compat.render_markdown(compat.load_rows(tmp_path))
    assert text.index("## deepspeed") < text.index("## fairscale")  # DIALECT_ORDER, not file order
    assert "| [fairscale](#fairscale) | 0 | 1 | 0 | 0 |" in text
    assert "pickles \\| deep-copies" in text


def test_overclaim_lists_failed_and_skipped_tests_of_claiming_rows_only() -> None:
    rows = [compat.Row("d", "a", "same", "r", "tests/t.py::test_a", "x.toml row 1"),
            compat.Row("d", "b", "not yet", "r", "tests/t.py::test_b", "x.toml row 2"),
            compat.Row("d", "c", "partial", "r", "tests/t.py::test_c", "x.toml row 3")]
    outcomes = {"tests/t.py::test_a[1]": "passed", "tests/t.py::test_a[2]": "skipped",
                "tests/t.py::test_b": "failed", "tests/t.py::test_c": "passed"}
    assert compat.overclaims(rows, outcomes) == [
        "x.toml row 1: d 'a' claims 'same' but tests/t.py::test_a[2] skipped"]


def test_session_fails_when_a_claiming_rows_test_fails(tmp_path: Path) -> None:
    """The conftest plugin, end to end: a passing suite still exits 1 when a row claims more."""
    project = tmp_path / "project"
    (project / "tests").mkdir(parents=True)
    (project / "tests" / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (project / "tests" / "test_t.py").write_text(textwrap.dedent("""
        import pytest
        def test_a(): pass
        @pytest.mark.skip(reason="not today")
        def test_b(): pass
    """))
    rows = GOOD_ROW.replace("tests/t.py::test_a", "tests/test_t.py::test_a")
    rows += GOOD_ROW.replace("tests/t.py::test_a", "tests/test_t.py::test_b").replace("checkpoint_wrapper", "other")
    matrix = _write_matrix(project / "compat_matrix", rows)
    (project / "pytest.ini").write_text("[pytest]\n")
    env = {**_clean_env(), compat.ENVIRONMENT_VARIABLE: str(matrix)}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                            cwd=project, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 passed, 1 skipped" in result.stdout
    assert "claims 'better' but tests/test_t.py::test_b skipped" in result.stdout
    assert "fairscale.nn.checkpoint_wrapper'" not in result.stdout  # its test passed


def test_a_skip_for_an_absent_upstream_api_counts_as_not_run(tmp_path: Path) -> None:
    """A test skipped because the installed upstream lacks the API ("absent upstream: ...", as
    tests/hf does for 5.x-only names on transformers 4.x) does not fail its row; other skips do."""
    project = tmp_path / "project"
    (project / "tests").mkdir(parents=True)
    (project / "tests" / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (project / "tests" / "test_t.py").write_text(textwrap.dedent("""
        import pytest
        @pytest.mark.skipif(True, reason="absent upstream: this version has no such API")
        def test_a(): pass
        def test_b(): pytest.skip("absent upstream: skipped inside the test")
        @pytest.mark.skip(reason="upstream absent, worded otherwise")
        def test_c(): pass
    """))
    rows = GOOD_ROW.replace("tests/t.py::test_a", "tests/test_t.py::test_a")
    rows += GOOD_ROW.replace("tests/t.py::test_a", "tests/test_t.py::test_b").replace("checkpoint_wrapper", "b")
    rows += GOOD_ROW.replace("tests/t.py::test_a", "tests/test_t.py::test_c").replace("checkpoint_wrapper", "c")
    matrix = _write_matrix(project / "compat_matrix", rows)
    (project / "pytest.ini").write_text("[pytest]\n")
    env = {**_clean_env(), compat.ENVIRONMENT_VARIABLE: str(matrix)}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                            cwd=project, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "3 skipped" in result.stdout
    assert "claims 'better' but tests/test_t.py::test_c skipped" in result.stdout
    assert "test_t.py::test_a skipped" not in result.stdout and "test_t.py::test_b skipped" not in result.stdout


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "ACSHIM_"))}
