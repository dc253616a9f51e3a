"""apply_checkpointing(storage=...): every region's saved inputs go to the storage tier."""

from __future__ import annotations

import os

import pytest
import torch

import acshim
from acshim.testing import GPT, assert_bitwise_equal, seeded, train_step


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_disk_tier_on_region_inputs_is_exact_and_holds_less(tmp_path, reentrant: bool) -> None:
    ids = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(0))
    plain = train_step(seeded(GPT), ids, loss_fn=_loss)

    in_memory = seeded(GPT)
    acshim.apply_checkpointing(in_memory, reentrant=reentrant)
    on_disk = seeded(GPT)
    acshim.apply_checkpointing(on_disk, reentrant=reentrant, storage="disk", prefetch=1, directory=str(tmp_path))

    assert_bitwise_equal(plain, train_step(on_disk, ids, loss_fn=_loss))
    held_memory = acshim.measure_memory(in_memory, ids, loss_fn=_loss).held_bytes
    held_disk = acshim.measure_memory(on_disk, ids, loss_fn=_loss).held_bytes
    block_input = 4 * 64 * 128 * 4
    # every region's input leaves memory except the last `prefetch` (=1) ones, which backward needs first
    assert held_memory - held_disk == (len(on_disk.h) - 1) * block_input
    assert not any(os.scandir(tmp_path)) or all(not any(os.scandir(d.path)) for d in os.scandir(tmp_path))


def test_storage_options_need_a_storage_tier() -> None:
    with pytest.raises(ValueError, match="pass storage='host' or storage='disk'"):
        acshim.apply_checkpointing(seeded(GPT), prefetch=2)
