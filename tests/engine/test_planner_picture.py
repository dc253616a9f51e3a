"""``acshim plan --png`` / ``acshim run --budget B --png``: one step's predicted activation memory,
block by block, for no checkpointing, full recompute and the plan, the budget as a line, beside the
frontier (issue 18 item 7). Checked by reading the picture back: its size, and where each colour is."""

from __future__ import annotations

from pathlib import Path

import pytest

import acshim
from acshim.planner import picture
from acshim.testing import GPT, seeded


@pytest.fixture(scope="module")
def plan() -> acshim.Plan:
    import torch

    model = seeded(lambda: GPT(layers=4, width=64, heads=4, seq=32, vocab=128))
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))
    base = acshim.plan(model, ids, budget=0.5, choices=("keep", "selective", "recompute"), verify=False,
                       memory="tensors")  # a tiny model: its tensors (the process resolves 1 MiB)
    # fixed choices: the curves depend on measured bytes only (exact), not on timings (noisy)
    fixed = acshim.Plan.from_choices(base, ["recompute", "recompute", "selective", "keep"])
    fixed.budget = base.budget
    assert fixed.peak <= fixed.budget < fixed.reference_peak
    return fixed


def test_timeline_peaks_where_the_solver_predicts(plan: acshim.Plan) -> None:
    profile = plan.profile
    for assignment, outside in ((plan.choices, plan.outside), (["keep"] * 4, "keep"), (["recompute"] * 4, "keep")):
        points = picture.timeline(profile, assignment, outside)
        assert max(size for _, size in points) == profile.peak_of(assignment, outside)
        assert points[0] == ("start", 0) and [label for label, _ in points].count("head+loss") == 1
        assert len(points) == 3 + 3 * len(profile.blocks)


def _pixels(path: Path, colour: str):
    import matplotlib.image
    import numpy as np

    image = matplotlib.image.imread(path)[..., :3]
    rgb = np.array([int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return image, np.abs(image - rgb).max(axis=-1) < 0.02


def test_png_draws_the_three_curves_under_and_over_the_budget_line(plan: acshim.Plan, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import numpy as np

    path = tmp_path / "plan.png"
    assert picture.write_png(plan, str(path)) == f"wrote {path}"
    image, budget = _pixels(path, picture.COLOURS["budget"])
    width = int(picture.SIZE_INCHES[0] * picture.DPI)
    assert image.shape[:2] == (int(picture.SIZE_INCHES[1] * picture.DPI), width)
    left = slice(0, int(width * 0.55))  # the step panel (3/5 of the width, axes inside it)
    rows = np.flatnonzero(budget[:, left].sum(axis=1) > 0.3 * (left.stop - left.start) / 2)
    assert len(rows) >= 1, "no horizontal budget line in the step panel"
    line = rows.mean()
    _, green = _pixels(path, picture.COLOURS["plan"])
    _, grey = _pixels(path, picture.COLOURS["none"])
    _, blue = _pixels(path, picture.COLOURS["recompute"])
    green_rows = np.flatnonzero(green[:, left].any(axis=1))
    grey_rows = np.flatnonzero(grey[:, left].any(axis=1))
    # legend swatches sit in the upper left corner: read the curves right of it
    curves = slice(int(width * 0.3), left.stop)
    assert green[:, curves].any() and grey[:, curves].any() and blue[:, curves].any()
    assert plan.profile.peak_of(["recompute"] * 4) < plan.peak  # full recompute's curve lies lowest
    assert np.flatnonzero(blue[:, curves].any(axis=1)).min() > np.flatnonzero(green[:, curves].any(axis=1)).min()
    plan_top = np.flatnonzero(green[:, curves].any(axis=1)).min()
    none_top = np.flatnonzero(grey[:, curves].any(axis=1)).min()
    assert plan_top > line + 2, "the plan's curve reaches above the budget line"  # rows grow downwards
    assert plan.reference_peak > plan.budget and none_top < line - 2, "no checkpointing's peak is above the budget"
    assert len(green_rows) and len(grey_rows)
    # the frontier panel: the plan's points, and the budget as a vertical line
    right = slice(int(width * 0.62), width)
    assert green[:, right].any()
    columns = np.flatnonzero(budget[:, right].sum(axis=0) > 20)
    assert len(columns) >= 1, "no vertical budget line in the frontier panel"


def _line_rows(path: Path, colour: str, columns: slice):
    import numpy as np

    _, found = _pixels(path, colour)
    return np.flatnonzero(found[:, columns].sum(axis=1) > 0.15 * (columns.stop - columns.start))


def test_png_draws_the_predicted_and_the_measured_peak_once_verified(plan: acshim.Plan, tmp_path: Path) -> None:
    """Issue 26 item 2: ``--png`` draws the whole step's predicted peak and the measured one as lines,
    where they are (here a measurement below the prediction and one above it); an unverified plan
    has neither."""
    pytest.importorskip("matplotlib")
    import copy

    width = int(picture.SIZE_INCHES[0] * picture.DPI)
    step_panel = slice(0, int(width * 0.55))
    unverified = tmp_path / "unverified.png"
    picture.write_png(plan, str(unverified))
    assert not len(_line_rows(unverified, picture.COLOURS["measured"], step_panel))
    rows = {}
    for name, share in (("low", 0.6), ("high", 0.95)):
        verified = copy.copy(plan)
        verified.overhead = plan.budget // 10
        verified.measured_peak, verified.measured_process_peak = None, int(plan.budget * share)
        path = tmp_path / f"{name}.png"
        picture.write_png(verified, str(path))
        measured = _line_rows(path, picture.COLOURS["measured"], step_panel)
        predicted = _line_rows(path, picture.COLOURS["predicted"], step_panel)
        budget = _line_rows(path, picture.COLOURS["budget"], step_panel)
        assert len(measured) and len(predicted) and len(budget), name
        rows[name] = measured.mean(), predicted.mean(), budget.mean()
    # rows grow downwards: the higher measurement is drawn higher, and above the prediction
    assert rows["high"][0] < rows["low"][0] - 5
    whole = plan.peak + plan.budget // 10
    assert (rows["high"][0] < rows["high"][1]) == (0.95 * plan.budget > whole)
    assert (rows["low"][0] < rows["low"][1]) == (0.6 * plan.budget > whole)
