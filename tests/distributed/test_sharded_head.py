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
    gradients alone are most of the step): every explored step runs the head and loss in chunks, the
    step that would keep them is predicted over the budget and not run, and no checkpointing's peak
    is estimated from the logits (from below); the plan runs the head and loss in chunks, every
    step of every rank from the first is within the budget by VmHWM, and the weights equal FSDP2's
    without checkpointing bitwise."""
    result = launch(torchrun("-m", "acshim", "run", "--budget", "0.5", SCRIPT, "--rows", "8,8,8,8,8,8,8"),
                    timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = result.results
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["equal"] and r["finite"] for r in ranks), ranks           # bitwise, as without checkpointing
    assert ranks[0]["choices"] == ranks[1]["choices"] and ranks[0]["outside"] == ranks[1]["outside"], ranks
    assert ranks[0]["offered"] == ["head"] and ranks[0]["outside"] == "head", ranks  # keeping it: not offered
    for r in ranks:
        assert max(r["peaks"]) <= r["budget"], r          # from the first step on, explored ones included: by VmHWM
        # the budget is 0.5 of a reference estimated from below: at most half of no checkpointing's peak
        assert r["budget"] <= 0.5 * max(r["none"]), (r["budget"], r["none"])
    assert "keeping them was predicted over the budget and not run" in ranks[0]["method"], ranks[0]["method"]
    assert "outside the regions: head" in result.stderr, result.stderr[-3000:]


def test_fsdp2_gpt2_whose_kept_head_fits_measures_it_on_a_last_step_and_may_keep_it(launch, torchrun) -> None:
    """With a smaller vocabulary keeping the head and loss fits 0.6 of no checkpointing's peak: the
    explored steps run it in chunks, a last explored step keeps it (predicted within the budget with
    keeping estimated at its most), both are offered, no checkpointing's peak is predicted with it
    kept as measured, and every step of every rank is within the budget by VmHWM, bitwise as FSDP2
    without checkpointing."""
    result = launch(torchrun("-m", "acshim", "run", "--budget", "0.6", SCRIPT, "--vocab", "1024",
                             "--rows", "8,8,8,8,8,8,8,8"), timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = result.results
    assert all(r["equal"] and r["finite"] for r in ranks), ranks
    assert ranks[0]["offered"] == ["keep", "head"], ranks
    assert "then one step kept them" in ranks[0]["method"], ranks[0]["method"]
    for r in ranks:
        assert max(r["peaks"]) <= r["budget"], r
        assert r["budget"] <= 0.6 * max(r["none"]), (r["budget"], r["none"])
