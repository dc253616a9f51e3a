"""The ``acshim`` verbs other than ``run``: compat, doctor, build-ext, demo."""

from __future__ import annotations

import textwrap
import types
from pathlib import Path

import pytest

from acshim import cli, compat

ROWS = """
[[row]]
dialect = "fairscale"
name = "fairscale.nn.checkpoint_wrapper"
status = "better"
reason = "deep-copies and pickles"
test = "tests/t.py::test_a"

[[row]]
dialect = "deepspeed"
name = "deepspeed.checkpointing.checkpoint"
status = "same"
reason = "bitwise equal gradients"
test = "tests/t.py::test_b"
"""


@pytest.fixture
def matrix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "rows.toml").write_text(textwrap.dedent(ROWS))
    monkeypatch.setenv(compat.ENVIRONMENT_VARIABLE, str(tmp_path))
    return tmp_path


def test_compat_prints_rows_filtered_by_dialect(matrix: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["compat"]) == 0
    text = capsys.readouterr().out
    assert text.index("deepspeed\n") < text.index("fairscale\n")
    header = [line for line in text.splitlines() if line.split() == ["upstream", "name", "status", "why"]]
    assert len(header) == 1 and text.index(header[0]) < text.index("deepspeed\n")  # columns named first
    assert "same = behaves as upstream" in text and "not yet = gives a clear error" in text  # statuses explained
    assert cli.main(["compat", "--dialect", "fairscale"]) == 0
    text = capsys.readouterr().out
    assert "fairscale.nn.checkpoint_wrapper" in text and "deepspeed" not in text
    assert cli.main(["compat", "--markdown", "--status", "same"]) == 0
    text = capsys.readouterr().out
    assert "| `deepspeed.checkpointing.checkpoint` | same |" in text and "checkpoint_wrapper" not in text


def test_compat_write_then_check_detects_staleness(matrix: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["compat", "--check"]) == 1
    assert "stale" in capsys.readouterr().err
    assert cli.main(["compat", "--write"]) == 0
    assert (matrix / "README.md").read_text() == compat.render_markdown(compat.load_rows(matrix))
    assert cli.main(["compat", "--check"]) == 0
    (matrix / "more.toml").write_text(textwrap.dedent(ROWS).replace("checkpoint", "configure"))
    assert cli.main(["compat", "--check"]) == 1


def test_compat_reports_an_invalid_matrix_clearly(matrix: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (matrix / "rows.toml").write_text(textwrap.dedent(ROWS).replace('"same"', '"identical"'))
    assert cli.main(["compat"]) == 1
    assert "rows.toml row 2 (deepspeed.checkpointing.checkpoint): unknown status 'identical'" in capsys.readouterr().err


def test_compat_without_a_matrix_says_where_it_lives(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(compat.ENVIRONMENT_VARIABLE, str(tmp_path / "absent"))
    assert cli.main(["compat"]) == 1
    assert "is not a directory" in capsys.readouterr().err


def test_doctor_reports_versions_and_how_each_dialect_is_served(tmp_path: Path, run_acshim) -> None:
    result = run_acshim("doctor", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    assert "torch 2." in result.stdout and "device: cpu" in result.stdout
    assert "patches in this process: not installed" in result.stdout
    assert "upstream kept" in lines["fairscale"] and "0.4.13" in lines["fairscale"]
    assert "upstream kept" in lines["deepspeed"]
    assert "facade under the upstream name (acshim.facades.smdistributed)" in lines["smdistributed"]
    assert "facade under the upstream name" in lines["torch.sagemaker"]
    assert "native extension:" in result.stdout
    assert "CPU tensor allocator (--budget): not loaded in this process (acshim run --budget compiles" in result.stdout


def test_build_ext_without_native_support_says_so(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "_optional_module", lambda name: None)
    assert cli.main(["build-ext"]) == 1
    assert "no native extension to build" in capsys.readouterr().err


def test_build_ext_failure_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def build() -> None:
        raise RuntimeError("acshim native extension did not build: no compiler")

    monkeypatch.setattr(cli, "_optional_module", lambda name: types.SimpleNamespace(build=build))
    assert cli.main(["build-ext"]) == 1
    assert "no compiler" in capsys.readouterr().err


def test_demo_hands_every_argument_to_the_demo(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    monkeypatch.setattr(cli, "_optional_module",
                        lambda name: types.SimpleNamespace(main=lambda argv: seen.append(argv) or 3) if name == "acshim.demo" else None)
    assert cli.main(["demo", "--size", "small", "-h"]) == 3
    assert seen == [["--size", "small", "-h"]]


def test_no_verb_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "compat" in capsys.readouterr().out


def test_run_reports_a_failed_install_without_running_the_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import acshim.patching

    def failing_install(**options: object) -> None:
        raise acshim.patching.PatchError("fakefacade.ACSHIM_PATCHES names 'x.y' for z.w, which does not resolve")

    monkeypatch.setattr(acshim.patching, "install", failing_install)
    script = tmp_path / "never.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    assert cli.main(["run", str(script)]) == 1
    assert "could not install the patches (nothing was changed): fakefacade.ACSHIM_PATCHES" in capsys.readouterr().err
    assert not (tmp_path / "ran").exists()
