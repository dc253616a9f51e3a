"""``acshim run --budget``'s engine part: a PlanSession routes a model's own regions by a plan made
on its first step (in process: the router is undone by ``stop()``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import acshim
from acshim import region
from acshim.planner import measure_step
from acshim.planner.session import PlanExit, PlanSession
from acshim.testing import GPT, assert_bitwise_equal, seeded, train_step


def _model() -> GPT:
    return seeded(lambda: GPT(layers=4, width=64, heads=4, seq=32, vocab=128))


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("budget", [0.45])
def test_plan_replaces_the_scripts_recompute_gradients_bitwise_and_peak_within_budget(budget, session_cleanup) -> None:
    expected = train_step(_model(), _ids(), seed=5)  # no checkpointing: no region, nothing routed
    model = _model()
    acshim.apply_checkpointing(model)  # the "script's" recipe: full recompute of every block
    session = PlanSession(budget, memory="tensors").start()
    session_cleanup.append(session)
    first = train_step(model, _ids(), seed=5)  # planned inside this step's first region call
    assert session.mode == "planned" and session.plan is not None
    assert len(session.plan.choices) == 4 and session.names == ["h.0", "h.1", "h.2", "h.3"]
    assert_bitwise_equal(expected, first)  # the interrupted step continued exactly
    second = train_step(model, _ids(), seed=5)
    assert_bitwise_equal(expected, second)
    held, peak = measure_step(model, _ids())
    assert peak <= session.plan.budget, (peak, session.plan.budget, session.plan.choices)
    assert session.plan.measured_peak <= session.plan.budget
    assert "replaced 4 region(s) (4 acshim: recompute) by the plan" in session.summary()
    # the regions' inputs and outputs copied for profiling are not held for the rest of the run
    assert all(site.captured is None for site in session.sites)


def test_budget_below_the_minimum_names_it_and_leaves_the_model_as_it_was(session_cleanup) -> None:
    model = _model()
    acshim.apply_checkpointing(model)
    session = PlanSession(1000, choices=("keep", "recompute"), memory="tensors").start()
    session_cleanup.append(session)
    with pytest.raises(PlanExit) as caught:
        train_step(model, _ids())
    assert caught.value.code == 2
    assert "--budget 1000" in caught.value.message and "least achievable peak" in caught.value.message
    assert "pass --budget" in caught.value.message
    assert region.ROUTERS == []  # routing undone
    assert all(p.grad is None for p in model.parameters())
    assert acshim.checkpointed_modules(model) == ["h.0", "h.1", "h.2", "h.3"]  # the script's recipe again
    assert_bitwise_equal(train_step(_model(), _ids()), train_step(model, _ids()))


@pytest.mark.parametrize("budget", [0, -1, "abc", "1.5XB", "-2GiB", 1.5])
def test_bad_budgets_are_refused_before_routing(budget) -> None:
    with pytest.raises(ValueError, match=r"--budget"):
        PlanSession(budget).start()
    assert region.ROUTERS == []


def test_region_outside_any_module_forward_is_a_clear_error(session_cleanup) -> None:
    block = torch.nn.Linear(4, 4)
    session = PlanSession(0.5, choices=("recompute",), memory="tensors").start()
    session_cleanup.append(session)
    with pytest.raises(PlanExit, match="outside any nn.Module's forward"):
        acshim.checkpoint(lambda x: block(x).relu(), torch.randn(2, 4, requires_grad=True))
    assert region.ROUTERS == []


class FullyShardedDataParallel(torch.nn.Module):
    """Stands for FSDP1 on the stack (the session looks at the wrapper's type name)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_acshim_plan_on_a_sharded_model_across_ranks_names_acshim_run(monkeypatch) -> None:
    """``acshim.plan`` runs blocks alone, which a sharded model cannot do out of its collectives'
    step: across ranks it is refused naming ``acshim run --budget`` (which plans on the script's
    steps), the model left as found."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    model = _model()
    with pytest.raises(ValueError, match=r"sharded by FullyShardedDataParallel across 2 ranks; .* torchrun \.\.\. "
                                         r"-m acshim run --budget B train.py"):
        acshim.plan(FullyShardedDataParallel(model), _ids(), budget=0.5, memory="tensors")
    assert region.ROUTERS == []
    assert all(p.grad is None for p in model.parameters())
    assert acshim.checkpointed_modules(model) == []


def test_saved_counter_counts_what_keeping_a_region_holds_and_changes_no_gradient() -> None:
    """``lockstep.SavedCounter``, chained to torch checkpoint's hooks in a recomputed region's forward,
    counts what the same forward saves kept (parameters and the region's input left out, storages
    freed and reused counted again), and the region's gradients stay bitwise those of a plain call."""
    import contextlib

    from acshim.measure import storage_key
    from acshim.options import RegionOptions
    from acshim.planner.counting import SavedBytes
    from acshim.planner.lockstep import SavedCounter

    block = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 64))
    x = torch.randn(128, 64, requires_grad=True)
    excluded = {storage_key(t)[0] for t in [x, *block.parameters()]}
    with SavedBytes(excluded) as kept:
        block(x)
    torch.manual_seed(0)
    expected = torch.autograd.grad(block(x).square().sum(), [x, *block.parameters()])
    counter = SavedCounter({storage_key(x)[0]})
    torch.manual_seed(0)
    output = region.run_region_now(block, (x,), {},
                                   RegionOptions().replace(context_fn=lambda: (counter, contextlib.nullcontext())))
    assert counter.held(output) == kept.total() > 0
    got = torch.autograd.grad(output.square().sum(), [x, *block.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_step_peak_sees_what_backward_allocates_and_puts_backward_back() -> None:
    """``lockstep.StepPeak`` measures the rest of the forward and every backward of the step (an
    allocation inside backward counts) and restores ``torch.autograd.backward`` when finished."""
    from acshim.planner.lockstep import StepPeak
    from acshim.planner.process import ProcessMemory, trim

    class Scratch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            scratch = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched, only while backward runs
            return grad + scratch[:1].float()

    original = torch.autograd.backward
    model = nn.Linear(8, 8)
    memory = ProcessMemory()
    trim()
    peak = StepPeak(memory, memory.current())
    x = torch.randn(4, 8)
    peak.start(model)
    loss = Scratch.apply(model(x)).sum()
    assert torch.autograd.backward is not original  # measured from the forward hook on
    loss.backward()
    measured = peak.finish()
    assert torch.autograd.backward is original
    if memory.available:
        assert measured >= 60 << 20, measured


def test_agreed_profile_takes_every_ranks_largest_number_and_refuses_other_regions(monkeypatch) -> None:
    """Two ranks' profiles of the same model: each number becomes the larger of the two, so both
    solve the same numbers; profiles of different regions cannot be agreed."""
    import torch.distributed as dist

    from acshim.planner.agree import RanksDisagree, agree_measurement, agree_profile
    from acshim.planner.profile import BlockProfile, Profile

    def profile(scale: float, name: str = "h.0") -> Profile:
        blocks = [BlockProfile(name, {"keep": int(100 * scale), "recompute": 10}, {"keep": 5, "recompute": 50},
                               {"keep": 0.01 * scale, "recompute": 0.02})]
        return Profile(blocks, ["keep", "recompute"], other_held=7, other_transient=int(9 * scale),
                       other_seconds=0.5 * scale, signature="abc", prefetch=2, recompute_step={"peak": 3 * scale})

    other = {"numbers": None}

    def all_reduce(tensor, op):  # the other rank contributes other["numbers"] (same layout)
        assert op == dist.ReduceOp.MAX
        theirs = other["numbers"](tensor) if callable(other["numbers"]) else other["numbers"]
        tensor.copy_(torch.maximum(tensor, theirs))

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    slower = profile(2.0)
    calls = []

    def numbers_of_slower(tensor):  # first call: the layout digest, then the numbers
        calls.append(len(tensor))
        if len(calls) == 1:
            return tensor.clone()
        # ... other_saved, unchecked_floor (no checkpointing's least peak: its larger is kept), recompute_step
        mine = torch.tensor([100 * 2, 10, 5, 50, 0.02, 0.02, 0, 7, 18, 1.0, 0, 40, 6.0], dtype=torch.float64)
        return mine

    other["numbers"] = numbers_of_slower
    agreed = agree_profile(profile(1.0), torch.device("cpu"))
    block = agreed.blocks[0]
    assert (block.held, block.transient) == (slower.blocks[0].held, slower.blocks[0].transient)
    assert block.seconds == pytest.approx(slower.blocks[0].seconds)
    assert isinstance(block.held["keep"], int) and isinstance(agreed.other_held, int)
    assert (agreed.other_transient, agreed.other_seconds, agreed.recompute_step) == (18, 1.0, {"peak": 6.0})
    assert agreed.unchecked_floor == 40 and isinstance(agreed.unchecked_floor, int)
    from acshim.planner.profiler import Verification

    other["numbers"] = torch.tensor([300.0, 200.0, 400.0, 1.0, 50.0, 2.0], dtype=torch.float64)
    agreed = agree_measurement(Verification(250, 100, 500, 1.0), torch.device("cpu"))
    assert (agreed.held, agreed.peak, agreed.process_peak, agreed.stopped, agreed.live_at_stop, agreed.seconds) == (
        300, 200, 500, True, 50, 2.0)  # another rank's guard stopped it: stopped on every rank
    other["numbers"] = lambda tensor: -tensor + 1  # the other rank's layout digest differs
    with pytest.raises(RanksDisagree, match="ran different checkpointed regions"):
        agree_profile(profile(1.0), torch.device("cpu"))


@pytest.mark.parametrize("planner", ["session", "acshim.plan"])
def test_planning_never_reaches_hooks_on_the_real_parameters(planner, session_cleanup) -> None:
    """An optimizer stepped from ``register_post_accumulate_grad_hook`` (or DDP's reducer) must see
    the script's backwards only: planning's many block backwards go to storage-sharing aliases."""
    expected = train_step(_model(), _ids(), seed=5)
    model = _model()
    fired: list[str] = []
    names = {id(p): n for n, p in model.named_parameters()}
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(lambda p: fired.append(names[id(p)]))
    acshim.apply_checkpointing(model)
    if planner == "session":
        session_cleanup.append(PlanSession(0.45, memory="tensors").start())
    else:
        acshim.plan(model, _ids(), budget=0.45, memory="tensors").apply(model)
    got = train_step(model, _ids(), seed=5)
    assert sorted(fired) == sorted(names.values())  # once per parameter: the script's one backward
    assert_bitwise_equal(got, expected)


def test_larger_inputs_than_planned_are_planned_again_before_they_run(session_cleanup, capsys) -> None:
    """A plan is made on the first step's shapes; a later, larger batch (dynamic padding) is planned
    again before its forward runs, within the same budget in bytes (a fraction stays the first
    plan's bytes); smaller batches and steps without grad (evaluation) are left alone, silently.
    Gradients stay bitwise."""
    model = _model()
    acshim.apply_checkpointing(model)
    session = PlanSession(0.9, memory="tensors").start()  # twice the batch fits in 0.9 of the first's
    session_cleanup.append(session)
    train_step(model, _ids())
    first = session.plan
    budget = first.budget
    capsys.readouterr()  # the plan's line
    train_step(model, _ids()[:1])  # smaller: nothing to do
    larger = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model(larger)  # evaluation: no backward, nothing planned, nothing said
    model.eval()
    model(larger)  # nor in eval mode with grad enabled
    model.train()
    assert session.replans == 0 and capsys.readouterr().err == ""
    expected = train_step(_model(), larger, seed=3)
    assert_bitwise_equal(expected, train_step(model, larger, seed=3))
    assert session.replans == 1 and session.plan is not first and session.plan.budget == budget
    assert session.plan.profile.inputs == [[4, 32]]
    err = capsys.readouterr().err
    assert err.count("this step's inputs [[4, 32]] are larger than those planned for [[2, 32]]: planned again") == 1
    train_step(model, larger)
    assert session.replans == 1


def test_outside_part_offloaded_by_the_plan_gradients_bitwise_and_undone(session_cleanup, monkeypatch) -> None:
    """A plan that offloads the part outside the regions (embeddings, head) installs a scope around
    the model's forward from the next step on, with kept and recomputed regions shielded from it and
    offloaded ones sharing its schedule. Gradients stay bitwise, and stop() puts the model's own
    forward back. (Which budgets choose it is the solver's business, tested on its own: here the
    plan is fixed, so machine load cannot change it.)"""
    from acshim.planner import session as session_module
    from acshim.planner.plan import Plan

    chosen = ["keep", "recompute", "offload:disk", "selective"]
    solve_within = session_module.solve_within

    def fixed(profile, budget, measure, **kwargs):
        forced = Plan.from_choices(solve_within(profile, 1.0, None), chosen, outside="offload:disk")
        forced.in_flight = 6 << 20  # what room under a budget would grant: the schedules get it
        found = measure(forced)  # the candidate step runs as in planning
        forced.measured_held, forced.measured_peak = found.held, found.peak
        return forced

    monkeypatch.setattr(session_module, "solve_within", fixed)
    expected = train_step(_model(), _ids(), seed=5)
    model = _model()
    acshim.apply_checkpointing(model)
    session = PlanSession(0.9, memory="tensors").start()
    session_cleanup.append(session)
    assert_bitwise_equal(expected, train_step(model, _ids(), seed=5))
    assert session.plan is not None and (session.plan.choices, session.plan.outside) == (chosen, "offload:disk")
    assert "forward" in model.__dict__ and "outside the regions: offload:disk" in session.summary()
    assert "offload:disk" in session.plan.profile.outside
    assert_bitwise_equal(expected, train_step(model, _ids(), seed=5))
    scope = session._shared["disk"]
    assert model.forward.scope is scope and scope.session.stats.moved > 0
    assert scope.session.max_bytes_in_flight == 6 << 20
    session.stop()
    assert "forward" not in model.__dict__
    assert_bitwise_equal(expected, train_step(model, _ids(), seed=5))


def test_a_plan_slower_than_predicted_is_solved_again_with_measured_costs(session_cleanup, monkeypatch,
                                                                       capsys) -> None:
    """Issue 17 item 3: the steps after planning are timed region by region; offloaded regions that
    run measurably slower than predicted (here: their storage tier turns slow after planning, a
    simulated link of 1 MB/s) make the session solve again with the measured costs before the next
    step, say so on stderr, verify the new plan and switch to it (gradients stay bitwise)."""
    from acshim.backends import SimulatedBackend
    from acshim.planner import session as session_module
    from acshim.planner.plan import Plan

    chosen = ["offload:disk", "offload:disk", "recompute", "keep"]
    solve_within = session_module.solve_within
    calls = []

    def first_offloads(profile, budget, measure, **kwargs):
        calls.append(budget)
        if len(calls) > 1:  # the re-solve after the timed steps: the solver's own choice
            return solve_within(profile, budget, measure, **kwargs)
        forced = Plan.from_choices(solve_within(profile, budget, None), chosen)
        found = measure(forced)
        forced.measured_held, forced.measured_peak = found.held, found.peak
        return forced

    monkeypatch.setattr(session_module, "solve_within", first_offloads)
    expected = train_step(_model(), _ids(), seed=5)
    model = _model()
    acshim.apply_checkpointing(model)
    session = PlanSession(1.0, memory="tensors", choices=("keep", "recompute", "offload")).start()
    session_cleanup.append(session)
    assert_bitwise_equal(expected, train_step(model, _ids(), seed=5))  # planned in this step
    assert session.plan.choices == chosen
    slow = SimulatedBackend(1 / 1e6)
    session._shared["disk"].session.backend_override = slow  # the tier slows down after planning
    for _ in range(3):  # two timed steps, then the re-solve before the third
        assert_bitwise_equal(expected, train_step(model, _ids(), seed=5))
    err = capsys.readouterr().err
    assert "the plan's offloaded regions ran slower than predicted" in err, err
    assert "solved again with the measured costs: now" in err, err
    assert not any("offload" in c for c in session.plan.choices), session.plan.choices
    assert any("re-solved after planning" in note for note in session.plan.notes)
    assert slow.log  # the slow link really carried the copies
    assert_bitwise_equal(expected, train_step(model, _ids(), seed=5))


def test_a_re_solve_that_fits_no_plan_names_the_budget_with_the_scripts_loss_back(session_cleanup, monkeypatch,
                                                                                  capsys) -> None:
    """A re-solve is solved within the budget less the script's own loss (charged after the planning
    step): where no plan fits, the least budget it names is the solver's plus that loss, the budget
    to pass; the plan in force is kept."""
    from acshim.planner import session as session_module
    from acshim.planner.budget import format_bytes
    from acshim.planner.plan import HEADROOM
    from acshim.planner.solver import BudgetTooSmall

    model = _model()
    acshim.apply_checkpointing(model)
    session = PlanSession(1.0, memory="tensors").start()
    session_cleanup.append(session)
    train_step(model, _ids(), seed=5)
    plan = session.plan
    session._charged.script_part = 3 << 20
    least = 20 << 20

    def nothing_fits(profile, budget, measure, **kwargs):
        raise BudgetTooSmall(budget, least, 0, profile)

    monkeypatch.setattr(session_module, "solve_within", nothing_fits)
    assert not session.resolve(plan.profile, "a test's reason", (_ids(),), {})
    err = capsys.readouterr().err
    named = int(least * (1 + BudgetTooSmall.MARGIN)) + -(-(3 << 20) // (1 - HEADROOM))
    assert f"the least budget that plans it: {format_bytes(int(named))}" in err, err
    assert session.plan is plan
