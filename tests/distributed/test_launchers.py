"""Launchers start patched ranks: ``torchrun -m acshim run``, ``acshim run -- <launcher>`` for
torchrun, ``python -m torch.distributed.run``, ``accelerate launch`` and the ``deepspeed`` launcher.
Every rank runs on acshim's engine (same patching, same region counts), its gradients equal those
without checkpointing, and a rank that raises fails the launch with its error shown."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ACSHIM = str(Path(sys.executable).with_name("acshim"))
SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "launched_rank.py")
BIN = str(Path(sys.executable).parent)
# Launchers named as a user types them: found on PATH, this interpreter's bin directory first.
ON_PATH = {"PATH": os.pathsep.join([BIN, os.environ.get("PATH", "")])}
REGIONS = "acshim: 3 region forwards, 3 recomputes"  # 3 wrapped blocks, one step, per rank
FAILURE = "RuntimeError: rank 1 failed on purpose"


def _free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def _assert_every_rank_patched(result) -> None:
    """Both ranks ran on acshim, gradients bitwise equal to no checkpointing, counts per rank."""
    results = result.results
    assert [r["rank"] for r in results] == [0, 1], result.stdout[-2000:] + result.stderr[-4000:]
    assert all(r["world_size"] == 2 and r["patched"] and r["equal"] for r in results), results
    assert all(r["wrapper"] == "DistributedDataParallel" for r in results), results
    assert result.region_counts() == [REGIONS] * 2, result.stderr[-3000:]
    ranks = re.findall(re.escape(REGIONS) + r" \(rank (\d+)\)", result.stderr)
    assert sorted(ranks) == ["0", "1"], result.stderr[-3000:]


def _assert_rank_1_failed(result) -> None:
    assert result.returncode == 1, result.stderr[-4000:]
    assert f"[rank1]: {FAILURE}" in result.stderr or FAILURE in result.stderr, result.stderr[-4000:]


def test_torchrun_runs_acshim_as_a_module_on_every_rank(launch, torchrun) -> None:
    result = launch(torchrun("-m", "acshim", "run", SCRIPT), timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    _assert_every_rank_patched(result)


def test_torchrun_failure_summary_names_the_failing_ranks_error(launch, torchrun) -> None:
    """``acshim run`` writes the rank's error where torchrun's summary reads it (as ``@record``)."""
    result = launch(torchrun("-m", "acshim", "run", SCRIPT, "--fail-rank", "1"), timeout=120)
    _assert_rank_1_failed(result)
    _assert_every_rank_patched(result)
    root_cause = result.stderr.split("Root Cause (first observed failure):", 1)[-1]
    assert "rank      : 1 (local_rank: 1)" in root_cause and FAILURE in root_cause, root_cause
    assert "acshim/cli.py" not in root_cause  # the rank's traceback starts in the script


def test_acshim_run_wraps_torchrun_and_patches_every_rank(launch) -> None:
    result = launch([ACSHIM, "run", "--", "torchrun", "--standalone", "--nproc-per-node", "2", SCRIPT],
                    env=ON_PATH, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    _assert_every_rank_patched(result)


def test_acshim_run_wraps_python_dash_m_torch_distributed_run_and_a_failing_rank_fails_it(launch) -> None:
    result = launch([ACSHIM, "run", "python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                     "2", SCRIPT, "--fail-rank", "1"], env=ON_PATH, timeout=120)
    _assert_rank_1_failed(result)
    _assert_every_rank_patched(result)


def test_acshim_run_wraps_accelerate_launch_and_accelerators_ddp(launch) -> None:
    """Accelerate's multi-process launch on CPU goes through torch.distributed.run (``--multi_gpu``
    names the launch mode, not a device) and ``Accelerator(cpu=True)`` then forms a gloo group and
    wraps the model in DDP; its ``--cpu`` multi-process launch mode needs MPI (docs/distributed.md)."""
    pytest.importorskip("accelerate")
    result = launch([ACSHIM, "run", "--", "accelerate", "launch", "--multi_gpu", "--num_processes", "2",
                     "--num_machines", "1", "--main_process_port", "0", "--mixed_precision", "no",
                     "--dynamo_backend", "no", SCRIPT, "--accelerator"], env=ON_PATH, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    _assert_every_rank_patched(result)


def test_acshim_run_wraps_the_deepspeed_launcher_and_a_failing_rank_fails_it(launch) -> None:
    pytest.importorskip("deepspeed")
    result = launch([ACSHIM, "run", "--", "deepspeed", "--num_gpus", "2", "--master_port", _free_port(), SCRIPT,
                     "--fail-rank", "1"], env={**ON_PATH, "DS_ACCELERATOR": "cpu"}, timeout=120)
    _assert_rank_1_failed(result)
    _assert_every_rank_patched(result)


def test_two_nodes_each_wrapping_torchrun_form_one_patched_job() -> None:
    """``torchrun --nnodes 2 --node-rank R`` as on two machines (two launchers on loopback, one rank
    each, static rendezvous): each node's ranks are patched and the job's ranks are 0 and 1."""
    port = _free_port()
    environment = {**os.environ, **ON_PATH, "OMP_NUM_THREADS": "1", "ACSHIM_REPORT_REGIONS": "1"}
    nodes = [subprocess.Popen([ACSHIM, "run", "--", "torchrun", "--nnodes", "2", "--node-rank", str(rank),
                               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port, SCRIPT],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment,
                              start_new_session=True) for rank in (0, 1)]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=120))
    finally:  # whatever is left of each node's session (timeout, the other node failed): kill it
        for node in nodes:
            try:
                os.killpg(node.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            node.wait()
    assert len(outputs) == 2
    for node, (_, stderr) in zip(nodes, outputs):
        assert node.returncode == 0, stderr[-4000:]
    results = [json.loads(stdout.split("RESULT ", 1)[1].splitlines()[0]) for stdout, _ in outputs]
    assert [(r["rank"], r["local_rank"], r["world_size"]) for r in results] == [(0, 0, 2), (1, 0, 2)]
    assert all(r["patched"] and r["equal"] for r in results), results
    assert [re.findall(re.escape(REGIONS) + r" \(rank (\d+)\)", stderr) for _, stderr in outputs] == [["0"], ["1"]]
