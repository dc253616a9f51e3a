"""The plan as a picture: one step's activation memory over time, block by block, for no
checkpointing, full recompute and the plan, the budget as a line, beside the frontier.

The curves are the solver's own model of a step (``solver`` module docstring), from the block
profile, so each curve's highest point is the peak predicted for it: forward adds each block's held
bytes; the part outside the blocks (head, loss) then adds its held and transient bytes; backward
runs the blocks in reverse, each at the bytes of the blocks before it plus its own transient (and
the shared offload window where it applies), dropping its held bytes when done.
"""

from __future__ import annotations

from .budget import format_bytes
from .choices import is_offload
from .profile import Profile

MiB = 2**20
COLOURS = {"none": "#7f7f7f", "recompute": "#1f77b4", "plan": "#2ca02c", "budget": "#d62728", "selective": "#9467bd",
           "offload": "#ff7f0e", "predicted": "#17becf", "measured": "#8c564b"}
"""Fixed colours (the tests read them back from the picture): no checkpointing grey, full recompute
blue, the plan green, the budget red; the plan's whole-step prediction cyan and its measured peak
brown (horizontal lines, drawn once the plan was verified)."""
SIZE_INCHES, DPI = (12.0, 4.5), 100


def timeline(profile: Profile, assignment: list[str], outside: str = "keep") -> list[tuple[str, int]]:
    """``(label, live bytes)`` at each point of one predicted step; its maximum is
    ``profile.peak_of(assignment, outside)``."""
    other_held, other_transient, _ = profile.other(outside)
    back = profile.back(outside)  # what the part outside holds while the blocks run
    window, first = profile.window(), is_offload(outside)
    points = [("start", 0)]
    prefix, seen, prefixes, extras = 0, False, [], []
    for block, choice in zip(profile.blocks, assignment, strict=True):
        prefix += block.held[choice]
        extras.append(window if (seen or first) and not is_offload(choice) else 0)
        seen = seen or is_offload(choice)
        prefixes.append(prefix)
        points.append((f"fwd {block.name}", back + prefix))
    points.append(("head+loss", other_held + prefix + other_transient + (window if seen else 0)))
    points.append(("forward end", other_held + prefix))
    for index in reversed(range(len(profile.blocks))):
        block, choice = profile.blocks[index], assignment[index]
        points.append((f"bwd {block.name}", back + prefixes[index] + block.transient[choice] + extras[index]))
        points.append((f"after {block.name}", back + prefixes[index] - block.held[choice]))
    return points


def write_png(plan: object, path: str) -> str:
    """Draw ``plan``'s memory over one step (no checkpointing, full recompute, the plan, the budget)
    and its frontier to ``path``; needs matplotlib (``pip install 'acshim[plot]'``). Returns a line
    saying what was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"--png {path}: matplotlib is not installed (pip install 'acshim[plot]'); no figure written"
    from .report import baseline_point, baselines  # the frontier's baselines, as the table shows them

    profile: Profile = plan.profile  # type: ignore[attr-defined]
    figure, (steps, frontier) = plt.subplots(1, 2, figsize=SIZE_INCHES, dpi=DPI,
                                             gridspec_kw={"width_ratios": [3, 2]})
    curves = [("none", ["keep"] * len(profile.blocks), "keep")] if all("keep" in b.held for b in profile.blocks) else []
    curves.append(("recompute", profile.uniform("recompute"), "keep"))
    curves.append(("plan", list(plan.choices), plan.outside))  # type: ignore[attr-defined]
    labels: list[str] = []
    for name, assignment, outside in curves:
        points = timeline(profile, assignment, outside)
        labels = [label for label, _ in points]
        peak = max(size for _, size in points)
        steps.step(range(len(points)), [size / MiB for _, size in points], where="post", color=COLOURS[name],
                   linewidth=2.5 if name == "plan" else 1.8, zorder=2 if name == "plan" else 3,
                   label=f"{'no checkpointing' if name == 'none' else 'full recompute' if name == 'recompute' else 'plan'}"
                         f" (peak {format_bytes(peak)})")
    budget = plan.budget  # type: ignore[attr-defined]
    steps.axhline(budget / MiB, color=COLOURS["budget"], linestyle="--", linewidth=1.8,
                  label=f"budget {format_bytes(budget)}")
    _draw_prediction_and_measurement(steps, plan)
    ticks = [i for i, label in enumerate(labels) if label in ("start", "head+loss") or label.startswith("bwd")]
    steps.set_xticks(ticks, [_short(labels[i]) for i in ticks], rotation=60, fontsize=7)
    steps.set_ylabel("MiB (curves: predicted activations)")
    steps.set_title("one training step, block by block")
    steps.set_ylim(bottom=0)
    steps.legend(fontsize=8, loc="upper left")

    ref_peak, ref_seconds = plan.reference_peak or 1, plan.reference_seconds or 1.0  # type: ignore[attr-defined]
    points = plan.frontier()  # type: ignore[attr-defined]
    frontier.plot([p.peak / ref_peak for p in points], [p.seconds / ref_seconds for p in points], "o-",
                  color=COLOURS["plan"], label="plans (frontier)")
    for label, choice in baselines(profile):
        peak, seconds = baseline_point(plan, choice)  # type: ignore[arg-type]
        frontier.plot(peak / ref_peak, seconds / ref_seconds, "s", label=label,
                      color=COLOURS.get(label))
    frontier.axvline(budget / ref_peak, color=COLOURS["budget"], linestyle="--", linewidth=2)
    frontier.set_xlabel("peak activation memory / no checkpointing")
    frontier.set_ylabel("step time / no checkpointing")
    frontier.set_title("memory vs step time")
    frontier.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=DPI)
    plt.close(figure)
    return f"wrote {path}"


def _draw_prediction_and_measurement(axes: object, plan: object) -> None:
    """Once the plan was verified: its whole-step predicted peak (the activations' and what the
    process held besides when it was solved, the figure the one-line summary prints) and the peak
    the verification step measured (the process's where it was read, else the tensors'), as lines."""
    measured = plan.measured_process_peak  # type: ignore[attr-defined]
    seen = "process"
    if measured is None:
        measured, seen = plan.measured_peak, "tensor storages"  # type: ignore[attr-defined]
    if measured is None:
        return
    whole, besides = plan.peak + plan.overhead, plan.overhead  # type: ignore[attr-defined]
    axes.axhline(whole / MiB, color=COLOURS["predicted"], linestyle=":", linewidth=1.8,  # type: ignore[attr-defined]
                 label=f"predicted step peak {format_bytes(whole)} ({format_bytes(besides)} held besides)")
    axes.axhline(measured / MiB, color=COLOURS["measured"], linestyle="-.", linewidth=1.8,  # type: ignore[attr-defined]
                 label=f"measured peak {format_bytes(measured)} ({seen})")


def _short(label: str) -> str:
    """``bwd region0`` for a region named ``region0:Layer.forward``, ``bwd layers.3`` for ``model.layers.3``."""
    kind, _, name = label.partition(" ")
    name = name.split(":")[0] if ":" in name else ".".join(name.split(".")[-2:])
    return f"{kind} {name[:16]}" if name else kind
