"""acshim.plan: a per-block choice under a peak activation-memory budget (issue 10)."""

from __future__ import annotations

import dataclasses
import gc
import importlib
import itertools
import math
import random

import pytest
import torch

import acshim
from acshim.planner import BudgetTooSmall, Plan, measure_step, parse_budget, plan, solver
from acshim.planner.budget import budget_at_least
from acshim.planner.choices import OffloadedForward, SharedOffload, expand_choices, split_outside
from acshim.planner.plan import HEADROOM, NoPlanMeasured
from acshim.planner.profile import BlockProfile, Profile, feasible
from acshim.planner.profiler import RegionProfiler
from acshim.planner.replay import Copies, replay
from acshim.planner.session import PlanSession
from acshim.planner.solver import minimum_peak, rounded_peak, solve
from acshim.testing import GPT, assert_bitwise_equal, seeded, train_step

plan_module = importlib.import_module("acshim.planner.plan")  # the package's `plan` is the function
ALL = ["keep", "selective", "selective-alt", "recompute", "offload:disk", "recompute+offload:disk"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def small_gpt() -> GPT:
    return seeded(lambda: GPT(layers=4, width=64, heads=4, seq=32, vocab=128))


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def half(ids) -> tuple[GPT, Plan]:
    model = small_gpt()
    return model, plan(model, ids, budget=0.5, memory="tensors")


def state_of(model: torch.nn.Module) -> tuple[list, list]:
    return ([m.__dict__.get("forward") for m in model.modules()], [p.grad for p in model.parameters()])


# ---------------------------------------------------------------------------------------------- budget
@pytest.mark.parametrize(("text", "expected"), [
    ("1.5GiB", int(1.5 * 2**30)), ("800MB", 800 * 10**6), ("123456", 123456), (4096, 4096), ("2 kib", 2048),
])
def test_parse_budget_sizes(text, expected):
    assert parse_budget(text, 10**9) == expected


@pytest.mark.parametrize("size", [1, 775_000, 2**20, 2**20 + 1, 5 * 2**30 - 1, 2**30 + 1])
def test_budget_hint_is_never_below_the_minimum(size):
    hint = budget_at_least(size)
    assert parse_budget(hint) >= size
    assert parse_budget(hint) < size + 2**20 // 10 + 1 or hint.endswith("GiB")  # the next 0.1 MiB step up


def test_parse_budget_fractions():
    assert parse_budget(0.25, 1000) == 250
    assert parse_budget("0.3", 1000) == 300


@pytest.mark.parametrize("bad", [0, -5, 0.0, -0.1, 1.5, "lots", "1.5 parsecs", "", float("nan"), True, None])
def test_parse_budget_rejects(bad):
    with pytest.raises((ValueError, TypeError)):
        parse_budget(bad, 1000)


def test_bad_budget_leaves_model_untouched(ids):
    model = small_gpt()
    before = state_of(model)
    for bad in (0, -1, "nonsense"):
        with pytest.raises(ValueError):
            plan(model, ids, budget=bad)
    assert state_of(model) == before


def test_model_without_blocks_is_a_clear_error():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    with pytest.raises(ValueError, match="no repeated blocks"):
        plan(model, torch.randn(2, 4), budget="1MiB")


# ---------------------------------------------------------------------------------------------- solver
def random_profile(rng: random.Random, blocks: int, choices: list[str], outside: bool = False) -> Profile:
    """Random bytes and times; what the part outside holds while the blocks run (``other_back``) is
    at most what it holds after forward, or not measured (None: an older profile's)."""
    held, offloaded = rng.randrange(0, 2000), rng.randrange(0, 2000)
    return Profile(
        blocks=[BlockProfile(f"b{i}", {c: rng.randrange(0, 5000) for c in choices},
                             {c: rng.randrange(0, 3000) for c in choices}, {c: rng.random() for c in choices},
                             window={c: rng.randrange(0, 2000) for c in choices if c.startswith("offload")})
                for i in range(blocks)],
        choices=choices, other_held=held, other_transient=rng.randrange(0, 2000),
        other_seconds=0.1, signature="x", prefetch=2, other_back=rng.choice([None, rng.randrange(0, held + 1)]),
        outside={"offload:disk": {"held": offloaded, "back": rng.randrange(0, offloaded + 1),
                                  "transient": rng.randrange(0, 2000),
                                  "seconds": rng.choice([0.05, 0.1, 0.3])}} if outside else {})


def raised(values: dict[str, float], order: list[str], tolerance: float) -> dict[str, float]:
    """Near-ties as the solver breaks them, written out: each value raised to that of a choice earlier
    in ``order`` at most ``tolerance`` above it."""
    out: dict[str, float] = {}
    for choice in order:
        out[choice] = max([values[choice]] + [out[d] for d in out if out[d] <= values[choice] + tolerance])
    return out


def objective(profile: Profile, assignment: list[str], outside: str) -> float:
    """What the solver minimises, written out: predicted seconds plus the risk premium of each
    offloaded block (of its fastest computing choice) and of an offloaded outside part, a choice
    counting as faster than one before it (keep, selective, recompute, offload) only beyond
    ``solver.TIE`` of that computing time."""
    keep_outside = profile.other_seconds
    outsides = {o: max(profile.other(o)[2], keep_outside if o != "keep" else 0.0)
                + (solver.RISK * keep_outside if o != "keep" else 0.0) for o in profile.outside_choices()}
    total = raised(outsides, list(outsides), solver.TIE * keep_outside)[outside]
    order = sorted(profile.choices, key=lambda c: ["keep", "selective", "recompute", "offload:disk"].index(c))
    for block, choice in zip(profile.blocks, assignment, strict=True):
        computing = min(block.seconds[c] for c in profile.choices if "offload" not in c)
        values = {c: max(block.seconds[c], block.seconds["keep"])  # no choice does less work than keep
                  + (solver.RISK * computing if "offload" in c else 0.0) for c in profile.choices}
        total += raised(values, order, solver.TIE * computing)[choice]
    return total


@pytest.mark.parametrize("risk", [True, False], ids=["risk", "time-only"])
@pytest.mark.parametrize("outside", [False, True], ids=["outside-kept", "outside-choices"])
def test_solver_is_exact_against_brute_force(outside, risk, monkeypatch):
    """Against every assignment: the least objective (time, no choice counted faster than keep, plus
    offloading's premium, near-ties raised, with it) that fits, to the solver's microsecond per block."""
    if not risk:
        monkeypatch.setattr(solver, "RISK", 0.0)
        monkeypatch.setattr(solver, "TIE", 0.0)
    rng = random.Random(0)
    choices = ["keep", "selective", "recompute", "offload:disk"]
    for _ in range(30):
        profile = random_profile(rng, rng.randrange(1, 5), choices, outside)
        assignments = [(list(a), o) for a in itertools.product(choices, repeat=len(profile.blocks))
                       for o in profile.outside_choices()]
        least = min(rounded_peak(profile, a, o) for a, o in assignments)
        assert minimum_peak(profile) == least
        for budget in (least - 1, least, least + rng.randrange(0, 8000)):
            fitting = [(a, o) for a, o in assignments if rounded_peak(profile, a, o) <= budget]
            if not fitting:
                with pytest.raises(BudgetTooSmall):
                    solve(profile, budget)
                continue
            found = solve(profile, budget)
            rounding = 1e-6 * (len(profile.blocks) + 1)
            best = min(objective(profile, a, o) for a, o in fitting)
            assert objective(profile, found.choices, found.outside) <= best + rounding
            assert found.peak == rounded_peak(profile, found.choices, found.outside) <= budget
            # rounding errs towards more memory
            assert found.peak >= profile.peak_of(found.choices, found.outside)


def test_the_heads_saved_tensors_are_not_counted_while_the_blocks_run():
    """The part outside the blocks holds its head's and loss's saved tensors (the logits) from the
    head's forward, after every block's forward, to the head's backward, before any block's: a
    block's backward meets only what it still holds then (``other_back``). Two kept blocks whose
    backward peaks above the head's time: predicted at ``other_back`` plus their peak, and planned at
    a budget the bound with every outside byte counted there refused; a profile without it (an older
    plan file, a sharded model's) is predicted as before."""
    blocks = [BlockProfile(f"b{i}", {"keep": 100}, {"keep": 2000}, {"keep": 1.0}) for i in range(2)]
    profile = Profile(blocks, ["keep"], other_held=1000, other_transient=300, other_seconds=0.1, signature="x",
                      prefetch=2, other_back=10)
    # max(10 + (100 + 100 + 2000), 1000 + (100 + 100) + 300): the second block's backward
    assert profile.peak_of(["keep", "keep"]) == 2210
    assert rounded_peak(profile, ["keep", "keep"]) >= 2210
    assert solve(profile, 2300).choices == ["keep", "keep"]
    older = dataclasses.replace(profile, other_back=None)
    assert older.peak_of(["keep", "keep"]) == 1000 + 2200
    with pytest.raises(BudgetTooSmall):
        solve(older, 2300)
    # where the head's time dominates, that is the peak
    small = [BlockProfile(f"b{i}", {"keep": 100}, {"keep": 50}, {"keep": 1.0}) for i in range(2)]
    assert dataclasses.replace(profile, blocks=small).peak_of(["keep", "keep"]) == 1000 + 200 + 300
    assert Profile.from_json(profile.to_json()).other_back == 10


def test_the_profile_measures_what_the_head_leaves_while_the_blocks_run(ids):
    """Measured on a model with a vocabulary head: what the part outside the blocks holds once the
    head's and loss's backward is over is less than what it holds after forward by the logits the
    loss saved (batch x sequence x vocabulary floats; a scalar's bytes either way), and the plan's
    tracked peak is not predicted below what its verification measured."""
    found = plan(small_gpt(), ids, budget=0.9, memory="tensors")
    profile = found.profile
    logits = ids.numel() * 128 * 4
    assert profile.other_back is not None
    assert profile.other_held - profile.other_back >= logits - 64, (profile.other_back, profile.other_held)
    assert found.measured_peak is not None and found.measured_peak <= found.peak


def test_identical_blocks_give_one_plan_whatever_the_noise_in_their_times():
    """Issue 17 item 2 in the solver: eight identical blocks (one shared profile, as the profiler
    gives them) whose keep/offload times are measured a few percent apart from run to run, or all
    slower on a loaded machine, get one plan, the keeps in one place: where the plan lies is set by
    the budget against bytes. (The previous rule, least peak within 3% of the fastest, gave two
    keeps or one here depending on the noise, and put them on different blocks.)"""
    def profile(keep: float, offload: float) -> Profile:
        held = {"keep": 42 << 20, "recompute": 1 << 20, "offload:disk": 0}
        transient = {"keep": 12 << 20, "recompute": 53 << 20, "offload:disk": 37 << 20}
        seconds = {"keep": keep, "recompute": keep * 1.42, "offload:disk": offload}
        window = {"keep": 0, "recompute": 0, "offload:disk": 9 << 20}
        blocks = [BlockProfile(f"h.{i}", held, transient, seconds, None if i == 0 else "h.0", window)
                  for i in range(8)]
        return Profile(blocks, ["keep", "recompute", "offload:disk"], 4 << 20, 1 << 20, 0.024, "x", 2,
                       outside={"offload:disk": {"held": 1 << 20, "transient": 4 << 20, "seconds": 0.036}})

    rng = random.Random(3)
    plans = set()
    for load in (1.0, 1.0, 1.1, 1.25):
        for _ in range(20):
            keep = 0.19 * load * (1 + rng.uniform(-0.03, 0.03))
            found = solve(profile(keep, keep * 1.22 * (1 + rng.uniform(-0.03, 0.03))), 121 << 20)
            plans.add((tuple(found.choices), found.outside))
    assert plans == {(("offload:disk",) * 6 + ("keep",) * 2, "keep")}


def test_outside_offload_is_chosen_only_when_it_pays():
    """The part outside the blocks is offloaded when that lets faster block choices fit, and kept
    when the budget allows (it costs time)."""
    blocks = [BlockProfile(f"b{i}", {"keep": 1000, "recompute": 100}, {"keep": 10, "recompute": 10},
                           {"keep": 1.0, "recompute": 2.0}) for i in range(3)]
    profile = Profile(blocks, ["keep", "recompute"], other_held=900, other_transient=0, other_seconds=1.0,
                      signature="x", prefetch=2,
                      outside={"offload:disk": {"held": 100, "transient": 50, "seconds": 1.5}})
    roomy = solve(profile, 5000)
    assert (roomy.choices, roomy.outside) == (["keep"] * 3, "keep")
    tight = solve(profile, 3200)  # keeping every block fits only with the outside part offloaded
    assert (tight.choices, tight.outside) == (["keep"] * 3, "offload:disk")
    assert tight.seconds == pytest.approx(4.5) and tight.peak <= 3200
    assert minimum_peak(profile) < minimum_peak(Profile(blocks, ["keep", "recompute"], 900, 0, 1.0, "x", 2))


def test_predicted_peak_bounds_held_plus_largest_transient():
    rng = random.Random(2)
    profile = random_profile(rng, 5, ["keep", "recompute"])
    for assignment in itertools.product(["keep", "recompute"], repeat=5):
        blocks = list(zip(profile.blocks, assignment, strict=True))
        simple = profile.held_of(list(assignment)) + max(
            [profile.other_transient] + [b.transient[c] for b, c in blocks])
        assert profile.held_of(list(assignment)) <= profile.peak_of(list(assignment)) <= simple


def test_solver_time_never_increases_with_budget():
    """A larger budget only adds plans: what the solver minimises never increases (the predicted time
    may, within near-ties and the floor at keep: a preferred choice that now fits is taken)."""
    rng = random.Random(1)
    profile = random_profile(rng, 6, ["keep", "selective", "recompute", "offload:disk"])
    low = minimum_peak(profile)
    found = [solve(profile, budget) for budget in range(low, low + 40000, 997)]
    times = [objective(profile, f.choices, f.outside) for f in found]
    assert all(later <= earlier + 1e-5 for earlier, later in itertools.pairwise(times))
    assert times[-1] < times[0]


def gpt2_like(selective: float, offload: float) -> Profile:
    """Eight identical blocks as planning measured HF GPT-2 8x384 (batch 2x256), ms per block:
    keep 207.7, selective 254.6, selective-alt 269.3, recompute 295.6, offload:disk ``offload``."""
    mib = 1 << 20
    held = {"keep": 31.5, "selective": 11.25, "selective-alt": 9.75, "recompute": 0.75, "offload:disk": 0}
    transient = {"keep": 9, "selective": 29.25, "selective-alt": 30.75, "recompute": 39.75, "offload:disk": 28.75}
    seconds = {"keep": 0.2077, "selective": selective, "selective-alt": 0.2693, "recompute": 0.2956,
               "offload:disk": offload}
    window = {c: int(3.75 * mib) if c == "offload:disk" else 0 for c in held}
    blocks = [BlockProfile(f"h.{i}", {c: int(v * mib) for c, v in held.items()},
                           {c: int(v * mib) for c, v in transient.items()}, seconds, None if i == 0 else "h.0", window)
              for i in range(8)]
    return Profile(blocks, list(held), int(3.26 * mib), 2 * mib, 0.0495, "x", 2,
                   outside={"offload:disk": {"held": 1 << 20, "transient": 5 << 19, "seconds": 0.0376}})


@pytest.mark.parametrize("noise", [0.002, 0.01, 0.02])
def test_a_near_tie_gives_one_plan_in_both_orders_of_the_noise(noise):
    """Issue 26 item 5: where the budget leaves one block to selective or offload:disk and the two
    are measured within noise of each other (HF GPT-2 8x384 at --budget 0.3: 254.6 against 256.1 ms,
    1.2x of keep's time apart under the tie tolerance), the plan is the same whichever is measured
    faster: the one first in the fixed order (selective). (Before: the faster by a microsecond
    won, so the plan differed between two processes and idle against busy.)"""
    selective = 0.2546
    plans = {tuple(solve(gpt2_like(selective, offload), 71 << 20).choices)
             for offload in (selective * (1 - noise), selective, selective * (1 + noise))}
    assert plans == {("offload:disk",) * 6 + ("selective", "keep")}


def test_a_choice_faster_beyond_the_tie_tolerance_still_wins():
    """Near-ties do not make plans slower beyond them: offload:disk measured clearly (8%) faster than
    selective takes the contested block, and the plan is predicted faster than the near-tie's."""
    selective, offload = 0.2546, 0.2546 * 0.92
    profile = gpt2_like(selective, offload)
    found = solve(profile, 71 << 20)
    assert found.choices == ["offload:disk"] * 7 + ["keep"]
    assert found.seconds < profile.seconds_of(["offload:disk"] * 6 + ["selective", "keep"])


# ---------------------------------------------------------------------------------------------- plan
def test_plan_fits_the_budget_when_measured(ids, half):
    model, result = half
    assert result.measured_peak is not None and result.measured_peak <= result.budget
    assert result.budget == int(0.5 * result.reference_peak)
    assert acshim.checkpointed_modules(model) == []  # planning leaves the model as it was
    result.apply(model)
    try:
        model.zero_grad(set_to_none=True)
        held, peak = measure_step(model, ids)
        assert peak <= result.budget
        assert held < peak
    finally:
        acshim.remove_checkpointing(model)
    assert acshim.checkpointed_modules(model) == []
    assert all("forward" not in block.__dict__ for block in model.h)


def test_plan_table_and_frontier(half):
    _, result = half
    text = str(result)
    for name in result.blocks:
        assert name in text
    assert "budget" in text and "measured after apply" in text
    points = result.frontier()
    assert len(points) >= 3
    for point in points:
        assert point.peak <= point.budget
    assert all(b.seconds <= a.seconds for a, b in itertools.pairwise(points))
    keep = ["keep"] * len(result.blocks)  # feasible at no checkpointing's peak: nothing slower is chosen
    assert points[-1].seconds <= result.profile.seconds_of(keep)


def test_budget_below_minimum_names_it(ids, half):
    model, result = half
    profile = result.profile
    restricted = Profile(profile.blocks, ["keep", "recompute"], profile.other_held, profile.other_transient,
                         profile.other_seconds, profile.signature, profile.prefetch)
    least = minimum_peak(restricted)
    before = state_of(model)
    with pytest.raises(ValueError, match=r"below the least achievable peak") as caught:
        plan(model, ids, budget=least // 2, memory="tensors", choices=("keep", "recompute"))
    assert f"({caught.value.minimum} bytes)" in str(caught.value)
    assert caught.value.minimum > least // 2
    assert abs(caught.value.minimum - least) < 0.1 * least  # a new profile of the same model agrees
    assert state_of(model) == before


def test_recompute_offload_is_measured_only_when_a_plan_within_reach_could_take_it(ids, monkeypatch):
    """Planning defers measuring ``recompute+offload`` (``profiler.DEFERRED``): at a generous budget
    no plan could take it, so it is left unmeasured, out of the profile, and the plan says so; a
    budget no plan meets measures it, so the least achievable peak named is the one measuring every
    choice gives; and its lower bounds hold against its measurement."""
    generous = plan(small_gpt(), ids, budget=0.9, memory="tensors")
    assert generous.profile.unmeasured == ["recompute+offload:disk"]
    assert not any(feasible(b, "recompute+offload:disk") for b in generous.profile.blocks)
    assert any(note.startswith("not measured") and "recompute+offload:disk" in note for note in generous.notes)
    with pytest.raises(BudgetTooSmall) as deferred:
        plan(small_gpt(), ids, budget=0.3, memory="tensors")

    monkeypatch.setattr(PlanSession, "_defer", lambda self: False)  # as --sweep: every choice measured
    everything = plan(small_gpt(), ids, budget=0.9, memory="tensors")
    assert everything.profile.unmeasured == [] and not any(n.startswith("not measured") for n in everything.notes)
    with pytest.raises(BudgetTooSmall) as measured:
        plan(small_gpt(), ids, budget=0.3, memory="tensors")
    # the refusal measured what was deferred, and names the least peak of the whole profile (with the
    # verification's headroom). Not compared across the two runs by value: an offload choice's
    # transient holds what its copies still have in flight when measured, which varies run to run
    for refusal in (deferred.value, measured.value):
        assert refusal.profile.unmeasured == [] and refusal.profile.choices == everything.profile.choices
        assert all(feasible(b, "recompute+offload:disk") for b in refusal.profile.blocks)
        least = math.ceil((minimum_peak(refusal.profile) + refusal.overhead) / (1 - plan_module.HEADROOM))
        assert refusal.minimum == least
    for block in everything.profile.blocks:
        in_flight = min(SharedOffload.IN_FLIGHT, 2 * block.saved)
        bound = min(block.transient["recompute"], max(block.transient["offload:disk"], in_flight))
        assert block.transient["recompute+offload:disk"] >= bound
        assert block.held["recompute+offload:disk"] >= 0


def test_every_choice_gives_bitwise_equal_gradients(ids, half):
    model, result = half
    expected = train_step(small_gpt(), ids, seed=5)
    mixed = Plan.from_choices(result, ["selective", "selective-alt", "offload:disk", "recompute+offload:disk"])
    mixed.apply(model)
    try:
        assert_bitwise_equal(expected, train_step(model, ids, seed=5))
        mixed.choices = ["recompute", "keep", "selective", "offload:disk"]
        mixed.apply(model)
        assert_bitwise_equal(expected, train_step(model, ids, seed=5))
    finally:
        acshim.remove_checkpointing(model)
    assert_bitwise_equal(expected, train_step(model, ids, seed=5))


@pytest.mark.parametrize("choice", ["keep", "recompute", "selective", "selective-alt", "offload:disk",
                                    "recompute+offload:disk"])
def test_every_choice_raises_torchs_error_for_weights_changed_before_backward(ids, half, choice):
    """An optimizer step between forward and backward (issue 28.1): each choice the planner makes
    gives torch's in-place error, as the run without checkpointing does; never gradients from the
    stepped weights."""
    model, result = half
    Plan.from_choices(result, [choice] * len(result.blocks)).apply(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        model.zero_grad(set_to_none=True)
        loss = model(ids).float().square().mean()
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
    finally:
        acshim.remove_checkpointing(model)
        with torch.no_grad():  # the module-scoped model back to its weights
            for p, original in zip(model.parameters(), small_gpt().parameters(), strict=True):
                p.copy_(original)
        model.zero_grad(set_to_none=True)


def test_outside_offload_gives_bitwise_equal_gradients_and_is_undone(ids, half):
    """The part outside the blocks offloaded (a scope around the model's forward sharing the
    offloaded blocks' schedule): gradients bitwise, kept blocks keep their tensors where they are,
    and remove_checkpointing puts the model's own forward back."""
    model, result = half
    assert "offload:disk" in result.profile.outside
    expected = train_step(small_gpt(), ids, seed=5)
    kept = Plan.from_choices(result, ["keep"] * 4)
    model.zero_grad(set_to_none=True)
    held_kept, _ = measure_step(model, ids)
    for choices in (["keep"] * 4, ["keep", "recompute", "offload:disk", "selective"]):
        mixed = Plan.from_choices(result, choices, outside="offload:disk")
        mixed.apply(model)
        try:
            assert "forward" in model.__dict__
            assert_bitwise_equal(expected, train_step(model, ids, seed=5))
            if choices == ["keep"] * 4:
                model.zero_grad(set_to_none=True)
                held, _ = measure_step(model, ids)
                assert held < held_kept  # something outside the blocks went to disk
                # the kept blocks' own tensors did not: their bytes are still all held
                outside_before = held_kept - sum(b.held["keep"] for b in result.profile.blocks)
                assert held >= held_kept - outside_before
                assert mixed.held < kept.held and mixed.seconds > kept.seconds
        finally:
            acshim.remove_checkpointing(model)
        assert "forward" not in model.__dict__ and acshim.checkpointed_modules(model) == []
    assert_bitwise_equal(expected, train_step(model, ids, seed=5))
    with pytest.raises(ValueError, match="not profiled"):
        Plan.from_choices(result, ["keep"] * 4, outside="offload:host")


def test_planning_a_model_with_an_outside_offload_plan_applied(ids, half):
    """Planning again a model that has a plan with the outside part offloaded applied measures the
    model as it is without the plan, and leaves the applied plan in place."""
    model, result = half
    result = plan(model, ids, budget=0.5, memory="tensors", choices=("keep", "recompute", "offload"))  # as it is
    applied = Plan.from_choices(result, ["recompute"] * 4, outside="offload:disk")
    applied.apply(model)
    try:
        again = plan(model, ids, budget=0.5, memory="tensors", choices=("keep", "recompute", "offload"))
        assert again.profile.recompute_step["saved"] == result.profile.recompute_step["saved"]
        for before, now in zip(result.profile.blocks, again.profile.blocks, strict=True):
            assert now.held == before.held
        assert again.profile.other_held == pytest.approx(result.profile.other_held, rel=0.02)
        assert isinstance(model.__dict__["forward"], OffloadedForward)
        assert len(acshim.checkpointed_modules(model)) == 5
    finally:
        acshim.remove_checkpointing(model)


def test_save_load_round_trip_and_other_model(tmp_path, ids, half):
    model, result = half
    path = tmp_path / "plan.json"
    result.save(path)
    loaded = acshim.Plan.load(path)
    assert loaded.choices == result.choices and loaded.peak == result.peak and str(loaded) == str(result)
    assert loaded.outside == result.outside and loaded.profile.outside == result.profile.outside
    fresh = small_gpt()
    loaded.apply(fresh)
    assert len(acshim.checkpointed_modules(fresh)) == sum(c != "keep" for c in result.choices)
    acshim.remove_checkpointing(fresh)
    other = seeded(lambda: GPT(layers=4, width=32, heads=4, seq=32, vocab=128))
    before = state_of(other)
    with pytest.raises(ValueError, match="another model"):
        loaded.apply(other)
    assert state_of(other) == before
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(ValueError, match="not an acshim plan"):
        Plan.load(tmp_path / "junk.json")


def test_plan_measured_over_budget_is_re_solved(ids, monkeypatch):
    model = small_gpt()
    real = RegionProfiler.verify
    calls = []

    _budget = [0]
    base = plan(model, ids, budget=1.0, memory="tensors", verify=False)
    _budget[0] = int(0.6 * base.reference_peak)

    def over_once(self, choices, outside, *in_flight):
        found = real(self, choices, outside, *in_flight)
        calls.append(choices)
        if len(calls) == 1:
            found.peak = _budget[0] + 50_000
        return found

    monkeypatch.setattr(RegionProfiler, "verify", over_once)
    result = plan(model, ids, budget=0.6, memory="tensors", choices=("keep", "recompute", "selective"), reuse=base)
    assert len(calls) >= 2
    assert result.measured_peak <= result.budget
    assert result.peak <= result.budget - 50_000  # re-solved under a budget tightened by the error
    assert any("re-solved" in note for note in result.notes)


def test_offloading_plans_that_stay_over_budget_fall_back_to_recompute(ids, monkeypatch):
    """Copies in flight to a slow tier (a loaded machine) can keep every offloading candidate over
    budget however it is tightened: the choices that offload nothing are solved once more."""
    model = small_gpt()
    real = RegionProfiler.verify
    measured = []
    budgets = []

    def slow_tier(self, choices, outside, *in_flight):
        found = real(self, choices, outside, *in_flight)
        offloads = outside != "keep" or any("offload" in c for c in choices)
        measured.append(offloads)
        if offloads:
            found.peak = budgets[0] + 10_000
        return found

    base = plan(model, ids, budget=1.0, memory="tensors", verify=False)
    # the outside part kept or offloaded only (a chunked head offloads nothing and would be chosen first)
    base.profile.outside = {k: v for k, v in base.profile.outside.items() if split_outside(k)[1] is None}
    for block in base.profile.blocks:  # offloading is the fastest choice wherever it fits (its risk premium too)
        block.seconds.update({c: 0.0 if "offload" in c else 1.0 for c in block.seconds if c != "keep"})
    without = [c for c in base.profile.choices if "offload" not in c]
    # room for the offloading plans (their copies in flight count) and for some that offload nothing
    budget = max(int(1.05 * minimum_peak(dataclasses.replace(base.profile, choices=without, outside={}))),
                 int(1.3 * rounded_peak(base.profile, ["offload:disk"] * 4, "offload:disk")))
    budgets.append(budget)
    monkeypatch.setattr(RegionProfiler, "verify", slow_tier)
    result = plan(model, ids, budget=budget, reuse=base, memory="tensors")
    assert measured[0] and not measured[-1]  # offload was planned first, and measured over
    assert result.measured_peak <= result.budget and "offload" not in result.outside
    assert not any("offload" in c for c in result.choices)  # tightened past offloading, or solved without it
    def never(self, choices, outside, *in_flight):
        found = real(self, choices, outside, *in_flight)
        found.peak = 10**12  # nothing ever fits
        return found

    monkeypatch.setattr(RegionProfiler, "verify", never)
    with pytest.raises(ValueError, match="no plan measured within the budget"):
        plan(model, ids, budget=budget, reuse=base, memory="tensors")


def test_re_solves_that_tighten_past_the_least_plan_measure_it_before_refusing(ids, monkeypatch):
    """A plan measured over budget tightens the next solve by how far over it went; where that is
    below the least plan (the frontier's start), the least plan is measured before the budget is
    refused: it may fit where the faster plans' predictions were low (issue 26 item 2: a refusal
    naming a budget then refused again). Where it does not fit either, ``NoPlanMeasured`` names
    what it measured as a budget (its headroom and margin on top)."""
    model = small_gpt()
    base = plan(model, ids, budget=1.0, memory="tensors", verify=False)
    least = solve(base.profile, minimum_peak(base.profile))
    real = RegionProfiler.verify
    tried = []

    def only_the_least_fits(self, choices, outside, *in_flight):
        found = real(self, choices, outside, *in_flight)
        tried.append((list(choices), outside))
        if (list(choices), outside) != (least.choices, least.outside):
            found.peak = 10**12  # far over: the next solve's target is below the least plan
        return found

    monkeypatch.setattr(RegionProfiler, "verify", only_the_least_fits)
    budget = int(2 * minimum_peak(base.profile))
    result = plan(model, ids, budget=budget, reuse=base, memory="tensors")
    assert (result.choices, result.outside) == (least.choices, least.outside) and len(tried) == 2, tried
    assert result.measured_peak <= result.budget

    def least_over_too(self, choices, outside, *in_flight):
        found = only_the_least_fits(self, choices, outside, *in_flight)
        if (list(choices), outside) == (least.choices, least.outside):
            found.peak = 3 * budget
        return found

    monkeypatch.setattr(RegionProfiler, "verify", least_over_too)
    with pytest.raises(NoPlanMeasured, match="no plan measured within the budget") as refused:
        plan(model, ids, budget=budget, reuse=base, memory="tensors")
    assert refused.value.least_seen == 3 * budget
    assert refused.value.suggested == math.ceil(3 * budget / (1 - HEADROOM) * (1 + BudgetTooSmall.MARGIN))


def test_plan_file_saves_the_plan_then_returns_it_without_profiling(ids, tmp_path, monkeypatch):
    """``acshim.plan(..., plan_file=F)`` as ``acshim run --plan-file F``: the first call plans and
    saves; the next returns the saved plan without running a measurement, and it applies with the
    same gradients; another budget or batch shape is refused naming what differs."""
    path = tmp_path / "plan.json"
    first = plan(small_gpt(), ids, budget=0.5, memory="tensors", plan_file=path)
    assert path.exists()

    def no_profiling(*args, **kwargs):
        raise AssertionError("profiled again")

    monkeypatch.setattr(RegionProfiler, "__init__", no_profiling)
    monkeypatch.setattr(RegionProfiler, "verify", no_profiling)
    model = small_gpt()
    again = plan(model, ids, budget=0.5, memory="tensors", plan_file=str(path))
    assert (again.choices, again.outside, again.budget, again.peak) == (first.choices, first.outside, first.budget,
                                                                        first.peak)
    plain = train_step(small_gpt(), ids)
    again.apply(model)
    assert_bitwise_equal(plain, train_step(model, ids))
    with pytest.raises(acshim.planner.PlanFileMismatch, match="made for a budget of .*delete the file to plan again"):
        plan(small_gpt(), ids, budget=0.4, memory="tensors", plan_file=path)
    larger = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(3))
    with pytest.raises(acshim.planner.PlanFileMismatch, match=r"made for inputs of shapes \[\[2, 32\]\]"):
        plan(small_gpt(), larger, budget=0.5, memory="tensors", plan_file=path)
    with pytest.raises(acshim.planner.PlanFileMismatch, match="made for another model"):
        plan(seeded(lambda: GPT(layers=4, width=32, heads=4, seq=32, vocab=128)), ids, budget=0.5,
             memory="tensors", plan_file=path)
    # a pipeline stage's plan: its budget is one microbatch's share of the budget asked, which is checked
    stage = tmp_path / "plan.stage1.json"
    assert plan_module.stage_plan_file(str(path), 1) == str(stage)
    first.asked, first.budget = "0.5", first.budget // 3
    first.save(stage)
    assert plan_module.load_plan_file(str(stage), small_gpt(), 0.5, [[2, 32]]).budget == first.budget
    with pytest.raises(acshim.planner.PlanFileMismatch, match="made for --budget 0.5, this run asks for 0.4"):
        plan_module.load_plan_file(str(stage), small_gpt(), 0.4, [[2, 32]])
    with pytest.raises(TypeError, match="plan_file must be a path"):
        plan(small_gpt(), ids, budget=0.5, plan_file=3)
    with pytest.raises(ValueError, match="pass reuse= .* or plan_file="):
        plan(small_gpt(), ids, budget=0.5, plan_file=path, reuse=first)


def test_expand_choices():
    assert expand_choices(("keep", "offload"), ("host", "disk")) == ["keep", "offload:host", "offload:disk"]
    with pytest.raises(ValueError, match="unknown planner choice"):
        expand_choices(("sometimes",), ("disk",))


def test_offloaded_blocks_share_one_schedule(ids, half):
    """Offloaded blocks share one schedule, as one acshim.offload() around the step: only its last
    tensors stay resident when forward ends (a schedule per block kept each block's last ones)."""
    model, result = half
    profile = result.profile
    offloaded = Plan.from_choices(result, ["offload:disk"] * 4)
    offloaded.apply(model)
    try:
        scopes = {id(block.forward.scope) for block in model.h}
        # copies to disk land when the writer thread gets the CPU: under load one more tensor can
        # still be in flight at the peak. Settling each copy before the next pack measures what the
        # schedule keeps resident, the quantity the plan predicts (plan() verifies the real timing).
        model.h[0].forward.scope.session.max_bytes_in_flight = 0
        model.zero_grad(set_to_none=True)
        held, peak = measure_step(model, ids)
    finally:
        acshim.remove_checkpointing(model)
    assert len(scopes) == 1
    window = profile.window()
    assert window > 0
    assert held <= profile.other_held + window + 4 * profile.blocks[0].held["offload:disk"] + 64 * 1024
    assert peak <= offloaded.peak  # the in-context profile does not under-predict


def test_block_profile_counts_a_kept_input_once(half):
    """A block's held bytes under full recompute are its saved input only: its output (the next
    block's input) and the incoming gradient are not counted again."""
    _, result = half
    input_bytes = 2 * 32 * 64 * 4
    for block in result.profile.blocks:
        assert input_bytes <= block.held["recompute"] < 1.5 * input_bytes
    assert result.profile.other_held > 0


def test_outside_part_measured_alone_predicts_the_held_bytes(ids, half):
    """What lies outside the blocks is measured with the blocks replaying their outputs: with the
    blocks' own profiles it predicts what a whole step holds when forward ends, kept or offloaded."""
    model, result = half
    for choices in (["keep"] * 4, ["recompute"] * 4):
        for outside in ("keep", "offload:disk"):
            predicted = Plan.from_choices(result, choices, outside)
            predicted.apply(model)
            try:
                if outside != "keep":  # each copy out settled before the next: no write still in flight
                    model.forward.scope.session.max_bytes_in_flight = 0  # is counted (machine load)
                model.zero_grad(set_to_none=True)
                held, peak = measure_step(model, ids)
            finally:
                acshim.remove_checkpointing(model)
            assert held == pytest.approx(predicted.held, rel=0.02), (choices, outside)
            assert peak <= predicted.peak * 1.01, (choices, outside)
    assert result.profile.outside["offload:disk"]["held"] < result.profile.other_held


def test_captured_copies_are_made_once_per_tensor():
    """A block's output is the next block's input: profiling keeps one copy of it, not two."""
    copies = Copies()
    hidden = torch.randn(3, 4, requires_grad=True) * 2
    output, following = copies((hidden, "aux")), copies(((hidden,), {"mask": None}))
    assert output[0] is following[0][0] and output[1] == "aux"
    assert torch.equal(output[0], hidden) and not output[0].requires_grad
    assert copies(hidden.clone()) is not output[0]
    with torch.no_grad():
        hidden.mul_(3)  # changed in place between two blocks: copied again, as it is now
    changed = copies(hidden)
    assert changed is not output[0] and torch.equal(changed, hidden)


def test_replay_stands_in_for_a_block_in_forward_and_backward():
    x = torch.randn(3, 4, requires_grad=True)
    recorded = (torch.randn(3, 4), torch.arange(3), "tag")
    out = replay(recorded, (x * 2,), {"mask": None})
    assert out[2] == "tag" and torch.equal(out[0], recorded[0]) and out[0] is not recorded[0]
    assert out[0].requires_grad and not out[1].requires_grad
    out[0].sum().backward()
    assert torch.equal(x.grad, torch.full((3, 4), 2.0))  # the incoming gradient, passed on
    other = torch.randn(5, requires_grad=True)
    replay(torch.randn(2), (other,), {}).sum().backward()
    assert torch.equal(other.grad, torch.zeros(5))  # no gradient of its shape: zeros
    assert replay(torch.randn(2), (torch.randn(2),), {}).requires_grad  # as the block's parameters made it


class _StatefulBlock(torch.nn.Module):
    """BatchNorm statistics, a call counter and auxiliary values appended in forward: state a
    planner running blocks many times must leave as it found it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn = torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32)
        self.calls, self.aux = 0, []

    def forward(self, x):
        self.calls += 1
        self.aux.append(x.detach().mean())
        return x + self.bn(self.lin(x)).relu()


class _StatefulNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_StatefulBlock() for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("planner", ["acshim.plan", "session"])
def test_planning_leaves_buffers_and_module_state_as_it_found_them(planner):
    """acshim.plan used to leave BatchNorm running statistics (and any state forward changes)
    advanced by every profiling run; the run_region session restored buffers but not module state."""
    from acshim.planner.session import PlanSession

    torch.manual_seed(0)
    model, x = _StatefulNet(), torch.randn(16, 32)
    aux_lists = [block.aux for block in model.blocks]
    if planner == "acshim.plan":
        before = {k: v.clone() for k, v in model.state_dict().items()}
        plan(model, x, budget=0.9, memory="tensors")
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert [(b.calls, len(b.aux)) for b in model.blocks] == [(0, 0)] * 4
    else:
        reference = _StatefulNet()
        reference.load_state_dict(model.state_dict())
        reference(x).sum().backward()
        acshim.apply_checkpointing(model)
        session = PlanSession(0.9, memory="tensors").start()
        try:
            model(x).sum().backward()  # planned inside this step, which then runs on
        finally:
            session.stop()
        assert session.plan is not None
        assert all(torch.equal(v, reference.state_dict()[k]) for k, v in model.state_dict().items())
        # one step: one forward per block, plus one per recompute of the blocks the plan recomputes
        recomputed = [c != "keep" for c in session.plan.choices]
        assert [b.calls for b in model.blocks] == [1 + r for r in recomputed]
    assert [block.aux for block in model.blocks] == aux_lists  # the same list objects


def test_plan_with_outside_offload_compiles_with_bitwise_gradients(ids, half):
    """A plan offloading the outside part, with kept, recomputed, offloaded and selective blocks,
    under torch.compile: gradients bitwise those of eager no checkpointing."""
    _, result = half
    expected = train_step(small_gpt(), ids, seed=5)
    model = small_gpt()
    Plan.from_choices(result, ["keep", "recompute", "offload:disk", "selective"], outside="offload:disk").apply(model)
    compiled = torch.compile(model, backend="aot_eager")
    got = train_step(compiled, ids, seed=5)
    assert_bitwise_equal(expected, {name.replace("_orig_mod.", ""): value for name, value in got.items()})


def test_planning_leaves_the_garbage_collector_as_it_found_it(ids):
    """Planning freezes what the script holds (its collections then walk only planning's objects) and
    unfreezes it, also when it fails; a script's own freeze is left alone."""
    plan(small_gpt(), ids, budget=0.9, memory="tensors")
    assert gc.get_freeze_count() == 0
    with pytest.raises(BudgetTooSmall):
        plan(small_gpt(), ids, budget=0.05, memory="tensors")
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        plan(small_gpt(), ids, budget=0.9, memory="tensors")
        assert 0 < gc.get_freeze_count() <= frozen  # not unfrozen, nothing of planning frozen
    finally:
        gc.unfreeze()


def test_an_offloading_plan_lets_copies_be_in_flight_up_to_the_room_its_budget_leaves(tmp_path, half):
    """The profiles count ``SharedOffload.IN_FLIGHT`` bytes of copies in flight; a plan with room under
    its budget lets up to ``MAX_IN_FLIGHT`` be in flight (forward waits less on the tier), counts the
    extra in its predicted peak, applies it to the schedule it installs, and keeps it in its file; a
    plan with no room keeps the profiles' own bound."""
    model, result = half
    profile = result.profile
    assert "offload:disk" in profile.choices
    # a profile where offloading every block is the fastest choice (keep left out: nothing is counted
    # faster than it), so the solver takes it at every budget
    fast = dataclasses.replace(profile, outside={}, choices=[c for c in profile.choices if c != "keep"], blocks=[
        dataclasses.replace(b, seconds={c: 0.0 if c in ("keep", "offload:disk") else 1.0 for c in b.seconds})
        for b in profile.blocks])
    peak = rounded_peak(fast, ["offload:disk"] * 4, "keep")
    accept = 1 - plan_module.HEADROOM
    roomy = plan_module.solve_within(fast, int((peak + (8 << 20)) / accept) + 1, None)
    tight = plan_module.solve_within(fast, int(peak / accept) + 1, None)
    some = plan_module.solve_within(fast, int((peak + (1 << 20)) / accept) + 1, None)
    assert roomy.choices == tight.choices == some.choices == ["offload:disk"] * 4
    assert roomy.in_flight == SharedOffload.MAX_IN_FLIGHT and roomy.peak <= roomy.budget
    assert tight.in_flight == SharedOffload.IN_FLIGHT
    assert SharedOffload.IN_FLIGHT < some.in_flight < SharedOffload.MAX_IN_FLIGHT
    # the extra is in the prediction where copies can be in flight (on CPU, an offloaded block's forward)
    def rise(extra: int) -> int:
        return fast.peak_of(some.choices, some.outside, extra) - fast.peak_of(some.choices, some.outside)

    assert 0 <= some.peak - tight.peak == rise(some.in_flight - SharedOffload.IN_FLIGHT) <= some.in_flight - tight.in_flight
    assert "copies out in flight: up to" in str(roomy) and "copies out in flight" not in str(tight)
    roomy.apply(model)
    try:
        (scope,) = {id(block.forward.scope): block.forward.scope for block in model.h}.values()
        assert scope.session.max_bytes_in_flight == SharedOffload.MAX_IN_FLIGHT
    finally:
        acshim.remove_checkpointing(model)
    # a verification that measured the tight plan below its prediction widens it by the room measured
    from acshim.planner.profiler import Verification

    measured = plan_module.solve_within(fast, tight.budget, lambda c: Verification(0, 0, c.peak - (2 << 20), 1.0))
    assert SharedOffload.IN_FLIGHT + (2 << 20) <= measured.in_flight <= SharedOffload.IN_FLIGHT + (2 << 20) + 64
    assert measured.peak - tight.peak == rise(measured.in_flight - SharedOffload.IN_FLIGHT)
    over = plan_module.solve_within(fast, roomy.budget, lambda c: Verification(0, 0, 0, 1.0))
    assert over.in_flight == SharedOffload.MAX_IN_FLIGHT  # never beyond the tier's own bound
    roomy.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").in_flight == SharedOffload.MAX_IN_FLIGHT
    # a plan that offloads nothing has no schedule: nothing in flight beyond the profiles, whatever the room
    assert plan_module._extra_in_flight(profile, solver.Solution(["keep"] * 4, 0, 0, 0.0), 1 << 40) == (0, 0)
    assert plan_module._extra_in_flight(profile, solver.Solution(["keep"] * 4, 0, 0, 0.0, "offload:disk"), 1 << 40)[0] > 0


class _ScratchInBackward(torch.autograd.Function):
    """Saves its input; its backward makes a 16 MiB scratch tensor (as reading an offloaded block's
    tensors back and its gradients do) before it returns."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        scratch = torch.ones(4 << 20)
        return grad * 2 + scratch[:1].sum() * 0 * x


def _scratch_in_forward(x: torch.Tensor) -> torch.Tensor:
    scratch = torch.ones(4 << 20)  # 16 MiB made and freed in forward
    return x * 2 + scratch[:1].sum() * 0


@pytest.mark.parametrize("phase", ["backward", "forward"])
def test_copies_in_flight_are_charged_to_the_forward_peak_only(phase):
    """A block alone is measured with its forward's peak apart: copies to a tier still in flight are
    added to it (up to the tier's bound), never to a peak in backward, whose reads wait for the
    copies (adding them there predicted HF GPT-2 8x384's all-disk plan 31% above its measured step)."""
    from acshim.planner.profile import measure_choice, with_copies_in_flight

    block = _ScratchInBackward.apply if phase == "backward" else _scratch_in_forward
    x = torch.randn(256, 256)
    found = measure_choice(block, (x,), {}, [True], set(), lambda: set(), lambda: None, None)
    in_flight = 4 << 20
    if phase == "backward":
        assert found.forward < (1 << 20) <= (16 << 20) <= found.transient
        assert with_copies_in_flight(found, in_flight) == found.transient
    else:
        assert found.forward >= 16 << 20
        assert with_copies_in_flight(found, in_flight) == found.forward + in_flight


def test_copies_in_flight_beyond_the_profiles_are_counted_only_where_they_can_be(ids, half):
    """Issue 26 item 2: an offloaded block's scope waits at its exit for the copies out that may fail
    (every copy on CPU), so the blocks after it and the head's backward meet none of the copies a plan
    lets be in flight beyond the profiles' own: the prediction adds them to the offloaded blocks'
    forward only (it added them to the whole peak), and stays an upper bound of the step run with
    that many in flight."""
    model, result = half
    profile = result.profile
    assert profile.copies_outlive_blocks is False  # recorded by the profiler: every tier on CPU is waited for
    cautious = dataclasses.replace(profile, copies_outlive_blocks=True)
    extra = SharedOffload.MAX_IN_FLIGHT - SharedOffload.IN_FLIGHT
    assert all("offload:disk" in block.forward for block in profile.blocks)
    choices = ["offload:disk", "offload:disk", "keep", "keep"]
    base = profile.peak_of(choices)
    assert base == cautious.peak_of(choices)  # the profiles' own copies: counted as before
    assert cautious.peak_of(choices, "keep", extra) == base + extra
    rise = profile.peak_of(choices, "keep", extra) - base
    assert 0 <= rise < extra  # the peak comes in the kept blocks' backward, where no copy is in flight
    # where the part outside the blocks is offloaded, every block runs inside its scope: counted whole
    assert profile.peak_of(choices, "offload:disk", extra) == profile.peak_of(choices, "offload:disk") + extra
    planned = Plan.from_choices(result, choices)
    planned.in_flight, planned.peak = SharedOffload.MAX_IN_FLIGHT, base + rise
    planned.apply(model)
    try:
        assert model.h[0].forward.scope.session.max_bytes_in_flight == SharedOffload.MAX_IN_FLIGHT
        model.zero_grad(set_to_none=True)
        _, peak = measure_step(model, ids)
    finally:
        acshim.remove_checkpointing(model)
    assert peak <= planned.peak


def test_copies_outlive_blocks_where_the_backend_does_not_wait_for_them(monkeypatch):
    """Which tiers' copies outlive their block is the backend's answer (``copy_out_can_fail``): on a
    CUDA device the host tier's copies are not waited for, the disk tier's are."""
    from acshim.planner import choices as choices_module

    class DeviceLike:
        def copy_out_can_fail(self, tier) -> bool:
            return tier.kind == "disk"  # as backends/cuda.py

    cpu = torch.device("cpu")
    assert not choices_module.copies_outlive_blocks(["keep", "offload:disk"], cpu)
    assert not choices_module.copies_outlive_blocks(["keep", "recompute"], cpu)
    monkeypatch.setattr(choices_module, "backend_for", lambda device: DeviceLike())
    assert choices_module.copies_outlive_blocks(["keep", "offload:host", "offload:disk"], cpu)
    assert not choices_module.copies_outlive_blocks(["keep", "offload:disk"], cpu)
