"""acshim's imports point down and keep private names private (``tests/tools/import_structure.py``).

The known exceptions are listed below by name, each with who removes it; a new circle, a new
private name used from another module or a new arrow back up the layers fails here.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

KNOWN_CIRCLES: set[tuple[str, ...]] = set()  # none left: acshim.plan moved to planner.api (issue 26 item 3)

KNOWN_PRIVATE: set[tuple[str, str, str]] = set()  # none left: issue 31 removed them all

KNOWN_ARROWS_UP: set[tuple[str, str]] = set()  # none left: the runner no longer imports the report


def _tool():
    spec = importlib.util.spec_from_file_location("import_structure", ROOT / "tests" / "tools" / "import_structure.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def structure() -> dict:
    return _tool().report(ROOT)


def test_no_new_import_circle(structure: dict) -> None:
    circles = {tuple(group) for group in structure["circles"]}
    assert circles <= KNOWN_CIRCLES, f"new import circle(s): {sorted(circles - KNOWN_CIRCLES)}"


def test_region_and_compiled_import_one_way(structure: dict) -> None:
    """Issue 31 item 1: region imports compiled, and neither compiled nor region_call imports region."""
    files, imports, _ = _tool().scan(ROOT)
    edges = {(i.source, i.target) for i in imports}
    assert ("acshim.region", "acshim.compiled") in edges
    assert ("acshim.compiled", "acshim.region") not in edges
    assert not any(source == "acshim.region_call" and target in ("acshim.region", "acshim.compiled")
                   for source, target in edges)


def test_no_new_private_name_across_modules(structure: dict) -> None:
    used = {(p["source"], p["target"], p["name"]) for p in structure["private_names_across_modules"]}
    assert used <= KNOWN_PRIVATE, f"private names used from another module: {sorted(used - KNOWN_PRIVATE)}"


def test_no_new_arrow_back_up(structure: dict) -> None:
    up = {(i["source"], i["target"]) for i in structure["arrows_up"]}
    assert up <= KNOWN_ARROWS_UP, f"imports from a lower layer into a higher one: {sorted(up - KNOWN_ARROWS_UP)}"


def test_the_tool_sees_each_kind(tmp_path: Path) -> None:
    """On a made-up package: a circle closed by a function-level import, a private name imported
    and one read as a module attribute, an engine module importing a facade; a TYPE_CHECKING
    import is no edge."""
    package = tmp_path / "acshim"
    (package / "facades").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "facades" / "__init__.py").write_text("")
    (package / "facades" / "api.py").write_text("from .. import engine\n")
    (package / "facades" / "view.py").write_text("NAME = 'view'\n")
    (package / "engine.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import helper\n"
        "if TYPE_CHECKING:\n    from .facades import api\n"
        "def run():\n    return helper._secret\n")
    (package / "helper.py").write_text(
        "def late():\n    from .engine import run\n    return run\n"
        "def up():\n    from .facades.view import NAME\n    return NAME\n")
    (package / "other.py").write_text("from .helper import _hidden\n")
    found = _tool().report(tmp_path)
    assert found["circles"] == [["acshim.engine", "acshim.helper"]]
    assert {(p["source"], p["target"], p["name"]) for p in found["private_names_across_modules"]} == {
        ("acshim.engine", "acshim.helper", "_secret"), ("acshim.other", "acshim.helper", "_hidden")}
    assert [(i["source"], i["target"], i["where"]) for i in found["arrows_up"]] == [
        ("acshim.helper", "acshim.facades.view", "function")]
