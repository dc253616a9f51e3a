"""Every ``examples/*.py`` runs unchanged under ``acshim run`` and gives gradients bitwise equal to
the same step without checkpointing (``--no-checkpointing``); where the upstream library it is
written for is really installed here, plain ``python example.py`` (the real library) gives the same
digest too.

Each example prints ``GRADS <sha256>`` as its last line. The runs are subprocesses (each example
needs a fresh interpreter with the patches installed), started together for the selected tests and
run a few at a time.
"""

from __future__ import annotations

import ast
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from acshim.patching.dialects import DIALECTS, decide, module_exists

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.py"))
GRADS_LINE = re.compile(r"GRADS [0-9a-f]{64}")
REGIONS_LINE = re.compile(r"acshim: \d+ region forwards, (\d+) recomputes")
PARALLEL_RUNS = min(3, os.cpu_count() or 2)
TIMEOUT_SECONDS = 600

# Examples whose plain-upstream run is not bitwise equal to the checkpoint-free run, and why.
UPSTREAM_NOT_BITWISE: dict[str, str] = {
    "modalities_activation_checkpointing": "the real Modalities wraps with preserve_rng_state=False, so with the "
    "example's dropout its recompute draws other masks (acshim preserves RNG; tests/facades/test_modalities_upstream.py)",
}

# Examples for upstream packages acshim cannot serve whole (model code), by the module they need; they
# run where that package is installed (the ``megatron`` and ``lightning`` extras).
NEEDS_PACKAGE: dict[str, str] = {
    "megatron_core_recompute": "megatron.core",
    "megatron_core_offload": "megatron.core",
    "lightning_fsdp_activation_checkpointing": "lightning",
}

# Examples whose plain-upstream run cannot happen on CPU, and why.
UPSTREAM_NEEDS_GPU: dict[str, str] = {
    "megatron_core_recompute": "megatron-core's model_parallel_cuda_manual_seed reads torch.cuda",
    "megatron_core_offload": "megatron-core's model_parallel_cuda_manual_seed reads torch.cuda; its offloader "
    "builds CUDA streams",
}

# Examples whose plain-upstream run fails on this CPU-only machine, and the error upstream gives.
UPSTREAM_FAILS_ON_CPU: dict[str, str] = {
    "trl_activation_offloading": "AttributeError: 'NoneType' object has no attribute 'type'",  # TRL 1.16's
    # OffloadActivations reads torch.accelerator.current_accelerator().type when built
}

# What a launcher does before the script under the real library: DeepSpeed's checkpointing needs
# its communication backend up (``deepspeed.init_distributed()``) before ``configure`` /
# ``checkpoint``; acshim needs nothing, so the examples do not call it. The script itself runs
# unchanged after this prelude (same argv, ``__main__``).
UPSTREAM_LAUNCH_PRELUDE = {
    "deepspeed": "import deepspeed; deepspeed.init_distributed(dist_backend='gloo', verbose=False)",
}
LAUNCHER = """
import runpy, sys
{prelude}
sys.argv = sys.argv[1:]
sys.path[0] = __import__("os").path.dirname(__import__("os").path.abspath(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _imported_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _upstreams() -> dict[str, bool]:
    """Upstream import names -> really installed here (else acshim serves them from a facade)."""
    names = {d.upstream: decide(d) == "patch" for d in DIALECTS}
    names["transformers"] = module_exists("transformers")  # acshim.hf patches HF's own entry points
    return names


UPSTREAMS = _upstreams()
PATCH_ONLY = {d.upstream for d in DIALECTS if d.patch_only}
"""Upstreams whose facade cannot stand in for the package: their examples need it installed."""


def upstreams_used(path: Path) -> set[str]:
    """The upstream import names (dialect roots) the example uses."""
    names = _imported_names(path)
    return {u for u in UPSTREAMS if any(n == u or n.startswith(u + ".") for n in names)}


def runs_on_real_upstream(path: Path) -> bool:
    """True when every upstream package the example imports is really installed here."""
    used = upstreams_used(path)
    return bool(used) and all(UPSTREAMS[u] for u in used)


EXAMPLES = [p for p in EXAMPLES if p.stem not in NEEDS_PACKAGE or module_exists(NEEDS_PACKAGE[p.stem])]
PLAIN_EXAMPLES = [p for p in EXAMPLES if runs_on_real_upstream(p) and p.stem not in UPSTREAM_NEEDS_GPU]

# Installed upstream packages whose facade can also serve the whole import name: hiding the real
# package exercises the other path of ``acshim run`` (facade served under the upstream name).
HIDEABLE = ("deepspeed", "fairscale")
HIDDEN_EXAMPLES = [p for p in EXAMPLES if upstreams_used(p) & {u for u in HIDEABLE if UPSTREAMS.get(u)}]
HIDING_LAUNCHER = """
import importlib.abc, sys
HIDDEN = {hidden!r}
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Hide())
from acshim.cli import main
sys.exit(main(["run", *sys.argv[1:]]))
"""


def _free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _command(example: Path, variant: str) -> list[str]:
    relative = str(example.relative_to(REPO))
    if variant == "plain":
        preludes = [UPSTREAM_LAUNCH_PRELUDE[u] for u in sorted(upstreams_used(example)) if u in UPSTREAM_LAUNCH_PRELUDE]
        if preludes:
            return [sys.executable, "-c", LAUNCHER.format(prelude="\n".join(preludes)), relative]
        return [sys.executable, relative]
    if variant == "hidden-upstream":
        hidden = sorted(upstreams_used(example) & set(HIDEABLE))
        return [sys.executable, "-c", HIDING_LAUNCHER.format(hidden=hidden), relative]
    extra = ["--no-checkpointing"] if variant == "no-checkpointing" else []
    return [sys.executable, "-m", "acshim", "run", relative, *extra]


def _run(example: Path, variant: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACSHIM_", "PYTEST_"))}
    # A one-process "distributed" world, for examples that call init_distributed() as upstream requires.
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=_free_port(), OMP_NUM_THREADS="1", ACSHIM_REPORT_REGIONS="1")
    return subprocess.run(_command(example, variant), cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_SECONDS)


class ExampleRuns:
    """Starts every run the selected tests need at once, a few in parallel; hands out results."""

    def __init__(self, jobs: list[tuple[Path, str]]) -> None:
        self._executor = ThreadPoolExecutor(max_workers=PARALLEL_RUNS)
        self._futures: dict[tuple[Path, str], Future] = {job: self._executor.submit(_run, *job) for job in jobs}

    def start(self, example: Path, *variants: str) -> None:
        for job in ((example, v) for v in variants):
            if job not in self._futures:
                self._futures[job] = self._executor.submit(_run, *job)

    def result(self, example: Path, variant: str) -> subprocess.CompletedProcess:
        self.start(example, variant)
        return self._futures[(example, variant)].result()

    def digest(self, example: Path, variant: str) -> str:
        self.start(example, variant)
        result = self._futures[(example, variant)].result()
        command = f"{variant} run of {example.relative_to(REPO)}"
        assert result.returncode == 0, f"`{command}` exited {result.returncode}:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
        lines = [line for line in result.stdout.splitlines() if line.strip()]
        assert lines and GRADS_LINE.fullmatch(lines[-1]), f"`{command}` did not end with a GRADS line:\n{result.stdout[-2000:]}"
        return lines[-1]

    def recomputes(self, example: Path, variant: str) -> int:
        """How many region recomputes the engine ran (``acshim run`` reports it at exit)."""
        self.digest(example, variant)
        found = REGIONS_LINE.findall(self._futures[(example, variant)].result().stderr)
        assert found, f"{variant} run of {example.relative_to(REPO)} printed no acshim region report"
        return int(found[-1])

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def example_runs(request: pytest.FixtureRequest) -> Iterator[ExampleRuns]:
    jobs: list[tuple[Path, str]] = []
    # Under pytest-xdist a worker cannot tell which of the collected items it will run: each test
    # then starts its own runs. Otherwise every selected test's runs start now.
    selected = [] if hasattr(request.config, "workerinput") else request.session.items
    for item in selected:
        callspec = getattr(item, "callspec", None)
        if item.module is not request.module or callspec is None or "example" not in callspec.params:
            continue
        example = callspec.params["example"]
        variants = {"test_example_matches_the_real_upstream_library": ["plain"],
                    "test_example_runs_on_the_facade_when_upstream_is_hidden": ["hidden-upstream"]}.get(
            item.originalname, ["checkpointing", "no-checkpointing"])
        jobs += [(example, v) for v in variants if (example, v) not in jobs]
    runs = ExampleRuns(jobs)
    yield runs
    runs.close()


def test_examples_exist() -> None:
    assert EXAMPLES, "examples/ holds no example scripts"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_example_gives_the_same_gradients_with_and_without_checkpointing(example: Path, example_runs: ExampleRuns) -> None:
    missing = sorted(u for u in upstreams_used(example) if u in PATCH_ONLY and not UPSTREAMS[u])
    if missing:
        pytest.skip(f"absent upstream: {', '.join(missing)} not installed, and acshim only patches it in place")
    example_runs.start(example, "checkpointing", "no-checkpointing")
    assert example_runs.digest(example, "checkpointing") == example_runs.digest(example, "no-checkpointing")
    # and the checkpointed run really recomputed on the engine; the other did not checkpoint at all
    assert example_runs.recomputes(example, "checkpointing") > 0
    assert example_runs.recomputes(example, "no-checkpointing") == 0


@pytest.mark.parametrize("example", PLAIN_EXAMPLES, ids=lambda p: p.stem)
def test_example_matches_the_real_upstream_library(example: Path, example_runs: ExampleRuns) -> None:
    """``python example.py`` runs the real DeepSpeed / FairScale / PyTorch / transformers code,
    checkpointing on."""
    if example.stem in UPSTREAM_FAILS_ON_CPU:  # what acshim run fixes: upstream's own run fails here
        result = example_runs.result(example, "plain")
        assert result.returncode != 0 and UPSTREAM_FAILS_ON_CPU[example.stem] in result.stderr, result.stderr[-2000:]
        return
    example_runs.start(example, "plain", "no-checkpointing")
    upstream = example_runs.digest(example, "plain")
    if example.stem in UPSTREAM_NOT_BITWISE:
        pytest.skip(f"upstream ran, digest not compared: {UPSTREAM_NOT_BITWISE[example.stem]}")
    assert upstream == example_runs.digest(example, "no-checkpointing")


@pytest.mark.parametrize("example", HIDDEN_EXAMPLES, ids=lambda p: p.stem)
def test_example_runs_on_the_facade_when_upstream_is_hidden(example: Path, example_runs: ExampleRuns) -> None:
    """With the installed DeepSpeed / FairScale hidden, ``import deepspeed`` & co. resolve to the
    facade under ``acshim run``: same digest as the checkpoint-free run."""
    example_runs.start(example, "hidden-upstream", "no-checkpointing")
    assert example_runs.digest(example, "hidden-upstream") == example_runs.digest(example, "no-checkpointing")
