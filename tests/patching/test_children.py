"""Child processes get the patches only when asked (``--children`` / ``ACSHIM_PATCH_CHILDREN=1``)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from acshim.patching.children import childsite_dir, enable_children
from acshim.patching.dialects import TRIGGER_NAMES

# A parent that starts a multiprocessing *spawn* child (a fresh interpreter, as torchrun's workers
# are) and a plain `python -c` grandchild; each reports whether `smdistributed` (absent here)
# imports, and from where. The top level stays light: spawn re-runs it in the child.
SPAWNING_SCRIPT = """
import multiprocessing as mp
import os, subprocess, sys

def probe(queue):
    try:
        import smdistributed.modelparallel.torch as smp
        queue.put(smp.__name__)
    except ImportError as error:
        queue.put(f"ImportError: {error}")

if __name__ == "__main__":
    if "--no-spawn" not in sys.argv:
        context = mp.get_context("spawn")
        queue = context.Queue()
        child = context.Process(target=probe, args=(queue,))
        child.start()
        print("spawn child:", queue.get(timeout=600))
        child.join()
    code = "import smdistributed, sys; print(smdistributed.__name__)"
    grandchild = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    print("subprocess:", grandchild.stdout.strip() or grandchild.stderr.strip().splitlines()[-1])
    print("user sitecustomize ran:", os.environ.get("USER_SITECUSTOMIZE_RAN", "no"))
"""


def _write_project(tmp_path: Path) -> Path:
    (tmp_path / "spawning.py").write_text(textwrap.dedent(SPAWNING_SCRIPT))
    user_site = tmp_path / "user_site"
    user_site.mkdir()
    # A sitecustomize of the user's own, which acshim's must not shadow.
    (user_site / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE_RAN'] = 'yes'\n")
    return user_site


def test_children_are_not_patched_by_default(tmp_path: Path, run_acshim) -> None:
    user_site = _write_project(tmp_path)
    result = run_acshim("run", "spawning.py", cwd=tmp_path, env={"PYTHONPATH": str(user_site)})
    assert result.returncode == 0, result.stderr
    assert "spawn child: ImportError: No module named 'smdistributed'" in result.stdout
    assert "subprocess: ModuleNotFoundError: No module named 'smdistributed'" in result.stdout


def test_children_flag_patches_spawned_and_subprocess_children_and_keeps_user_sitecustomize(tmp_path: Path, run_acshim) -> None:
    user_site = _write_project(tmp_path)
    result = run_acshim("run", "--children", "spawning.py", cwd=tmp_path, env={"PYTHONPATH": str(user_site)})
    assert result.returncode == 0, result.stderr
    assert "spawn child: acshim.facades.smdistributed.modelparallel.torch" in result.stdout
    assert "subprocess: acshim.facades.smdistributed" in result.stdout
    assert "user sitecustomize ran: yes" in result.stdout


def test_environment_variable_opts_in_like_the_flag(tmp_path: Path, run_acshim) -> None:
    _write_project(tmp_path)
    result = run_acshim("run", "spawning.py", "--no-spawn", cwd=tmp_path, env={"ACSHIM_PATCH_CHILDREN": "1"})
    assert result.returncode == 0, result.stderr
    assert "subprocess: acshim.facades.smdistributed" in result.stdout


def test_child_that_never_imports_an_upstream_name_does_not_import_acshim(tmp_path: Path, run_python) -> None:
    """The child bootstrap waits for the first upstream import: helper processes stay light."""
    environment = {"ACSHIM_PATCH_CHILDREN": "1"}
    enable_children(environ=environment)
    result = run_python("""
        import sys, json
        print(json.dumps(["acshim" in sys.modules, "torch" in sys.modules]))
    """, prelude=False, env={**environment, "PYTHONPATH": environment["PYTHONPATH"]})
    assert result.stdout.strip() == "[false, false]"


def test_enable_children_prepends_the_bootstrap_once_and_keeps_the_users_path() -> None:
    environment = {"PYTHONPATH": os.pathsep.join(["/a", childsite_dir(), "/b"])}
    enable_children(hf=True, environ=environment)
    assert environment["PYTHONPATH"].split(os.pathsep) == [childsite_dir(), "/a", "/b"]
    assert environment["ACSHIM_PATCH_CHILDREN"] == environment["ACSHIM_PATCH_HF"] == "1"


def test_bootstrap_triggers_on_every_dialect_import_name() -> None:
    source = (Path(childsite_dir()) / "sitecustomize.py").read_text()
    assigned = next(node for node in ast.parse(source).body
                    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "TRIGGER_NAMES")
    assert ast.literal_eval(assigned.value) == TRIGGER_NAMES


def test_child_interpreter_without_acshim_warns_and_runs_unpatched(tmp_path: Path, plain_env: dict[str, str]) -> None:
    """A child started with another interpreter (here the base Python, outside the venv) cannot
    import acshim: it says so once and imports go on as without acshim."""
    base_python = getattr(sys, "_base_executable", None)
    if not base_python or sys.prefix == sys.base_prefix:  # not in a virtual environment
        pytest.skip("no interpreter outside this environment to start")
    probe = subprocess.run([base_python, "-c", "import acshim"], cwd=tmp_path, env=plain_env, capture_output=True)
    if probe.returncode == 0:
        pytest.skip("the base interpreter has acshim installed too (a developer machine)")
    environment = dict(plain_env)
    enable_children(environ=environment)
    result = subprocess.run([base_python, "-c", "import json; import smdistributed"], cwd=tmp_path, env=environment,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 1
    assert "cannot import acshim" in result.stderr and "runs without acshim's patches" in result.stderr
    assert result.stderr.strip().splitlines()[-1] == "ModuleNotFoundError: No module named 'smdistributed'"


def test_child_keeps_the_module_installing_patched_when_the_trigger_is_the_patched_module(run_python) -> None:
    """The torch dialect's trigger is the very module it patches in place, and installing imports
    it: the importing script must get that patched module, not a second, unpatched copy."""
    environment = {"ACSHIM_PATCH_CHILDREN": "1"}
    enable_children(environ=environment)
    result = run_python("""
        import sys, json
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as module
        from acshim.patching.inplace import is_acshim_wrapper
        print(json.dumps([is_acshim_wrapper(checkpoint_wrapper), module is sys.modules[module.__name__],
                          module.__spec__.origin == module.__file__]))
    """, prelude=False, env={**environment, "PYTHONPATH": environment["PYTHONPATH"]})
    assert result.stdout.strip() == "[true, true, true]"


def test_region_report_once_per_process_and_silent_in_launchers_that_ran_none(tmp_path: Path, run_acshim) -> None:
    """``ACSHIM_REPORT_REGIONS=1`` under child patching: one line per process even when ``acshim
    run`` runs inside a patched child, none from a non-rank helper that ran no region, the rank
    appended where a launcher set ``RANK``."""
    (tmp_path / "imports.py").write_text("import torch.distributed.algorithms._checkpoint.checkpoint_wrapper\n")
    (tmp_path / "region.py").write_text(textwrap.dedent("""
        import torch
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        checkpoint_wrapper(torch.nn.Linear(2, 2))(torch.ones(1, 2)).sum().backward()
    """))
    path = {"PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
            "ACSHIM_REPORT_REGIONS": "1"}
    line = "acshim: 0 region forwards, 0 recomputes"
    nested = run_acshim("run", "--", "python", "-m", "acshim", "run", "region.py", cwd=tmp_path, env=path)
    helper = run_acshim("run", "--", "python", "imports.py", cwd=tmp_path, env=path)
    rank = run_acshim("run", "--", "python", "imports.py", cwd=tmp_path, env={**path, "RANK": "3"})
    assert [r.returncode for r in (nested, helper, rank)] == [0, 0, 0], nested.stderr + helper.stderr + rank.stderr
    assert nested.stderr.count("acshim: 1 region forwards, 1 recomputes") == 1, nested.stderr
    assert line not in helper.stderr, helper.stderr
    assert f"{line} (rank 3)" in rank.stderr, rank.stderr
