"""The options of ``acshim run`` and ``acshim plan``, said once: one table per verb, from which come
the argparse parser that prints ``--help`` and the scanner that reads them into ``RunFlags``.

The scanner, not ``argparse.parse_args``, reads the command line: options stop at the script (or
``-m module``), and everything after it belongs to the script untouched, as under ``python``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Option:
    """One option: ``metavar`` None for a switch, else the name of the value it takes."""

    name: str
    help: str
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")


_HF = Option("--hf", "also checkpoint every Hugging Face model automatically (acshim.patch_transformers())")
_STORAGE = Option("--storage", "offload tier of a --budget plan: host or disk (default: disk on CPU, host on GPU)", "T")

RUN_OPTIONS: tuple[Option, ...] = (
    _HF,
    Option("--children", "patch child Python processes too (torchrun workers, multiprocessing spawn); same as "
           "ACSHIM_PATCH_CHILDREN=1 in the environment. Off by default."),
    Option("--budget", "plan instead of the script's recipe: B is the memory the process may hold above what it "
           "held when a step started (parameters, gradients), for the whole run, planning included: in bytes or "
           "with a unit (2GiB, 800MB) or a fraction of the whole step's peak without checkpointing (0.3). "
           "The script's own checkpoint calls (any dialect) become regions the plan decides about (keep / "
           "selective / recompute / offload), planned on its first step; one line on stderr says what was "
           "replaced. See docs/cli.md.", "B"),
    _STORAGE,
    Option("--plan-file", "with --budget: reuse the plan saved in F (same model, batch shape and budget) without "
           "profiling; F is written by the run that plans when it does not exist (a pipeline stage K: F.stageK)", "F"),
    Option("--png", "with --budget: once planned, draw one step's activation memory block by block (no "
           "checkpointing, full recompute, the plan, the budget) beside the frontier to FILE (needs matplotlib: "
           "pip install 'acshim[plot]')", "FILE"),
    Option("--report", "at exit, print per region and per dialect forwards, recomputes, bytes held, bytes offloaded "
           "per tier, prefetch hits and waits, and settings that silently do nothing"),
)
PLAN_OPTIONS: tuple[Option, ...] = (
    Option("--budget", "bytes, a size (2GiB, 800MB) or a fraction of the memory without checkpointing (0.3)", "B"),
    Option("--sweep", "also print the memory vs step-time frontier (10 budgets) and uniform recipes"),
    Option("--png", "draw one step's activation memory block by block (no checkpointing, full recompute, the plan, "
           "the budget) beside the frontier to FILE (implies --sweep; needs matplotlib: pip install "
           "'acshim[plot]')", "FILE"),
    _STORAGE,
    Option("--plan-file", "save the plan to F (or print the one F holds, if made for this model, batch and budget)",
           "F"),
    _HF,
)
OPTIONS = {"run": RUN_OPTIONS, "plan": PLAN_OPTIONS}

_DESCRIPTIONS = {
    "run": "Run a training script written for DeepSpeed, FairScale, SageMaker model parallelism, PyTorch's\n"
           "checkpoint_wrapper, Modalities or Hugging Face on acshim, unchanged: as `python script.py args`\n"
           "would (same sys.argv, __main__, sys.path[0], exit code and traceback), with acshim.install() done.\n\n"
           "Options go before the script; everything after it goes to the script.",
    "plan": "Run a few steps of a training script (any dialect, unchanged) with acshim's patches installed, plan\n"
            "its checkpoint calls under a peak activation-memory budget on its first step, print the plan table\n"
            "and exit without training on.\n\n"
            "Options go before the script; everything after it goes to the script.",
}
_EPILOGS = {
    "run": "launchers: when the first argument is not a file but an executable on PATH (torchrun, accelerate,\n"
           "deepspeed, python ...), or a path to an executable that is not Python source (/venv/bin/python, a\n"
           "shell wrapper), it runs as a launcher with child patching on, so every Python rank it starts has\n"
           "the patches:  acshim run -- torchrun --nproc-per-node 2 train.py",
    "plan": None,
}
_TARGETS = {"run": "(script.py | -m module | [--] launcher) [args...]", "plan": "[--] (script.py | -m module) [args...]"}


def usage(verb: str) -> str:
    """``acshim run [--hf] ... (script.py | -m module ...) [args...]``, from the verb's options."""
    parts = [f"[{option.name}{' ' + option.metavar if option.metavar else ''}]" for option in OPTIONS[verb]]
    return f"acshim {verb} {' '.join(parts)} {_TARGETS[verb]}"


def parser(verb: str) -> argparse.ArgumentParser:
    """The verb's argparse parser: prints ``--help`` (the command line is read by ``parse_run_flags``)."""
    built = argparse.ArgumentParser(prog=f"acshim {verb}", usage=usage(verb), description=_DESCRIPTIONS[verb],
                                    epilog=_EPILOGS[verb], formatter_class=argparse.RawDescriptionHelpFormatter)
    for option in OPTIONS[verb]:
        if option.metavar is None:
            built.add_argument(option.name, action="store_true", help=option.help)
        else:
            built.add_argument(option.name, metavar=option.metavar, help=option.help)
    built.add_argument("-m", metavar="module", dest="module", help="run a module as `python -m module` does")
    built.add_argument("script", nargs="?", help="the script (or launcher) and its arguments, as python gets them")
    return built


def help_text(verb: str) -> str:
    """``acshim run --help``: argparse's own help of ``parser(verb)``."""
    return parser(verb).format_help()


@dataclass
class RunFlags:
    """``acshim run`` / ``acshim plan``'s command line, read once (see ``parse_run_flags``)."""

    verb: str = "run"
    hf: bool = False
    children: bool = False
    report: bool = False
    sweep: bool = False
    budget: str | None = None
    storage: str | None = None
    png: str | None = None
    plan_file: str | None = None
    script: str | None = None
    module: str | None = None
    args: list[str] = field(default_factory=list)
    """The script's (or module's, or launcher's) own arguments."""


HELP = "help"
"""What ``parse_run_flags`` returns for ``-h`` / ``--help``."""


def parse_run_flags(argv: Sequence[str], verb: str = "run") -> RunFlags | str:
    """The options up to the script (or ``-m module``), the rest the script's untouched; ``HELP``, or
    an error message that names the argument."""
    options = {option.name: option for option in OPTIONS[verb]}
    flags = RunFlags(verb)
    argv = list(argv)
    index = 0
    while index < len(argv):
        arg = argv[index]
        if arg in ("-h", "--help"):
            return HELP
        name, equals, inline = arg.partition("=")
        option = options.get(name)
        if option is not None and option.metavar is not None:
            value = inline if equals else (argv[index + 1] if index + 1 < len(argv) else None)
            if not value:
                return f"acshim {verb}: argument {name}: expected a value"
            setattr(flags, option.dest, value)
            index += 1 if equals else 2
            continue
        if option is not None and not equals:
            setattr(flags, option.dest, True)
        elif arg == "-m" or (arg.startswith("-m") and len(arg) > 2):
            module = arg[2:] or (argv[index + 1] if index + 1 < len(argv) else "")
            if not module:
                return f"acshim {verb}: argument -m: expected a module name"
            flags.module, flags.args = module, argv[index + (1 if arg[2:] else 2):]
            return flags
        elif arg == "--":
            index += 1
            break
        elif arg.startswith("-"):
            return f"acshim {verb}: unknown option {arg!r} (options go before the script; see acshim {verb} --help)"
        else:
            break
        index += 1
    if index >= len(argv):
        return f"acshim {verb}: the script to run is missing"
    flags.script, flags.args = argv[index], argv[index + 1:]
    return flags
