"""SMP v1 pipeline parallelism on real gloo ranks (torchrun under ``acshim run``): the model split
into 2 partitions (automatic by measured memory, or manual with ``smp.partition``), microbatches
through ``@smp.step``, with and without ``smp.set_activation_checkpointing`` and with
``checkpoint`` / ``checkpoint_sequential`` called from the model's forward; every parameter's
gradient, gathered from the stage that owns it, the losses and the trained state dict are bitwise
those of the same model on one process with the same microbatch split."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

ACSHIM = str(Path(sys.executable).with_name("acshim"))
SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "smp_v1_pipeline.py")
EXACT = ("losses_equal", "gradients_equal", "state_dict_equal", "outputs", "eval_equal")


def test_pipeline_of_two_stages_is_bitwise_one_process_auto_manual_and_checkpointed(launch, torchrun) -> None:
    result = launch(torchrun("--no-python", ACSHIM, "run", SCRIPT), timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = result.results
    assert [(r["rank"], r["pp_rank"], r["pp_size"], r["dp_rank"], r["dp_size"]) for r in ranks] == [
        (0, 0, 2, 0, 1), (1, 1, 2, 0, 1)]
    assert [r["pp_group"] for r in ranks] == [[0, 1], [0, 1]]
    for rank in ranks:
        for name, case in rank["cases"].items():
            assert all(case[flag] for flag in EXACT), (rank["rank"], name, case)
    # each stage owns, steps and saves half of the parameters (the others' are released); together all
    assert all(case["others_released"] for r in ranks for case in r["cases"].values())
    for name in ("auto", "auto_each_block", "manual_group_3", "manual_in_forward"):
        first, second = (r["cases"][name]["local_parameters"] for r in ranks)
        assert "embed.weight" in first and "head.out.weight" in second and not set(first) & set(second)
        assert [r["cases"][name]["optimizer_parameters"] for r in ranks] == [len(first), len(second)]
    assert all(r["cases"]["auto"]["reload_equal"] for r in ranks), "smp.save / smp.load across partitions"
    # a checkpointed module split by automatic partitioning is run plainly, with SMP's warning
    for rank in ranks:
        warned = {name: case["warnings"] for name, case in rank["cases"].items()}
        assert warned.pop("auto_split") == [
            "automatic partitioning split module 'body' across partitions [0, 1]: it won't be checkpointed "
            "(a checkpointed module must lie within one partition)"]
        assert not any(warned.values()), warned
    assert "Partition assignments: main: 0, embed: 0, blocks: 0, blocks.0: 0" in result.stderr
    assert re.search(r"blocks\.2: 1, .*head: 1", result.stderr)
    # regions run on the stage owning them: per rank, 2 steps x 2 microbatches x (2 blocks each,
    # 1 contiguous group, 1 group_3 group cut at the boundary, and from forward 2: embed and blocks
    # (0, 1) on stage 0, blocks (2, 3) and the head on stage 1) = 24; none in the split case; plus
    # 16 of the in-forward case's one-process reference, run on each rank
    assert sorted(result.region_counts()) == ["acshim: 40 region forwards, 40 recomputes"] * 2


def test_two_replicas_of_two_stages_average_gradients_bitwise(launch, torchrun) -> None:
    result = launch(torchrun("--no-python", ACSHIM, "run", SCRIPT, "--cases", "auto_each_block", nproc=4),
                    timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = result.results
    assert [(r["pp_rank"], r["dp_rank"], r["pp_group"], r["dp_group"]) for r in ranks] == [
        (0, 0, [0, 1], [0, 2]), (1, 0, [0, 1], [1, 3]), (0, 1, [2, 3], [0, 2]), (1, 1, [2, 3], [1, 3])]
    for rank in ranks:
        case = rank["cases"]["auto_each_block"]
        assert all(case[flag] for flag in EXACT), (rank["rank"], case)
    assert sorted(result.region_counts()) == ["acshim: 8 region forwards, 8 recomputes"] * 4


def test_pipeline_example_runs_unchanged_on_two_ranks_with_the_one_process_digest(launch, torchrun) -> None:
    example = str(Path(__file__).resolve().parents[2] / "examples" / "smp_v1_pipeline.py")
    two_ranks = launch(torchrun("--no-python", ACSHIM, "run", example), timeout=240)
    assert two_ranks.returncode == 0, two_ranks.stderr[-4000:]
    one_process = launch([sys.executable, "-m", "acshim", "run", example, "--no-checkpointing"],
                         env={"WORLD_SIZE": "1"})
    assert one_process.returncode == 0, one_process.stderr[-4000:]
    digests = [re.findall(r"GRADS [0-9a-f]{64}", run.stdout) for run in (two_ranks, one_process)]
    assert len(digests[0]) == 1 and digests[0] == digests[1]
    assert "(pp_rank 0 of 2)" in two_ranks.stdout
    # 3 steps x 2 microbatches x one "contiguous" region per partition, on each rank
    assert two_ranks.region_counts() == ["acshim: 6 region forwards, 6 recomputes"] * 2


SPLIT_BY_HAND = """
    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = nn.Linear(4, 4)
            with smp.partition(1):
                self.second = nn.Linear(4, 4)

        def forward(self, x):
            return self.second(self.first(x))

    net = nn.Sequential(Body(), nn.Linear(4, 1))
    model = smp.DistributedModel(net)
    smp.set_activation_checkpointing(net[0])
"""
FAILS_ON_STAGE_1 = """
    class Bad(nn.Module):
        def forward(self, x):
            raise ValueError("bad shape on stage 1")

    net = nn.Sequential(nn.Linear(4, 4))
    with smp.partition(1):
        net.append(Bad())
    model = smp.DistributedModel(net)
"""


@pytest.mark.parametrize(("model", "errors"), [
    (SPLIT_BY_HAND, ["CheckpointingConfigError: set_activation_checkpointing of module '0': its module tree spans "
                     "partitions [0, 1]"] * 2),
    (FAILS_ON_STAGE_1, ["RuntimeError: pipeline stage of rank 1 failed: ValueError: bad shape on stage 1",
                        "PipelineAborted: RuntimeError: pipeline stage of rank 1 failed"]),
], ids=["checkpointed_module_split_by_hand", "module_fails_on_another_stage"])
def test_errors_reach_every_stage_and_no_rank_hangs(launch, torchrun, tmp_path, model, errors) -> None:
    script = tmp_path / "pipeline_error.py"
    script.write_text(textwrap.dedent("""
        import smdistributed.modelparallel.torch as smp
        import torch
        from torch import nn

        smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False,
                  "default_partition": 0})
    """) + textwrap.dedent(model) + textwrap.dedent("""
        @smp.step
        def train_step(model, x):
            loss = model(x).sum()
            model.backward(loss)
            return loss

        train_step(model, torch.randn(4, 4))
        print("trained")
    """))
    result = launch(torchrun("--no-python", ACSHIM, "run", str(script)), timeout=90)
    assert result.returncode != 0 and "trained" not in result.stdout
    lines = result.stderr.splitlines()
    for rank, error in enumerate(errors):  # torchrun prefixes each rank's traceback lines with [rankN]:
        assert any(line.startswith(f"[rank{rank}]: ") and error in line for line in lines), result.stderr[-3000:]
