"""``acshim run`` runs a script exactly as ``python script.py`` would, with the patches installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from acshim.cli_flags import HELP, OPTIONS, RunFlags, help_text, parse_run_flags, usage

PROBE = """
import json, os, sys
report = {
    "argv": sys.argv, "name": __name__, "file": __file__, "path0": sys.path[0],
    "spec": repr(__spec__), "loader": type(__loader__).__name__, "cached": repr(__cached__),
    "main_is_me": sys.modules["__main__"].__dict__ is globals(),
}
print(json.dumps(report))
if "--fail" in sys.argv:
    def inner():
        raise ValueError("raised by the script")
    inner()
if "--exit" in sys.argv:
    sys.exit(int(sys.argv[sys.argv.index("--exit") + 1]))
"""


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def _python(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_script_sees_the_same_argv_main_file_and_path_as_under_python(tmp_path: Path, run_acshim, plain_env) -> None:
    _write(tmp_path / "scripts" / "probe.py", PROBE)
    (tmp_path / "link.py").symlink_to(tmp_path / "scripts" / "probe.py")
    for script in ("scripts/probe.py", "link.py"):
        args = [script, "a b", "--flag", "-m", "x"]  # options after the script belong to the script
        expected = _python(*args, cwd=tmp_path, env=plain_env)
        actual = run_acshim("run", *args, cwd=tmp_path)
        assert actual.returncode == expected.returncode == 0, actual.stderr
        assert json.loads(actual.stdout) == json.loads(expected.stdout)


def test_exit_code_and_traceback_are_those_of_python(tmp_path: Path, run_acshim, plain_env) -> None:
    _write(tmp_path / "probe.py", PROBE)
    exited = run_acshim("run", "probe.py", "--exit", "7", cwd=tmp_path)
    assert exited.returncode == 7
    failed = run_acshim("run", "probe.py", "--fail", cwd=tmp_path)
    expected = _python("probe.py", "--fail", cwd=tmp_path, env=plain_env)
    assert failed.returncode == expected.returncode == 1
    assert failed.stderr == expected.stderr  # no acshim or runpy frames
    assert failed.stderr.splitlines()[-1] == "ValueError: raised by the script"


def test_missing_script_is_a_clear_error_with_exit_code_2(tmp_path: Path, run_acshim) -> None:
    result = run_acshim("run", "nowhere.py", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == f"acshim run: can't open file '{tmp_path / 'nowhere.py'}': [Errno 2] No such file or directory"


def test_module_form_runs_like_python_dash_m(tmp_path: Path, run_acshim, plain_env) -> None:
    _write(tmp_path / "pkg" / "__init__.py", "")
    _write(tmp_path / "pkg" / "tool.py", PROBE)
    expected = _python("-m", "pkg.tool", "x", cwd=tmp_path, env=plain_env)
    actual = run_acshim("run", "-m", "pkg.tool", "x", cwd=tmp_path)
    assert actual.returncode == 0, actual.stderr
    got, want = json.loads(actual.stdout), json.loads(expected.stdout)
    for key in ("argv", "name", "file", "path0", "cached"):
        assert got[key] == want[key], key
    missing = run_acshim("run", "-m", "no_such_module_here", cwd=tmp_path)
    assert missing.returncode == 1 and "No module named no_such_module_here" in missing.stderr


def test_script_runs_with_the_patches_installed(tmp_path: Path, run_acshim) -> None:
    _write(tmp_path / "uses_upstream.py", """
        import smdistributed.modelparallel.torch as smp          # absent here: served by the facade
        import acshim.facades.smdistributed.modelparallel.torch as facade
        import fairscale.nn                                        # installed: entry points patched
        import acshim
        from acshim.patching.inplace import is_acshim_wrapper
        assert smp is facade
        assert is_acshim_wrapper(fairscale.nn.checkpoint_wrapper)
        print("patched", acshim.patching.is_installed())
    """)
    result = run_acshim("run", "uses_upstream.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "patched True"


def test_run_options_stop_at_the_script() -> None:
    assert parse_run_flags(["--hf", "train.py", "--children", "-m"]) == RunFlags(
        hf=True, script="train.py", args=["--children", "-m"])
    assert parse_run_flags(["--children", "-m", "pkg.mod", "--hf"]) == RunFlags(children=True, module="pkg.mod",
                                                                                 args=["--hf"])
    assert parse_run_flags(["-mpkg", "a"]) == RunFlags(module="pkg", args=["a"])
    assert parse_run_flags(["--", "-weird.py"]) == RunFlags(script="-weird.py")
    assert parse_run_flags(["--budget=2GiB", "--report", "t.py"]) == RunFlags(budget="2GiB", report=True, script="t.py")
    assert "unknown option '--nope'" in parse_run_flags(["--nope", "x.py"])
    assert "unknown option '--report'" in parse_run_flags(["--report", "x.py"], "plan")
    assert parse_run_flags([]) == "acshim run: the script to run is missing"
    assert parse_run_flags(["--help", "x.py"]) == HELP


@pytest.mark.parametrize("verb", ["run", "plan"])
def test_help_lists_every_option_the_parser_reads(verb: str) -> None:
    """The help is argparse's own, made from the table the command line is read with."""
    text = help_text(verb)
    assert text.startswith(f"usage: {usage(verb)}")
    for option in OPTIONS[verb]:
        assert option.name in text and option.name in usage(verb)
        flags = parse_run_flags([option.name, *(["1"] if option.metavar else []), "x.py"], verb)
        assert isinstance(flags, RunFlags) and getattr(flags, option.dest) == ("1" if option.metavar else True)


def test_hf_flag_checkpoints_every_transformers_model_and_install_routes_hf_switches(tmp_path: Path, run_acshim) -> None:
    _write(tmp_path / "hf_script.py", """
        import sys
        import acshim.hf
        assert acshim.hf.installed(), "acshim.install() hands HF's switches to acshim.hf"
        assert "transformers" not in sys.modules, "installing must not import transformers"
        from acshim.testing import hf_model
        model = hf_model("llama")
        print("regions", len(acshim.hf.acshim_regions(model)))
    """)
    with_hf = run_acshim("run", "--hf", "hf_script.py", cwd=tmp_path)
    without = run_acshim("run", "hf_script.py", cwd=tmp_path)
    assert with_hf.returncode == 0 and without.returncode == 0, with_hf.stderr + without.stderr
    assert with_hf.stdout.strip() == "regions 3"  # hf_model("llama") has 3 decoder layers
    assert without.stdout.strip() == "regions 0"


def test_console_script_finds_modules_and_script_siblings_as_python_does(tmp_path: Path, plain_env) -> None:
    """The ``acshim`` console script starts with its own bin directory first on ``sys.path``: ``-m``
    must still see the working directory, a script its own directory (issue 8, item 8)."""
    console = str(Path(sys.executable).with_name("acshim"))
    _write(tmp_path / "mypkg" / "__init__.py", "")
    _write(tmp_path / "mypkg" / "helper.py", "VALUE = 'helper'\n")
    _write(tmp_path / "mypkg" / "train.py", "from mypkg.helper import VALUE\nimport sys\nprint(VALUE, sys.path[0])\n")
    _write(tmp_path / "scripts" / "sibling.py", "NAME = 'sibling'\n")
    _write(tmp_path / "scripts" / "main.py", "import sibling, sys\nprint(sibling.NAME, sys.path[0])\n")
    for args, expected in ((["-m", "mypkg.train"], f"helper {tmp_path}"),
                           ([str(Path("scripts") / "main.py")], f"sibling {tmp_path / 'scripts'}")):
        want = _python(*args, cwd=tmp_path, env=plain_env)
        got = subprocess.run([console, "run", *args], cwd=tmp_path, env=plain_env, capture_output=True, text=True,
                             timeout=600)
        assert want.stdout.strip() == expected, want.stderr
        assert got.returncode == 0, got.stderr
        assert got.stdout == want.stdout


def test_a_launcher_is_an_executable_on_path_that_is_not_a_file_here(tmp_path: Path, monkeypatch) -> None:
    from acshim.cli import _launcher_path

    monkeypatch.chdir(tmp_path)
    assert _launcher_path("python") is not None
    assert _launcher_path("train.py") is None and _launcher_path(None) is None
    (tmp_path / "python").write_text("print('a script called python')\n")
    assert _launcher_path("python") is None  # a file here runs as a script, as under python
    assert _launcher_path(str(Path("sub") / "torchrun")) is None  # a path is never looked up on PATH


def test_a_path_to_an_executable_that_is_not_python_source_is_a_launcher(tmp_path: Path, monkeypatch) -> None:
    """``acshim run -- /venv/bin/python train.py``: the interpreter (or a shell wrapper), named by an
    absolute or relative path, is started as a launcher; Python source given by path runs as a script."""
    from acshim.cli import _launcher_path

    monkeypatch.chdir(tmp_path)
    interpreter = os.path.realpath(sys.executable)
    assert _launcher_path(interpreter) == interpreter
    (tmp_path / "bin").mkdir()
    os.symlink(interpreter, tmp_path / "bin" / "python")
    relative = str(Path("bin") / "python")
    assert _launcher_path(relative) == relative
    wrapper = tmp_path / "launch.sh"
    wrapper.write_text("#!/bin/sh\nexec torchrun \"$@\"\n")
    wrapper.chmod(0o755)
    assert _launcher_path("launch.sh") == "launch.sh"
    console = tmp_path / "tool"  # a console script: python source behind a python #! line
    console.write_text(f"#!{interpreter}\nimport sys\n")
    console.chmod(0o755)
    plain = tmp_path / "script"  # executable text without #!: python reads it as source
    plain.write_text("print('hi')\n")
    plain.chmod(0o755)
    assert _launcher_path("tool") is None and _launcher_path("script") is None
    wrapper.chmod(0o644)  # not executable: python would try to run it as a script, and so does acshim
    assert _launcher_path("launch.sh") is None


def test_interpreter_given_by_path_runs_as_the_launcher(tmp_path: Path, plain_env) -> None:
    console = str(Path(sys.executable).with_name("acshim"))
    _write(tmp_path / "train.py", "import os, sys\nprint(os.environ.get('ACSHIM_PATCH_CHILDREN'), sys.argv)\n")
    done = subprocess.run([console, "run", "--", sys.executable, "train.py", "a"], cwd=tmp_path, env=plain_env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1 ['train.py', 'a']"  # a patched child python ran the script


def test_deepspeed_launchers_local_rank_before_run_goes_to_the_script(tmp_path: Path, run_acshim, plain_env) -> None:
    """``deepspeed --module acshim run train.py x`` starts ``python -u -m acshim --local_rank=N run
    train.py x`` (deepspeed/launcher/launch.py): the script sees what ``deepspeed train.py x`` gives it."""
    _write(tmp_path / "train.py", PROBE)
    expected = _python("-u", "train.py", "--local_rank=1", "x", cwd=tmp_path, env=plain_env)
    actual = run_acshim("--local_rank=1", "run", "train.py", "x", cwd=tmp_path)
    assert actual.returncode == 0, actual.stderr
    assert json.loads(actual.stdout)["argv"] == json.loads(expected.stdout)["argv"] == ["train.py", "--local_rank=1", "x"]


def test_launcher_replaces_acshim_and_inherits_child_patching(tmp_path: Path, plain_env) -> None:
    """``acshim run -- python ...``: the launcher runs in acshim's place (same pid, its own exit
    status, so signals reach it directly) with child patching in its environment."""
    from acshim.patching.children import childsite_dir

    console = str(Path(sys.executable).with_name("acshim"))
    env = {**plain_env, "PATH": os.pathsep.join([str(Path(sys.executable).parent), plain_env.get("PATH", "")])}
    code = ("import json, os, sys; print(json.dumps([os.getpid(), os.environ.get('ACSHIM_PATCH_CHILDREN'), "
            "os.environ['PYTHONPATH'].split(os.pathsep)[0], sys.argv[1:]])); sys.exit(7)")
    process = subprocess.Popen([console, "run", "--", "python", "-c", code, "a"], cwd=tmp_path, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 7, stderr
    assert json.loads(stdout) == [process.pid, "1", childsite_dir(), ["a"]]
