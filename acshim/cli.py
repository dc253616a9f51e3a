"""The ``acshim`` command: run scripts on acshim, show the compat matrix, check the installation.

    acshim run [--hf] [--children] script.py [args...]   run a script unchanged, patches installed
    acshim run [--hf] [--children] -m module [args...]   the same for ``python -m module``
    acshim run [--hf] [--] launcher [args...]            a launcher on PATH (torchrun, accelerate,
                                                         deepspeed, python) with every rank patched
    acshim run --budget 2GiB|0.3 [--report] script.py    the script's checkpoint calls follow a plan
    acshim plan --budget X [--sweep] [--png f] -- script.py [args...]   plan on its first step, print, exit
    acshim compat [--markdown] [--dialect D] [--status S] [--write | --check]
    acshim doctor                                        versions, devices, what would be patched
    acshim build-ext                                     compile the native I/O extension now
    acshim demo [args...]                                the README's memory/gradient demo
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import platform
import shutil
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

RUN_USAGE = ("acshim run [--hf] [--children] [--budget B [--plan-file F] [--png f.png]] [--report] "
             "(script.py | -m module | [--] launcher) [args...]")
PLAN_USAGE = ("acshim plan --budget B [--sweep] [--png out.png] [--storage host|disk] [--plan-file F] [--] "
              "(script.py | -m module) [args...]")
RUN_HELP = f"""usage: {RUN_USAGE}

Run a training script written for DeepSpeed, FairScale, SageMaker model parallelism, PyTorch's
checkpoint_wrapper, Modalities or Hugging Face on acshim, unchanged: as `python script.py args`
would (same sys.argv, __main__, sys.path[0], exit code and traceback), with acshim.install() done.

options (before the script; everything after it goes to the script):
  --hf        also checkpoint every Hugging Face model automatically (acshim.patch_transformers())
  --children  patch child Python processes too (torchrun workers, multiprocessing spawn);
              same as ACSHIM_PATCH_CHILDREN=1 in the environment. Off by default.
  --budget B  plan instead of the script's recipe: B is the memory the process may hold above what
              it held when a step started (parameters, gradients), for the whole run, planning
              included: in bytes or with a unit (2GiB, 800MB) or a fraction of the peak activation
              memory without checkpointing (0.3). The script's own checkpoint calls (any dialect)
              become regions the plan decides about (keep / selective / recompute / offload),
              planned on its first step; one line on stderr says what was replaced. See docs/cli.md.
  --storage T offload tier for --budget plans: host or disk (default: disk on CPU, host on GPU)
  --plan-file F  with --budget: reuse the plan saved in F (same model, batch shape and budget) without
              profiling; F is written by the run that plans when it does not exist
  --png FILE  with --budget: once planned, draw one step's activation memory block by block (no
              checkpointing, full recompute, the plan, the budget) beside the frontier to FILE
              (needs matplotlib: pip install 'acshim[plot]')
  --report    at exit, print per region and per dialect forwards, recomputes, bytes held, bytes
              offloaded per tier, prefetch hits and waits, and settings that silently do nothing
  -m module   run a module as `python -m module` does
  -h, --help  show this help

launchers: when the first argument is not a file but an executable on PATH (torchrun, accelerate,
deepspeed, python ...), or a path to an executable that is not Python source (/venv/bin/python, a
shell wrapper), it runs as a launcher with child patching on, so every Python rank it starts has
the patches:  acshim run -- torchrun --nproc-per-node 2 train.py
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``acshim`` console script and ``python -m acshim``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) > 1 and argv[0].startswith(("--local_rank=", "--local-rank=")) and argv[1] == "run":
        # ``deepspeed --module acshim run train.py`` (or ``--no_python acshim run``) puts its
        # ``--local_rank=N`` right after ``acshim``: hand it to the script, where python would have it.
        return run_command(argv[2:], script_prefix=[argv[0]])
    if argv and argv[0] == "run":
        return run_command(argv[1:])
    if argv and argv[0] == "plan":
        return plan_command(argv[1:])
    if argv and argv[0] == "demo":  # everything after ``demo`` is the demo's own
        return demo_command(argv[1:])
    args = _parser().parse_args(argv)
    if args.command is None:
        _parser().print_help()
        return 2
    return args.handler(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="acshim", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="command", metavar="command")
    verbs.add_parser("run", help="run a script with acshim's patches installed", usage=RUN_USAGE, add_help=False)
    verbs.add_parser("plan", help="plan checkpointing for a script under a memory budget and print it",
                     usage=PLAN_USAGE, add_help=False)

    compat = verbs.add_parser("compat", help="print the compatibility matrix")
    compat.add_argument("--markdown", action="store_true", help="print Markdown (as compat_matrix/README.md)")
    compat.add_argument("--dialect", action="append", default=[], help="only this dialect (repeatable)")
    compat.add_argument("--status", action="append", default=[], help="only this status (repeatable)")
    group = compat.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help="regenerate compat_matrix/README.md")
    group.add_argument("--check", action="store_true", help="exit 1 if compat_matrix/README.md is stale")
    compat.set_defaults(handler=compat_command)

    doctor = verbs.add_parser("doctor", help="show versions, devices and what acshim would patch")
    doctor.set_defaults(handler=doctor_command)

    build = verbs.add_parser("build-ext", help="compile the native I/O extension now")
    build.set_defaults(handler=build_ext_command)

    verbs.add_parser("demo", help="the README demo: same gradients, less memory", add_help=False)
    return parser


# --------------------------------------------------------------------------------------------------
# run


_VALUE_OPTIONS = ("--budget", "--storage", "--png", "--plan-file")


def _parse_run(argv: list[str], verb: str = "run", allowed: tuple[str, ...] = ("--hf", "--children", "--report"),
               values: tuple[str, ...] = _VALUE_OPTIONS
               ) -> tuple[dict[str, Any], str | None, str | None, list[str]] | str:
    """Options up to the script (or ``-m module``); the rest belongs to the script untouched."""
    flags: dict[str, Any] = {"hf": False, "children": False}  # the others only when given
    index = 0
    while index < len(argv):
        arg = argv[index]
        if arg in ("-h", "--help"):
            return "help"
        name, equals, inline = arg.partition("=")
        if name in values:
            value = inline if equals else (argv[index + 1] if index + 1 < len(argv) else None)
            if not value:
                return f"acshim {verb}: argument {name}: expected a value"
            flags[name[2:].replace("-", "_")] = value
            index += 1 if equals else 2
            continue
        if arg in allowed:
            flags[arg[2:]] = True
        elif arg == "-m" or (arg.startswith("-m") and len(arg) > 2):
            module = arg[2:] or (argv[index + 1] if index + 1 < len(argv) else "")
            if not module:
                return f"acshim {verb}: argument -m: expected a module name"
            rest = argv[index + (1 if arg[2:] else 2):]
            return flags, None, module, rest
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
    return flags, argv[index], None, argv[index + 1:]


def run_command(argv: list[str], script_prefix: Sequence[str] = ()) -> int:
    """``acshim run``: exit code 0, the script's own ``SystemExit`` code, 1 on an uncaught
    exception (traceback printed as python prints it), 2 on a usage error or missing script.
    ``script_prefix``: arguments the script gets before its own (a launcher's ``--local_rank=N``)."""
    parsed = _parse_run(argv)
    if parsed == "help":
        print(RUN_HELP, end="")
        return 0
    if isinstance(parsed, str):
        print(f"usage: {RUN_USAGE}\n{parsed}", file=sys.stderr)
        return 2
    flags, script, module, args = parsed
    args = [*script_prefix, *args]
    launcher = _launcher_path(script)
    if launcher is not None:
        if flags.get("budget") is not None or flags.get("report"):
            print(f"usage: {RUN_USAGE}\nacshim run: --budget and --report apply to a script run in this process, "
                  "not behind a launcher; put the launcher around acshim instead, so every rank plans with the "
                  "others: torchrun --nproc-per-node N -m acshim run --budget B train.py", file=sys.stderr)
            return 2
        return run_launcher(launcher, [script, *args], hf=flags["hf"])
    return _run_in_process("run", flags, script, module, args)


PLAN_HELP = f"""usage: {PLAN_USAGE}

Run a few steps of a training script (any dialect, unchanged) with acshim's patches installed, plan
its checkpoint calls under a peak activation-memory budget on its first step, print the plan table
and exit without training on.

options (before the script; everything after it goes to the script):
  --budget B     bytes, a size (2GiB, 800MB) or a fraction of the memory without checkpointing (0.3)
  --sweep        also print the memory vs step-time frontier (10 budgets) and uniform recipes
  --png FILE     draw one step's activation memory block by block (no checkpointing, full recompute, the
                 plan, the budget) beside the frontier to FILE (implies --sweep; needs matplotlib:
                 pip install 'acshim[plot]')
  --storage T    offload tier: host or disk (default: disk on CPU, host on GPU)
  --plan-file F  save the plan to F (or print the one F holds, if made for this model, batch and budget)
  --hf           also checkpoint every Hugging Face model automatically
  -m module      plan for a module run as `python -m module`
"""


def plan_command(argv: list[str]) -> int:
    """``acshim plan``: the plan for a script's first step, printed; 0, or 2 on bad input."""
    parsed = _parse_run(argv, "plan", allowed=("--hf", "--sweep"), values=_VALUE_OPTIONS)
    if parsed == "help":
        print(PLAN_HELP, end="")
        return 0
    if isinstance(parsed, str):
        print(f"usage: {PLAN_USAGE}\n{parsed}", file=sys.stderr)
        return 2
    flags, script, module, args = parsed
    if flags.get("budget") is None:
        print(f"usage: {PLAN_USAGE}\nacshim plan: argument --budget is required (e.g. --budget 2GiB, or --budget 0.3 "
              "for 30% of the activation memory without checkpointing)", file=sys.stderr)
        return 2
    if flags.get("png") is not None:
        flags["sweep"] = True
    return _run_in_process("plan", flags, script, module, args)


def _run_in_process(verb: str, flags: dict[str, Any], script: str | None, module: str | None, args: list[str]) -> int:
    if script is not None and not os.path.exists(script):
        print(f"acshim {verb}: can't open file {os.path.abspath(script)!r}: [Errno 2] No such file or directory",
              file=sys.stderr)
        return 2
    session = None
    if flags.get("storage") is not None and flags.get("budget") is None:
        print(f"acshim {verb}: --storage chooses the offload tier of a --budget plan; add --budget", file=sys.stderr)
        return 2
    if flags.get("plan_file") is not None and flags.get("budget") is None:
        print(f"acshim {verb}: --plan-file saves or reuses a --budget plan; add --budget", file=sys.stderr)
        return 2
    if flags.get("png") is not None and flags.get("budget") is None:
        print(f"acshim {verb}: --png draws a --budget plan's memory (no checkpointing, full recompute, the plan); "
              "add --budget", file=sys.stderr)
        return 2
    if flags.get("storage") not in (None, "host", "disk"):
        print(f"acshim {verb}: argument --storage: expected host or disk, got {flags.get('storage')!r}", file=sys.stderr)
        return 2
    if flags.get("budget") is not None:
        from .allocator import own
        from .planner.session import PlanSession, _check_budget

        own()  # already done before torch was imported, unless main() was called from Python

        try:
            _check_budget(flags.get("budget"))
        except ValueError as error:
            print(f"acshim {verb}: argument {error}", file=sys.stderr)
            return 2
        session = PlanSession(flags.get("budget"), storage=flags.get("storage"), exit_after_plan=verb == "plan",
                              sweep=flags.get("sweep"), png=flags.get("png"), plan_file=flags.get("plan_file"))

    from .patching import PatchError, install
    from .patching.children import children_requested, enable_children
    from .patching.runner import (
        module_found,
        record_rank_error,
        report_regions_at_exit,
        run_module,
        run_script,
        script_traceback,
    )

    if flags.get("children") or children_requested():
        enable_children(hf=flags["hf"])
    try:
        install(hf=flags["hf"])
    except (PatchError, ImportError) as error:
        print(f"acshim {verb}: could not install the patches (nothing was changed): {error}", file=sys.stderr)
        return 1
    report_regions_at_exit(detailed=flags.get("report"))
    if module is not None and not module_found(module):
        print(f"acshim {verb}: No module named {module}", file=sys.stderr)
        return 1
    from .planner.session import PlanExit

    routed = False
    if session is not None or flags.get("report"):
        from .patching.torch_route import route_torch_checkpoint

        routed = route_torch_checkpoint()  # the plan and the report see torch.utils.checkpoint calls too
    if session is not None:
        session.start()
    try:
        if module is not None:
            run_module(module, args)
        else:
            run_script(script, args)
    except PlanExit as done:
        return _plan_exit(done)
    except SystemExit as exiting:
        if not _succeeded(exiting):
            raise  # python's own handling gives the exit status
        # sys.exit(), sys.exit(0), raise SystemExit: the script ended as falling off its end does,
        # and the run ends the same way (checks below included)
    except KeyboardInterrupt:
        raise
    except BaseException as error:
        filename = os.path.abspath(script) if script is not None else None
        trimmed = script_traceback(error, filename)
        sys.excepthook(type(error), error.with_traceback(trimmed), trimmed)
        record_rank_error(error)  # after with_traceback: torchrun's summary shows the trimmed one
        return 1
    finally:
        if session is not None and verb == "plan":
            session.stop()
        if routed:
            from .patching.torch_route import unroute_torch_checkpoint

            unroute_torch_checkpoint()
    if session is not None and session.mode == "idle":
        session.stop()
        return _run_error(2, _nothing_planned(verb, str(flags.get("budget"))))
    if session is not None and session.mode == "explore":  # a sharded model, planned on its own steps
        from .planner.lockstep import EXPLORE_STEPS

        session.stop()
        ended = (f"acshim {verb}: --budget {flags.get('budget')}: the script ended before its sharded model's plan "
                 f"was made: it is planned on the script's own steps and needs {EXPLORE_STEPS + 1} training steps "
                 "(the first ones ran every region recomputed)")
        if verb == "plan":
            return _run_error(2, ended)
        from .patching.runner import print_error_line

        print_error_line(ended)
    return 0


def _succeeded(exiting: SystemExit) -> bool:
    """Whether python would exit with status 0 for this ``SystemExit`` (None, 0 or False)."""
    return exiting.code is None or (isinstance(exiting.code, int) and exiting.code == 0)


def _plan_exit(done: Any) -> int:
    """The end of a run the plan stopped inside its first step: 0 after ``acshim plan``; otherwise a
    refusal (the budget cannot be met, a sharded model...): the message, and no report of the run
    that did not happen."""
    if done.code != 0:
        from .patching.runner import withhold_report

        withhold_report()
    if done.message:
        return _run_error(done.code, done.message)
    return done.code


def _run_error(code: int, message: str) -> int:
    """End the run with acshim's own error ``message``: on a line of its own on stderr, and in the error
    file a launcher's failure summary reads (torchrun, accelerate launch)."""
    from .patching.runner import print_error_line, record_rank_message

    message = message.strip("\n")  # print_error_line starts the line itself
    print_error_line(message)
    if code != 0:
        record_rank_message(message)
    return code


def _nothing_planned(verb: str, budget: str) -> str:
    from .compiled import compiled_graphs

    if compiled_graphs():
        return (f"acshim {verb}: --budget {budget}: the script compiles its model (torch.compile), and regions traced "
                "by Dynamo become torch's checkpoint operator, which no plan made while the script runs can change; "
                "plan eagerly before compiling: plan = acshim.plan(model, batch, budget=...); plan.apply(model); "
                "model = torch.compile(model)")
    return (f"acshim {verb}: --budget {budget}: the script ran no checkpointed region with grad enabled, so there was "
            "nothing to plan; checkpoint its blocks in any dialect (torch.utils.checkpoint, torch checkpoint_wrapper, "
            "DeepSpeed, FairScale, gradient_checkpointing_enable(), acshim.apply_checkpointing) or add --hf for "
            "transformers models")


def _launcher_path(name: str | None) -> str | None:
    """The launcher ``name`` names, or None for a script to run in this process as python would.

    A word that is not a file here is looked up on ``PATH`` (``torchrun``, ``accelerate``,
    ``deepspeed``, ``python``). A file (any path, absolute or relative) is a launcher when it is
    an executable that is not Python source (``/venv/bin/python`` itself, a shell wrapper): python
    could not run it as a script. Python source - a ``.py`` file, a console script whose ``#!`` line
    names python, a text file without ``#!``, a zip application - runs as a script."""
    if name is None:
        return None
    if os.path.exists(name):
        return name if _foreign_executable(name) else None
    if os.sep in name or (os.altsep and os.altsep in name):
        return None  # a path that does not exist: python's "can't open file"
    return shutil.which(name)


def _foreign_executable(path: str) -> bool:
    """An executable file that is not Python source (see ``_launcher_path``)."""
    import zipfile

    if not os.path.isfile(path) or not os.access(path, os.X_OK) or path.endswith((".py", ".pyw")):
        return False
    try:
        with open(path, "rb") as file:
            head = file.read(4096)
    except OSError:
        return False
    if head.startswith(b"#!"):
        return b"python" not in head.split(b"\n", 1)[0]
    if zipfile.is_zipfile(path):
        return False  # a zip application: python runs its __main__.py
    return b"\0" in head  # a binary (ELF, Mach-O); text without "#!" is source, as python reads it


def run_launcher(path: str, argv: list[str], *, hf: bool = False) -> int:
    """``acshim run -- torchrun ...``: run a launcher with child patching on, so every Python process it
    starts (each rank) installs the patches. On POSIX the launcher replaces this process (its pid,
    signals and exit status are the launcher's own); elsewhere it runs as a subprocess."""
    from .patching.children import enable_children

    environment = dict(os.environ)
    enable_children(hf=hf, environ=environment)
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "posix":
        try:
            os.execve(path, argv, environment)
        except OSError as error:
            print(f"acshim run: cannot start {path}: {error}", file=sys.stderr)
            return 126
    import subprocess

    try:
        return subprocess.call([path, *argv[1:]], env=environment)
    except KeyboardInterrupt:
        return 130


# --------------------------------------------------------------------------------------------------
# compat


def compat_command(args: argparse.Namespace) -> int:
    from . import compat

    try:
        if args.write:
            print(f"wrote {compat.write_readme()}")
            return 0
        if args.check:
            if compat.readme_is_current():
                return 0
            print("compat_matrix/README.md is stale: run `acshim compat --write`", file=sys.stderr)
            return 1
        unknown = sorted(set(args.status) - set(compat.STATUSES))
        if unknown:
            print(f"acshim compat: unknown status {unknown}; use {', '.join(compat.STATUSES)}", file=sys.stderr)
            return 2
        rows = compat.filter_rows(compat.load_rows(), args.dialect, args.status)
    except (FileNotFoundError, compat.CompatError) as error:
        print(f"acshim compat: {error}", file=sys.stderr)
        return 1
    if args.markdown:
        print(compat.render_markdown(rows), end="")
    else:  # on a terminal, one line per row; piped, whole reasons
        width = shutil.get_terminal_size().columns if sys.stdout.isatty() else None
        print(compat.render_text(rows, width), end="")
    return 0


# --------------------------------------------------------------------------------------------------
# doctor


def _version(distribution: str | None) -> str:
    if distribution is None:
        return "-"
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _optional_module(name: str) -> ModuleType | None:
    """Import ``name`` if this acshim has it (parts are written by different people)."""
    from .patching.dialects import module_exists

    return importlib.import_module(name) if module_exists(name) else None


def doctor_command(args: argparse.Namespace) -> int:
    import torch

    import acshim

    from .patching import DIALECTS, current, install, uninstall
    from .patching.children import CHILDREN_ENV, children_requested

    print(f"acshim {acshim.__version__} ({os.path.dirname(acshim.__file__)})")
    print(f"python {platform.python_version()}, torch {torch.__version__}, device: {_device_summary(torch)}")
    was_installed = current() is not None
    installation = install()
    try:
        print(f"patches in this process: {'installed' if was_installed else 'not installed (acshim run installs them)'}")
        print(f"child processes: {'patched' if children_requested() else 'not patched'} "
              f"({CHILDREN_ENV}={os.environ.get(CHILDREN_ENV, '<unset>')})")
        print()
        print(f"{'dialect':<16} {'import name':<30} {'installed':<14} acshim serves it as")
        for dialect in DIALECTS:
            report = installation.reports[dialect.name]
            print(f"{dialect.name:<16} {_short(dialect.upstream, 30):<30} {_version(dialect.distribution):<14} "
                  f"{_describe_mode(report)}")
            for why in report.missing:
                print(f"{'':<16}   skipped: {why}")
        transformers_version = _version("transformers")
        hf = "acshim.hf routes gradient_checkpointing_enable & co. to the engine" if installation.transformers \
            else "not patched (transformers not installed or acshim.hf missing)"
        print(f"{'transformers':<16} {'transformers':<30} {transformers_version:<14} {hf}")
    finally:
        if not was_installed:
            uninstall()
    print()
    print(f"native extension: {_native_status()}")
    return 0


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1):]


def _describe_mode(report: object) -> str:
    mode = report.mode  # type: ignore[attr-defined]
    if mode == "shim":
        return f"facade under the upstream name ({report.dialect.facade})"  # type: ignore[attr-defined]
    if mode == "no facade":
        return "not covered by this acshim (no facade package)"
    now, later = report.patched_now, report.deferred  # type: ignore[attr-defined]
    parts = []
    if now:
        parts.append(f"{len(now)} entry points patched in place")
    if later:
        parts.append(f"in place at first import of {len(later)} module(s)")
    return "upstream kept; " + ("; ".join(parts) if parts else "no entry points listed to patch")


def _device_summary(torch: ModuleType) -> str:
    from .rng import default_device_type

    device = default_device_type()
    if device == "cuda":
        return f"cuda ({torch.cuda.device_count()} x {torch.cuda.get_device_name(0)})"
    return device if device != "cpu" else "cpu (no accelerator found)"


def _native_status() -> str:
    native = _optional_module("acshim.storage.native")
    status = getattr(native, "status", None)
    if status is None:
        return "unknown (this acshim has no acshim.storage.native.status)"
    try:
        return str(status(load=False)) + " (acshim build-ext compiles it)"
    except TypeError:
        return str(status())


# --------------------------------------------------------------------------------------------------
# build-ext, demo


def build_ext_command(args: argparse.Namespace) -> int:
    native = _optional_module("acshim.storage.native")
    build = getattr(native, "build", None)
    if build is None:
        print("acshim build-ext: this acshim has no native extension to build (acshim.storage.native.build "
              "is missing); the Python I/O path is used", file=sys.stderr)
        return 1
    try:
        status = build()
    except RuntimeError as error:
        print(f"acshim build-ext: {error}", file=sys.stderr)
        return 1
    print(status)
    return 0


def demo_command(argv: list[str]) -> int:
    demo = _optional_module("acshim.demo")
    if demo is None or not callable(getattr(demo, "main", None)):
        print("acshim demo: not available in this acshim (acshim.demo.main is missing)", file=sys.stderr)
        return 2
    return int(demo.main(argv) or 0)
