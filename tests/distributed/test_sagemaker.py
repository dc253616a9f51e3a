"""SageMaker model parallelism on real gloo ranks (torchrun, 2 processes, under ``acshim run``):
SMP v1 with ``ddp: True`` runs torch DDP across the ranks, SMP v2's documented FSDP pattern runs on
torch's FSDP1 and FSDP2; with checkpointing, losses and gradients are bitwise those without."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ACSHIM = str(Path(sys.executable).with_name("acshim"))
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def test_smp_v1_ddp_averages_gradients_across_ranks_and_checkpointing_is_exact(launch, torchrun) -> None:
    result = launch(torchrun("--no-python", ACSHIM, "run", str(SCRIPTS / "smp_v1_data_parallel.py")))
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = result.results
    assert [(r["rank"], r["dp_rank"], r["local_rank"]) for r in ranks] == [(0, 0, 0), (1, 1, 1)]
    for rank in ranks:
        assert (rank["size"], rank["dp_size"], rank["mp_size"], rank["dp_group"]) == (2, 2, 1, [0, 1])
        assert rank["mp_group"] == [rank["rank"]] and rank["dp_process_group_is_world"]
        assert rank["losses_differ_across_ranks"], "each data-parallel rank must train on its own shard"
        assert rank["gradients_identical_across_ranks"] and rank["average_of_local_gradients"], rank
        assert rank["equal"], "checkpointed SMP steps must give the gradients of the steps without"
        assert rank["received"] == {"from": 1 - rank["rank"]}, "smp.broadcast/send reach recv_from on the peer"
    # 4 blocks x 2 microbatches x 2 steps, each recomputed once
    assert result.region_counts() == ["acshim: 16 region forwards, 16 recomputes"] * 2


@pytest.mark.parametrize(("config", "message"), [
    ({"partitions": 1}, "set 'ddp': True in the smp config"),
    ({"tensor_parallel_degree": 2, "ddp": True},
     "tensor_parallel_degree=2 with 2 processes: acshim does not provide tensor parallelism"),
    ({"sharded_data_parallel_degree": 2, "ddp": True},
     "sharded_data_parallel_degree=2 with 2 processes: acshim does not provide sharded data parallelism"),
], ids=["without_ddp", "tensor_parallel", "sharded_data_parallel"])
def test_smp_v1_several_ranks_refuse_what_acshim_does_not_do_at_init(launch, torchrun, tmp_path, config,
                                                                     message) -> None:
    script = tmp_path / "smp_init.py"
    script.write_text(f"import smdistributed.modelparallel.torch as smp\nsmp.init({config!r})\nprint('trained')\n")
    result = launch(torchrun("--no-python", ACSHIM, "run", str(script)))
    assert result.returncode != 0 and "trained" not in result.stdout
    assert message in result.stderr


def test_smp_v2_fsdp1_and_fsdp2_with_checkpoint_and_offload_wrappers_are_exact(launch, torchrun) -> None:
    result = launch(torchrun("--no-python", ACSHIM, "run", str(SCRIPTS / "smp_v2_fsdp.py")))
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = result.results
    assert [(r["tsm_rank"], r["tsm_world_size"]) for r in ranks] == [(0, 2), (1, 2)]
    for rank in ranks:
        assert len(rank["results"]) == 4
        assert all(outcome == "equal" for outcome in rank["results"].values()), rank
    # 3 GPT-2 blocks x 2 steps x 4 checkpointed cases, each recomputed once
    assert result.region_counts() == ["acshim: 24 region forwards, 24 recomputes"] * 2
