"""The ``acshim`` command: run scripts on acshim, show the compat matrix, check the installation.

    acshim run [--hf] [--children] script.py [args...]   run a script unchanged, patches installed
    acshim run [--hf] [--children] -m module [args...]   the same for ``python -m module``
    acshim run [--hf] [--] launcher [args...]            a launcher on PATH (torchrun, accelerate,
                                                         deepspeed, python) with every rank patched
    acshim run --budget 2GiB|0.3 [--report] script.py    the script's checkpoint calls follow a plan
    acshim plan --budget X [--sweep] [--png f] -- script.py [args...]   plan on its first step, print, exit
    acshim compat [--markdown] [--dialect D] [--status S] [--write | --check]
    acshim doctor                                        versions, devices, what would be patched
    acshim build-ext                                     compile the native extensions now
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
from typing import TYPE_CHECKING, Any

from .cli_flags import HELP, RunFlags, help_text, parse_run_flags, usage

if TYPE_CHECKING:
    from .planner.session import PlanSession

RUN_USAGE = usage("run")
PLAN_USAGE = usage("plan")


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

    build = verbs.add_parser("build-ext", help="compile the native extensions now (disk I/O, CPU tensor allocator)")
    build.set_defaults(handler=build_ext_command)

    verbs.add_parser("demo", help="the README demo: same gradients, less memory", add_help=False)
    return parser


# --------------------------------------------------------------------------------------------------
# run


def _usage_error(verb: str, message: str) -> int:
    print(f"usage: {usage(verb)}\n{message}", file=sys.stderr)
    return 2


def _read_flags(verb: str, argv: Sequence[str]) -> RunFlags | int:
    """The verb's flags, or the exit code after printing the help (0) or a usage error (2)."""
    parsed = parse_run_flags(argv, verb)
    if parsed == HELP:
        print(help_text(verb), end="")
        return 0
    if isinstance(parsed, str):
        return _usage_error(verb, parsed)
    return parsed


def run_command(argv: list[str], script_prefix: Sequence[str] = ()) -> int:
    """``acshim run``: exit code 0, the script's own ``SystemExit`` code, 1 on an uncaught
    exception (traceback printed as python prints it), 2 on a usage error or missing script.
    ``script_prefix``: arguments the script gets before its own (a launcher's ``--local_rank=N``)."""
    flags = _read_flags("run", argv)
    if isinstance(flags, int):
        return flags
    flags.args = [*script_prefix, *flags.args]
    launcher = _launcher_path(flags.script)
    if launcher is not None:
        if flags.budget is not None or flags.report:
            return _usage_error("run", "acshim run: --budget and --report apply to a script run in this process, "
                                "not behind a launcher; put the launcher around acshim instead, so every rank plans "
                                "with the others: torchrun --nproc-per-node N -m acshim run --budget B train.py")
        return run_launcher(launcher, [flags.script, *flags.args], hf=flags.hf)
    return _run_in_process(flags)


def plan_command(argv: list[str]) -> int:
    """``acshim plan``: the plan for a script's first step, printed; 0, or 2 on bad input."""
    flags = _read_flags("plan", argv)
    if isinstance(flags, int):
        return flags
    if flags.budget is None:
        return _usage_error("plan", "acshim plan: argument --budget is required (e.g. --budget 2GiB, or --budget 0.3 "
                            "for 30% of the activation memory without checkpointing)")
    if flags.png is not None:
        flags.sweep = True
    return _run_in_process(flags)


def _flag_problem(flags: RunFlags) -> str | None:
    """What is wrong with ``flags`` before anything runs (a missing script, an option that needs
    ``--budget``, a bad value), or None."""
    verb = flags.verb
    if flags.script is not None and not os.path.exists(flags.script):
        return f"acshim {verb}: can't open file {os.path.abspath(flags.script)!r}: [Errno 2] No such file or directory"
    if flags.budget is None:
        needs_budget = {"storage": "--storage chooses the offload tier of a --budget plan",
                        "plan_file": "--plan-file saves or reuses a --budget plan",
                        "png": "--png draws a --budget plan's memory (no checkpointing, full recompute, the plan)"}
        for dest, what in needs_budget.items():
            if getattr(flags, dest) is not None:
                return f"acshim {verb}: {what}; add --budget"
    if flags.storage not in (None, "host", "disk"):
        return f"acshim {verb}: argument --storage: expected host or disk, got {flags.storage!r}"
    if flags.budget is not None:
        from .planner.budget import check_budget

        try:
            check_budget(flags.budget)
        except ValueError as error:
            return f"acshim {verb}: argument {error}"
    return None


def _plan_session(flags: RunFlags) -> PlanSession | None:
    """The ``--budget`` planner session (not started yet), or None without ``--budget``."""
    if flags.budget is None:
        return None
    from .allocator import own
    from .planner.session import PlanSession

    own()  # already done before torch was imported, unless main() was called from Python
    return PlanSession(flags.budget, storage=flags.storage, exit_after_plan=flags.verb == "plan",
                       sweep=flags.sweep, png=flags.png, plan_file=flags.plan_file)


def _install_patches(flags: RunFlags) -> str | None:
    """``acshim.install()`` (child processes too where asked), and the report at exit; the error
    message when the patches could not be installed."""
    from .patching import PatchError, install
    from .patching.children import children_requested, enable_children
    from .patching.runner import report_regions_at_exit

    if flags.children or children_requested():
        enable_children(hf=flags.hf)
    try:
        install(hf=flags.hf)
    except (PatchError, ImportError) as error:
        return f"acshim {flags.verb}: could not install the patches (nothing was changed): {error}"
    render = None
    if flags.report:
        from .report import start

        render = start().render
    report_regions_at_exit(detailed=render)
    return None


def _run_in_process(flags: RunFlags) -> int:
    """Run the script (or module) here, as python would, with the patches, the plan and the report
    ``flags`` ask for; the exit code."""
    verb = flags.verb
    problem = _flag_problem(flags)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    session = _plan_session(flags)
    problem = _install_patches(flags)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 1
    from .patching.runner import module_found

    if flags.module is not None and not module_found(flags.module):
        print(f"acshim {verb}: No module named {flags.module}", file=sys.stderr)
        return 1
    code = _run_target(flags, session)
    if code is not None:
        return code
    return _end_of_plan(flags, session)


def _run_target(flags: RunFlags, session: PlanSession | None) -> int | None:
    """Run the script or module, torch's checkpoint rerouted while a plan or report watches; the exit
    code of a run that ends here (a failure, the plan's own exit), or None when the script ended well."""
    from .patching.runner import record_rank_error, run_module, run_script, script_traceback
    from .planner.session import PlanExit

    routed = False
    if session is not None or flags.report:
        from .patching.torch_route import route_torch_checkpoint

        routed = route_torch_checkpoint()  # the plan and the report see torch.utils.checkpoint calls too
    if session is not None:
        session.start()
    try:
        if flags.module is not None:
            run_module(flags.module, flags.args)
        else:
            run_script(flags.script, flags.args)
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
        filename = os.path.abspath(flags.script) if flags.script is not None else None
        trimmed = script_traceback(error, filename)
        sys.excepthook(type(error), error.with_traceback(trimmed), trimmed)
        record_rank_error(error)  # after with_traceback: torchrun's summary shows the trimmed one
        return 1
    finally:
        if session is not None and flags.verb == "plan":
            session.stop()
        if routed:
            from .patching.torch_route import unroute_torch_checkpoint

            unroute_torch_checkpoint()
    return None


def _end_of_plan(flags: RunFlags, session: PlanSession | None) -> int:
    """After a script that ended well: an error when ``--budget`` had nothing to plan, or a sharded
    model's plan was never made; else 0."""
    verb, budget = flags.verb, str(flags.budget)
    if session is not None and session.planned_nothing:
        session.stop()
        return _run_error(2, _nothing_planned(verb, budget))
    if session is not None and session.still_exploring:  # a sharded model, planned on its own steps
        from .planner.lockstep import explore_steps

        steps = explore_steps(session)
        session.stop()
        ended = (f"acshim {verb}: --budget {flags.budget}: the script ended before its sharded model's plan "
                 f"was made: it is planned on the script's own steps and needs up to {steps + 1} training steps "
                 "(the first two run every region with the least memory, recomputed with its input on the storage "
                 "tier, then, where each fits the budget, one recomputed, one per other storage choice, one "
                 "sampling selective-op, and one with the LM head in chunks where the model has one)")
        if verb == "plan":
            return _run_error(2, ended)
        from .patching.runner import print_error_line

        print_error_line(ended)
    if session is not None and getattr(session, "still_deferred", False):
        from .patching.runner import print_error_line

        print_error_line(f"acshim {verb}: --budget {flags.budget}: the script ended before pipeline stage "
                         f"{session.pipeline.stage} planned: an SMP v1 stage plans on its second microbatch (the first "
                         "ran every region recomputed); run more than one microbatch or step")
    line = session.rank_summary() if session is not None and getattr(session, "pipeline", None) else None
    if line:  # a pipeline rank: its budget, predicted and measured peak for the whole run
        print(line, file=sys.stderr, flush=True)
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
    print(f"CPU tensor allocator (--budget): {_host_allocator_status()}")
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


def _host_allocator_status() -> str:
    host_allocator = _optional_module("acshim.host_allocator")
    status = getattr(host_allocator, "status", None)
    return str(status()) if status is not None else "unknown (this acshim has no acshim.host_allocator)"


# --------------------------------------------------------------------------------------------------
# build-ext, demo


def build_ext_command(args: argparse.Namespace) -> int:
    native = _optional_module("acshim.storage.native")
    build = getattr(native, "build", None)
    if build is None:
        print("acshim build-ext: this acshim has no native extension to build (acshim.storage.native.build "
              "is missing); the Python I/O path is used", file=sys.stderr)
        return 1
    from .host_allocator import build as build_allocator

    try:
        status = build()
        allocator = build_allocator()
    except RuntimeError as error:
        print(f"acshim build-ext: {error}", file=sys.stderr)
        return 1
    print(status)
    print(f"CPU tensor allocator (--budget): {allocator}")
    return 0


def demo_command(argv: list[str]) -> int:
    demo = _optional_module("acshim.demo")
    if demo is None or not callable(getattr(demo, "main", None)):
        print("acshim demo: not available in this acshim (acshim.demo.main is missing)", file=sys.stderr)
        return 2
    return int(demo.main(argv) or 0)
