"""The application, its global options and the one place errors become exit codes (huggingface_hub's
``cli/_errors.py``): every command module registers itself with ``command`` and runs its body through
``run``."""
from __future__ import annotations

import copy
import functools
import inspect
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from mocli import __version__, trace
from mocli.devices import Device
from mocli.errors import (
    EXIT_BROKEN_PIPE,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_UNUSABLE,
    InputError,
    MocliError,
    os_error,
)
from mocli.output import Output
from mocli.targets import Target
from mocli.targets.experts import HELP as MXFP4_EXPERTS_HELP
from mocli.targets.experts import Mxfp4Experts

EXIT_CODES = ("Exit codes: 0 ok; 1 findings (validation or verification failed, nothing written); 2 usage "
              "error or unusable input (validate: no engine's reading could be judged, NOT JUDGED); 3 internal error (a mocli bug: MOCLI_DEBUG=1 prints the traceback); 130 "
              "interrupted (convert, repair, quantize resume when run again); 141 stdout closed.")


class OutputFormat(StrEnum):
    FULL = "full"
    CONCISE = "concise"


def _no_type(param):
    """typer writes a type after each name (``<str>``, ``<bool>``): an option's metavar, or nothing, reads
    better (an argument's name is already its metavar)."""
    is_option = isinstance(param, typer.core.TyperOption)
    param.display_type_rich = lambda ctx: (param.metavar or None) if is_option else None  # typer 0.29
    if not is_option and hasattr(param, "type"):  # typer <= 0.28 asks the argument's type (shared: a copy answers)
        param.type = copy.copy(param.type)
        param.type.get_metavar = lambda *args, **kwargs: ""
    return param


class _Command(typer.core.TyperCommand):
    """Help as other CLIs write it: ``mocli convert [OPTIONS] MODEL`` (typer writes ``{MODEL}``), and no
    ``<bool>`` after flags."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if isinstance(param, typer.core.TyperArgument):
                _no_type(param)

    def collect_usage_pieces(self, ctx):
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in super().collect_usage_pieces(ctx)]

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        return option if option is None else _no_type(option)


# The commands in the order a checkpoint meets them (help lists them so, whatever the import order).
COMMANDS = ("inspect", "validate", "repair", "quantize", "convert", "verify")


class _Group(typer.core.TyperGroup):
    def list_commands(self, ctx):
        return sorted(super().list_commands(ctx), key=lambda c: COMMANDS.index(c) if c in COMMANDS else len(COMMANDS))

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for param in params:
            if getattr(param, "is_flag", False):
                _no_type(param)
        return params

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        return option if option is None else _no_type(option)


app = typer.Typer(
    name="mocli",
    cls=_Group,
    help="Inspect, validate, repair, quantize, convert and verify quantized checkpoints (NVIDIA ModelOpt and "
         "llm-compressor compressed-tensors exports, vLLM's serialized FP8) for serving: kernel-ready, per rank, "
         "proved right.",
    epilog=EXIT_CODES,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    add_completion=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def command(name: str):
    """Register a command; its docstring is its help, as one paragraph (typer keeps the source's line
    breaks). It takes the output-mode options (``with_output_mode``) after its own."""
    register = app.command(name, cls=_Command, epilog=EXIT_CODES)

    def decorate(fn: Callable) -> Callable:
        fn.__doc__ = " ".join((fn.__doc__ or "").split())
        return register(with_output_mode(fn))

    return decorate


# Flags show no metavar (typer would write <bool>); options show a word for their value. Help text is
# rich markup: a literal "[" is written "\\[".
ModelArg = Annotated[str, typer.Argument(metavar="MODEL", show_default=False, help=(
    "Checkpoint directory or Hugging Face repo id (owner/name\\[@revision])."))]
JsonOpt = Annotated[bool, typer.Option("--json", metavar="", help="Machine-readable output on stdout (errors too, "
                                       "as a JSON object).")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", metavar="", help="Only errors on stderr; no progress or "
                                        "warnings.")]
VerboseOpt = Annotated[int, typer.Option("--verbose", "-v", count=True, metavar="",
                                         help="Timing on stderr; -vv also prints tracebacks of internal errors.")]
# --json, -q, -v: declared once here, taken by the global callback and every command (``with_output_mode``)
OUTPUT_MODE = (inspect.Parameter("json_", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=JsonOpt),
               inspect.Parameter("quiet", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=QuietOpt),
               inspect.Parameter("verbose", inspect.Parameter.KEYWORD_ONLY, default=0, annotation=VerboseOpt))
TARGETS = ", ".join(t.value for t in Target)  # every registered target, as --help lists them
TargetOpt = Annotated[Target | None, typer.Option("--target", "-t", metavar="TARGET", case_sensitive=False,
                                                  help=f"Also check this target's constraints: {TARGETS} (mocli "
                                                       "convert --help says what each takes).")]


def target_help() -> str:
    """Each target as the registry describes it (``mocli.targets.describe``), for convert's --target."""
    from mocli.targets import describe

    return " ".join(f"{t.value}: {describe(t)}." for t in Target)


def _version(value: bool) -> None:
    if value:
        print(f"mocli {__version__}")
        raise typer.Exit()


def with_output_mode(fn: Callable, before: str | None = None) -> Callable:
    """``fn`` (which takes ``ctx``) with the output-mode options added to its parameters (before the one
    named ``before``, else last); they are merged into ``ctx.obj`` (``out_of``) before ``fn`` runs."""
    sig = inspect.signature(fn, eval_str=True)
    params = list(sig.parameters.values())
    assert "ctx" in sig.parameters, fn
    at = [p.name for p in params].index(before) if before else len(params)
    params[at:at] = [p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in OUTPUT_MODE]

    @functools.wraps(fn)
    def wrapper(*, json_: bool = False, quiet: bool = False, verbose: int = 0, **kwargs: Any) -> Any:
        out_of(kwargs["ctx"], json_, quiet, verbose)
        return fn(**kwargs)

    wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper


def _global(
    ctx: typer.Context,
    version: Annotated[bool, typer.Option("--version", "-V", callback=_version, is_eager=True, metavar="",
                                          help="Print the version and exit.")] = False,
) -> None:
    pass


app.callback()(with_output_mode(_global, before="version"))


def out_of(ctx: typer.Context, json_: bool, quiet: bool = False, verbose: int = 0) -> Output:
    """The global options, with those repeated after the command added (``mocli validate M -q``)."""
    out: Output = ctx.obj or Output()
    out.json |= json_
    out.quiet |= quiet
    out.verbose = max(out.verbose, verbose)
    ctx.obj = out
    return out


def silence_broken_pipe() -> None:
    """After EPIPE, point stdout/stderr at /dev/null so nothing more is written (or complained about)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):
            pass


@contextmanager
def _errors(out: Output):
    """Map exceptions to exit codes in one place; tracebacks only for our bugs (MOCLI_DEBUG=1)."""
    try:
        with warnings.catch_warnings():
            # Library warnings go through the one sink, so -q hides them and --json keeps stdout clean.
            warnings.showwarning = lambda message, category, *a, **k: out.warn(f"{category.__name__}: {message}")
            yield
    except BrokenPipeError:
        # The reader went away (mocli ... | head): stop quietly, as other command-line tools do.
        silence_broken_pipe()
        raise typer.Exit(EXIT_BROKEN_PIPE) from None
    except MocliError as e:
        out.fail(e.message, e.hint, e.exit_code)
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt:
        out.fail("interrupted", None, EXIT_INTERRUPTED)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except typer.Exit:
        raise
    except OSError as e:  # environment, not a bug: full disk, read-only or vanished paths
        out.fail(*os_error(e), EXIT_UNUSABLE)
        raise typer.Exit(EXIT_UNUSABLE) from None
    except Exception as e:  # noqa: BLE001 - the last line of defence
        if os.environ.get("MOCLI_DEBUG") or out.verbose >= 2:
            traceback.print_exc()
        notes = "; ".join(getattr(e, "__notes__", []))
        out.fail(f"internal error: {type(e).__name__}: {e}",
                 "this is a mocli bug; set MOCLI_DEBUG=1 for the traceback and report it" + (f"; {notes}" if notes else ""),
                 EXIT_INTERNAL)
        raise typer.Exit(EXIT_INTERNAL) from None


def run(ctx: typer.Context, body: Callable[[Output], int | None]) -> None:
    out = out_of(ctx, False)
    t0 = time.perf_counter()
    trace.mark(f"{ctx.info_name}: arguments parsed")
    with _errors(out):
        code = body(out)
    trace.mark(f"{ctx.info_name}: done")
    if out.verbose:
        out.info(f"[dim]{ctx.info_name} finished in {time.perf_counter() - t0:.2f} s (exit {code or 0})[/]")
    if code:
        raise typer.Exit(code)



SHARD_HELP = ("Shard size limit: 5GB, 500MB (decimal, as huggingface_hub) or 2GiB, 512MiB (binary). Each shard is "
              "hashed in one pass: smaller shards hash and load in parallel.")
# Options of the commands that write a checkpoint (convert, repair, quantize).
OUTPUT_HELP = "Output directory (created; must be empty)."
OutputOpt = Annotated[Path, typer.Option("--output", "-o", metavar="DIR", help=OUTPUT_HELP, show_default=False)]
DeviceOpt = Annotated[Device, typer.Option("--device", metavar="DEVICE", case_sensitive=False,
                                           help="auto, cpu or cuda: where to compute (auto picks CUDA when present).")]
# convert only moves bytes, in numpy on the CPU, whatever --device says (README convert)
ConvertDeviceOpt = Annotated[Device, typer.Option("--device", metavar="DEVICE", case_sensitive=False,
                                                  help="auto, cpu or cuda. A conversion only moves bytes and runs on "
                                                       "the CPU in every case (the summary says so); cuda is refused "
                                                       "where there is no CUDA device.")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", metavar="", help="Replace a non-empty OUTPUT.")]
ShardSizeOpt = Annotated[str, typer.Option("--max-shard-size", metavar="SIZE", help=SHARD_HELP)]
TpOpt = Annotated[int, typer.Option("--tp", metavar="N", min=1, help="Tensor-parallel size (SEMANTICS §10).")]
EpOpt = Annotated[int, typer.Option("--ep", metavar="M", min=1, help="Expert-parallel size for MoE layers (ep = tp "
                                    "x dp; 1: MoE tensor-parallel over --tp).")]
Mxfp4ExpertsOpt = Annotated[Mxfp4Experts, typer.Option("--mxfp4-experts", metavar="HOW", case_sensitive=False,
                                                      help=MXFP4_EXPERTS_HELP)]



def on_every_process(run: Callable[[Any], dict]) -> dict | None:
    """Under torchrun every process runs the command (sharing its units); only process 0's summary is
    printed. One process: just the command."""
    from mocli.stream.dist import dist_from_env

    dist = dist_from_env()
    try:
        summary = run(dist)
    finally:
        dist.close()
    return summary if dist.rank == 0 else None


_SIZE_UNITS = {"TIB": 1024**4, "GIB": 1024**3, "MIB": 1024**2, "KIB": 1024,  # binary, what mocli prints
               "TB": 1000**4, "GB": 1000**3, "MB": 1000**2, "KB": 1000, "B": 1}  # decimal, as huggingface_hub


def parse_size(text: str) -> int:
    """'5GB' / '500MB' (decimal, huggingface_hub's spelling) / '2GiB' / '512 MiB' (binary) / '123' -> bytes."""
    t = text.strip().upper().replace(" ", "")
    for suffix, mult in _SIZE_UNITS.items():
        number = t[: -len(suffix)]
        if t.endswith(suffix) and number.replace(".", "", 1).isdigit():
            if float(number) > 0:
                return int(float(number) * mult)
    if t.isdigit() and int(t) > 0:
        return int(t)
    raise InputError(f"--max-shard-size {text!r}: not a size", hint="use e.g. 2GiB, 512MiB, 5GB, 500MB or a byte count")


