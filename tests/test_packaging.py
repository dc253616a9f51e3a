"""The package as users install it: a built wheel carries backends/ as acshim.backends and csrc/ as
acshim._csrc, declares the console script, and imports without the source tree."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_ships_backends_csrc_and_console_script(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist")], check=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("acshim-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "acshim/backends/__init__.py" in names
    assert "acshim/_csrc/__init__.py" in names and "acshim/_csrc/fileio.cpp" in names
    assert "acshim/_compat_matrix/engine.toml" in names and "acshim/_compat_matrix/README.md" in names
    assert not any(n.startswith(("backends/", "csrc/", "tests/")) for n in names)
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "acshim = acshim.cli:main" in entry_points

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, cwd=tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "ACSHIM_COMPAT_DIR"} | {"PYTHONPATH": str(target)}
    probe = ("import acshim, acshim.backends, acshim._csrc, acshim.compat; "
             "assert acshim.compat.load_rows(); print(acshim.__file__); print(acshim.backends.__file__)")
    result = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True,
                            check=True)
    package_file, backends_file = result.stdout.split()
    assert package_file.startswith(str(target)) and backends_file.startswith(str(target / "acshim" / "backends"))


def _site_without_numpy(tmp_path: Path) -> Path:
    """A copy (by symlinks) of the interpreter's site-packages without NumPy: what a fresh venv with
    only ``torch==2.13.0`` and acshim installed sees."""
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"])
    farm = tmp_path / "site-without-numpy"
    farm.mkdir()
    for entry in site.iterdir():
        if entry.name.split("-")[0].split(".")[0] in ("numpy", "acshim") or entry.name.startswith("__editable__"):
            continue
        (farm / entry.name).symlink_to(entry)
    return farm


def test_demo_prints_no_numpy_warning_when_numpy_is_absent(tmp_path: Path) -> None:
    farm = _site_without_numpy(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONWARNINGS")}
    prefix = f"import sys; sys.path[:0] = [{str(farm)!r}, {str(ROOT)!r}]; "

    def run(code: str) -> subprocess.CompletedProcess:
        # -S: site-packages (and its .pth files) only through the NumPy-free copy
        return subprocess.run([sys.executable, "-S", "-W", "default", "-c", prefix + code], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=600)

    control = run("import torch; import importlib.util; assert importlib.util.find_spec('numpy') is None")
    assert control.returncode == 0, control.stderr
    assert "Failed to initialize NumPy" in control.stderr  # torch alone warns: the environment has no NumPy

    demo = run("from acshim.cli import main; sys.exit(main(['demo', '--layers', '2', '--width', '32', '--seq', '16', "
               "'--batch', '2']))")
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "bitwise identical to the run without checkpointing: yes" in demo.stdout
    assert "NumPy" not in demo.stderr and "Warning" not in demo.stderr, demo.stderr


def test_readme_and_docs_link_only_to_files_in_the_repository() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        text = page.read_text()
        assert "shared/" not in text, f"{page.name} points outside the repository (shared/...)"
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which is not in the repository"
    assert "(docs/measuring.md)" in (ROOT / "README.md").read_text()


def test_readme_set_up_creates_a_virtual_environment_and_says_how_long_the_tests_take() -> None:
    text = (ROOT / "README.md").read_text()
    set_up = text[text.index("## Set-up on a fresh machine"):text.index("## Three ways to use it")]
    assert "python3 -m venv .venv && . .venv/bin/activate" in set_up
    assert set_up.index("python3 -m venv") < set_up.index("pip install torch==2.13.0 && pip install .")
    testing = text[text.index("## Development and testing"):]
    assert re.search(r"about \d+ minutes with `pytest -n 2`", testing)
