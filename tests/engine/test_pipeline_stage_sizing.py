"""A pipeline stage's output size is read from one forward on fake tensors (planner.session's
``_stage_output_bytes``, issue 30 item 3). That forward must leave the stage's state as it was: under
torch's FakeTensorMode, BatchNorm's 0-dim ``num_batches_tracked`` is still incremented for real."""

from __future__ import annotations

import torch
from torch import nn

from acshim.planner.pipelines import PipelineStage
from acshim.planner.session import PlanSession, _stage_output_bytes


def test_sizing_a_stage_on_fake_tensors_leaves_its_buffers_rng_and_output_size_right() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Dropout(0.5)).train()
    batch = torch.randn(8, 16)
    buffers = {name: value.clone() for name, value in module.named_buffers()}
    rng = torch.get_rng_state()
    stage = PipelineStage(library="test", schedule="1F1B", module=module, args=(batch,), kwargs={}, stage=0,
                          stages=2, microbatches=4, in_flight=2)

    size = _stage_output_bytes(PlanSession(0.5), stage, (batch,), {})

    assert size == 8 * 32 * 4  # the output's bytes, not the input's
    for name, value in module.named_buffers():
        assert torch.equal(value, buffers[name]), name
    assert torch.equal(torch.get_rng_state(), rng)
