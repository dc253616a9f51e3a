"""A sharded Hugging Face model under ``torchrun -m acshim run --budget`` is offered the LM head and
its loss in chunks (``acshim.head``'s head mode) as the part outside its blocks
(acshim/planner/lockstep.py ``HEAD_STEP``): after the other explored steps, one step runs every block
recomputed and the head chunked, measured the same way, and the plan may run the head so. GPT-2 from a
small config with a large vocabulary (the logits dominate), FSDP2 per block and root, the script's
own ``gradient_checkpointing_enable()``, 2 gloo ranks, dropout on."""

from __future__ import annotations

from pathlib import Path

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "sharded_hf_budget.py")


def test_fsdp2_gpt2_below_full_recompute_plans_the_head_in_chunks_within_it_and_exactly(launch, torchrun) -> None:
    """At 0.5 of no checkpointing's peak, full recompute does not fit (the logits and their
    gradients alone are most of the step); the first step, every region with its input on disk but
    the head kept, is over, so from the second on every explored step runs the head in chunks (the
    second standing for the head's step); the plan runs the head and loss in chunks, every step of
    every rank from the second is within the budget by VmHWM, and the weights equal FSDP2's without
    checkpointing bitwise."""
    result = launch(torchrun("-m", "acshim", "run", "--budget", "0.5", SCRIPT, "--rows", "8,8,8,8,8,8,8"),
                    timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = result.results
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["equal"] and r["finite"] for r in ranks), ranks           # bitwise, as without checkpointing
    assert ranks[0]["choices"] == ranks[1]["choices"] and ranks[0]["outside"] == ranks[1]["outside"], ranks
    assert "head" in ranks[0]["offered"] and ranks[0]["outside"] == "head", ranks
    for r in ranks:
        assert r["peaks"][0] > r["budget"], r             # the first step keeps the logits: over it (docs/cli.md, Limits)
        assert max(r["peaks"][1:]) <= r["budget"], r      # from the second on the head runs in chunks: within, by VmHWM
    assert "outside the regions: head" in result.stderr, result.stderr[-3000:]
