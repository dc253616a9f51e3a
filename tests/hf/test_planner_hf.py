"""acshim.plan on Hugging Face models left with their default ``use_cache``: profiling runs each
block on what a region would receive (the cache dropped), and the planned model trains exactly."""

from __future__ import annotations

import pytest
import torch

import acshim

pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_plan_profiles_cached_blocks_and_trains_exactly(family: str) -> None:
    model = acshim.testing.hf_model(family)
    model.train()
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    reference = grads()
    plan = acshim.plan(model, {"input_ids": ids, "labels": ids}, budget=0.5, memory="tensors")  # use_cache: default
    plan.apply(model)
    got = grads()
    assert set(got) == set(reference) and all(torch.equal(got[k], reference[k]) for k in got)


def test_a_chunked_head_is_left_unmeasured_where_no_plan_could_take_it() -> None:
    """At a small vocabulary and a generous budget the chunked head and loss (``acshim.head``) cannot
    pay: planning does not measure them (``profiler.OUTSIDE_BOUNDS``) and says so; the big
    vocabulary below is where they are measured and taken."""
    model = acshim.testing.hf_model("gpt2")
    model.train()
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    found = acshim.plan(model, {"input_ids": ids, "labels": ids}, budget=0.9, memory="tensors")
    chunked = {"loss", "head", "offload:disk+loss", "offload:disk+head"}
    assert chunked <= set(found.profile.unmeasured), found.profile.unmeasured
    assert found.outside not in chunked and not chunked & set(found.profile.outside_choices())
    assert any(note.startswith("not measured") and "offload:disk+head" in note for note in found.notes)


@pytest.mark.parametrize("loss_in", ["forward", "script"])
def test_plan_chooses_the_chunked_head_for_a_big_vocabulary_and_trains_exactly(loss_in: str) -> None:
    """A big vocabulary (the logits dominate): at 0.75 of no checkpointing's peak the plan runs the head
    and loss in chunks (``acshim.head``); gradients bitwise equal to the plain model's, whether the loss
    is the model's own (``labels``, Hugging Face's ``loss_function``) or the script's ``F.cross_entropy``
    of ``outputs.logits`` (shifted by slicing)."""
    import torch
    import torch.nn.functional as F

    import acshim
    from acshim.testing import hf_model

    vocab = 8192
    ids = torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(5))
    if loss_in == "forward":
        batch, loss_fn = {"input_ids": ids, "labels": ids}, None
    else:
        batch = {"input_ids": ids}

        def loss_fn(output):
            return F.cross_entropy(output.logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))

    def step(model):
        model.zero_grad(set_to_none=True)
        output = model(**batch)
        (output.loss if loss_fn is None else loss_fn(output)).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    reference = step(hf_model("llama", vocab_size=vocab))
    model = hf_model("llama", vocab_size=vocab)
    # the script's slice is copied by reshape: a second logits-sized tensor in its forward. At these
    # budgets no plan keeping the part outside the blocks fits (at 0.9 one with every block recomputed
    # did, and which won hung on timings: CI on a loaded machine saw it chosen)
    plan = acshim.plan(model, batch, budget=0.75 if loss_fn is None else 0.8, loss_fn=loss_fn,
                       choices=("keep", "recompute"), memory="tensors")  # a tiny model: its tensors, not the process
    assert plan.outside.endswith(("head", "loss")), str(plan)  # acshim.head: logits never all held with their log-softmax
    assert plan.measured_peak <= plan.budget
    plan.apply(model)
    got = step(model)
    assert set(got) == set(reference) and all(torch.equal(got[k], reference[k]) for k in got)
    acshim.remove_checkpointing(model)
    assert "forward" not in model.lm_head.__dict__


def _graph_tensors() -> int:
    import gc

    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None)


def test_a_step_dropped_without_backward_frees_its_graph_under_a_chunked_head_plan(monkeypatch) -> None:
    """``acshim run --budget``'s session with a plan whose outside part is chunked but not offloaded
    (``head``): kept regions run as plain calls, so a forward whose graph is dropped without backward
    (an evaluation with grad on, a verification stopped over the budget) frees it. (They ran under
    ``no_offload``, whose pack hook holds each saved tensor: a tensor saved by its own node made a
    reference cycle through the autograd graph that only backward breaks. A stopped verification of
    a LoRA Llama left 13 MiB behind each time, and the planner refused a budget its plan fits.)"""
    from acshim import region
    from acshim.planner import session as session_module
    from acshim.planner.plan import Plan
    from acshim.planner.session import PlanSession

    solve_within = session_module.solve_within

    def fixed(profile, budget, measure, **kwargs):
        assert "head" in profile.outside_choices()
        forced = Plan.from_choices(solve_within(profile, 1.0, None), ["keep"] * len(profile.blocks), outside="head")
        found = measure(forced)
        forced.measured_held, forced.measured_peak = found.held, found.peak
        return forced

    monkeypatch.setattr(session_module, "solve_within", fixed)
    monkeypatch.setattr(PlanSession, "_defer", lambda self: False)  # the chunked head measured, not needed at 0.9
    vocab = 8192
    ids = torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(5))
    model = acshim.testing.hf_model("llama", vocab_size=vocab)
    acshim.apply_checkpointing(model)
    session = PlanSession(0.9, memory="tensors").start()
    try:
        model(input_ids=ids, labels=ids).loss.backward()
        assert session.plan is not None and session.plan.outside == "head"
        before = _graph_tensors()
        loss = model(input_ids=ids, labels=ids).loss
        assert loss.grad_fn is not None and _graph_tensors() > before
        del loss
        assert _graph_tensors() == before
    finally:
        session.stop()
    assert region.ROUTERS == []
