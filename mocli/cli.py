"""The command line: parse options, call one core function, render. No logic of its own."""

from __future__ import annotations

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
from mocli.devices import Device, Kernels, warm_cuda
from mocli.errors import (
    EXIT_BROKEN_PIPE,
    EXIT_FINDINGS,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_UNUSABLE,
    InputError,
    MocliError,
    os_error,
)
from mocli.output import Output
from mocli.targets import Target

EXIT_CODES = ("Exit codes: 0 ok; 1 findings (validation or verification failed, nothing written); 2 usage "
              "error or unusable input; 3 internal error (a mocli bug: MOCLI_DEBUG=1 prints the traceback); 130 "
              "interrupted (convert, repair, quantize resume when run again); 141 stdout closed.")


class OutputFormat(StrEnum):
    FULL = "full"
    CONCISE = "concise"


def _no_type(param):
    """typer writes a type after each name (``<str>``, ``<bool>``): an option's metavar, or nothing, reads
    better (an argument's name is already its metavar)."""
    is_option = isinstance(param, typer.core.TyperOption)
    param.display_type_rich = lambda ctx: (param.metavar or None) if is_option else None
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


class _Group(typer.core.TyperGroup):
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
    help="Inspect, validate, repair, quantize, convert and verify quantized checkpoints (NVIDIA ModelOpt exports) "
         "for serving: kernel-ready, per rank, proved right.",
    epilog=EXIT_CODES,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    add_completion=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def command(name: str):
    return app.command(name, cls=_Command, epilog=EXIT_CODES)


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
TargetOpt = Annotated[Target | None, typer.Option("--target", "-t", metavar="TARGET", case_sensitive=False,
                                                  help="Also check this target's constraints: flashinfer-cutlass or "
                                                       "flashinfer-trtllm.")]


def _version(value: bool) -> None:
    if value:
        print(f"mocli {__version__}")
        raise typer.Exit()


@app.callback()
def _global(
    ctx: typer.Context,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
    version: Annotated[bool, typer.Option("--version", "-V", callback=_version, is_eager=True, metavar="",
                                          help="Print the version and exit.")] = False,
) -> None:
    ctx.obj = Output(json=json_, quiet=quiet, verbose=verbose)


def _out(ctx: typer.Context, json_: bool, quiet: bool = False, verbose: int = 0) -> Output:
    """The global options, with those repeated after the command added (``mocli validate M -q``)."""
    out: Output = ctx.obj or Output()
    out.json |= json_
    out.quiet |= quiet
    out.verbose = max(out.verbose, verbose)
    return out


def _silence_broken_pipe() -> None:
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
        _silence_broken_pipe()
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


def _run(ctx: typer.Context, json_: bool, body: Callable[[Output], int | None], quiet: bool = False,
         verbose: int = 0) -> None:
    out = _out(ctx, json_, quiet, verbose)
    t0 = time.perf_counter()
    trace.mark(f"{ctx.info_name}: arguments parsed")
    with _errors(out):
        code = body(out)
    trace.mark(f"{ctx.info_name}: done")
    if out.verbose:
        out.info(f"[dim]{ctx.info_name} finished in {time.perf_counter() - t0:.2f} s (exit {code or 0})[/]")
    if code:
        raise typer.Exit(code)


@command("inspect")
def inspect_cmd(ctx: typer.Context, model: ModelArg, json_: JsonOpt = False, quiet: QuietOpt = False,
                verbose: VerboseOpt = 0) -> None:
    """Show what is in a checkpoint, from headers only."""
    from mocli.checkpoint import open_checkpoint
    from mocli.inspection import inspect_checkpoint
    from mocli.render import render_inspect

    def body(out: Output) -> None:
        info = inspect_checkpoint(open_checkpoint(model))
        out.emit(info, render_inspect)

    _run(ctx, json_, body, quiet, verbose)


SHARD_HELP = ("Shard size limit: 5GB, 500MB (decimal, as huggingface_hub) or 2GiB, 512MiB (binary). Each shard is "
              "hashed in one pass: smaller shards hash and load in parallel.")
# Options of the commands that write a checkpoint (convert, repair, quantize).
_OUTPUT_HELP = "Output directory (created; must be empty)."
OutputOpt = Annotated[Path, typer.Option("--output", "-o", metavar="DIR", help=_OUTPUT_HELP, show_default=False)]
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


@command("validate")
def validate_cmd(
    ctx: typer.Context,
    model: ModelArg,
    target: TargetOpt = None,
    tp: TpOpt = 1,
    ep: EpOpt = 1,
    deep: Annotated[bool, typer.Option("--deep", metavar="", help="Also scan every weight and scale byte for NaN/Inf codes "
                                       "(reads the whole checkpoint at disk speed).")] = False,
    select: Annotated[list[str] | None, typer.Option("--select", metavar="CODE", help="Report only these codes "
                                                     "(a prefix selects a family: EXC, SCL00); repeatable.")] = None,
    ignore: Annotated[list[str] | None, typer.Option("--ignore", metavar="CODE", help="Do not report these codes "
                                                     "(prefixes too); repeatable.")] = None,
    warnings_as_errors: Annotated[bool, typer.Option("--warnings-as-errors", metavar="",
                                                     help="Exit 1 on warnings too.")] = False,
    output_format: Annotated[OutputFormat, typer.Option("--output-format", metavar="FORMAT", case_sensitive=False,
                                                        help="full (a table) or concise (one line per finding: "
                                                             "location: CODE severity: message (hint))."
                                                        )] = OutputFormat.FULL,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Check config, exclusions, tensors, scales, a target's and a TP/EP layout's constraints; exit 1 on errors."""

    def body(out: Output) -> int:
        from mocli.checkpoint import open_checkpoint
        from mocli.parallel import ParallelLayout
        from mocli.render import render_validation, render_validation_concise
        from mocli.validate import validate

        ckpt = open_checkpoint(model)
        with out.progress_bar("scanning") as progress:
            report = validate(ckpt, target, parallel=ParallelLayout(tp, ep), deep=deep, progress=progress)
        report.filter(select or [], ignore or [])
        report.warnings_as_errors = warnings_as_errors
        out.emit(report.to_dict(), render_validation_concise if output_format is OutputFormat.CONCISE
                 else render_validation)
        return 0 if report.ok else EXIT_FINDINGS

    _run(ctx, json_, body, quiet, verbose)


@command("convert")
def convert_cmd(
    ctx: typer.Context,
    model: ModelArg,
    output: OutputOpt,
    target: Annotated[Target, typer.Option("--target", "-t", metavar="TARGET", case_sensitive=False,
                                           help="Kernel layout to write: flashinfer-cutlass or flashinfer-trtllm.",
                                           show_default=False)],
    tp: TpOpt = 1,
    ep: EpOpt = 1,
    device: ConvertDeviceOpt = Device.AUTO,
    overwrite: OverwriteOpt = False,
    max_shard_size: ShardSizeOpt = "2GB",
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Convert a checkpoint into kernel-ready shards for one kernel layout, per rank with --tp/--ep (streaming,
    resumable; under torchrun the processes share the work)."""

    def body(out: Output) -> None:
        from mocli.checkpoint import open_checkpoint
        from mocli.io.digests import SourceDigests
        from mocli.procenv import reuse_freed_memory, single_thread_blas

        single_thread_blas()  # no GEMM: its BLAS workers only spun (1.3% of a 2-core convert's CPU)
        reuse_freed_memory()  # each unit's arrays land on the pages the last one freed
        shard_bytes = parse_size(max_shard_size)
        with out.progress_bar("converting") as progress:
            progress.phase("reading headers")
            ckpt = open_checkpoint(model)
            digests = SourceDigests([h.path for h in ckpt.files])  # hashing overlaps planning
            # the CUDA driver only, to check --device without torch: no conversion uses the GPU (it only
            # moves bytes, in numpy; mocli.ops)
            warm_cuda(device.value, context=False)
            trace.mark("headers read")
            from mocli.convert import convert
            from mocli.render import render_convert

            trace.mark("convert's modules imported")

            summary = _on_every_process(lambda dist: convert(
                ckpt, output, target, device=device.value, overwrite=overwrite, max_shard_bytes=shard_bytes,
                progress=progress, tp=tp, ep=ep, digests=digests, dist=dist))
        if summary is not None:
            out.emit(summary, render_convert)

    _run(ctx, json_, body, quiet, verbose)


@command("repair")
def repair_cmd(
    ctx: typer.Context,
    model: ModelArg,
    output: Annotated[Path | None, typer.Option("--output", "-o", metavar="DIR", help=_OUTPUT_HELP,
                                                show_default=False)] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", metavar="", help="Print the repair plan and write nothing.")]
    = False,
    overwrite: OverwriteOpt = False,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Fix what validate finds, writing a ModelOpt checkpoint engines load as before (exit 1 when a
    finding cannot be repaired; nothing is written then)."""

    def body(out: Output) -> int:
        from mocli.checkpoint import open_checkpoint
        from mocli.io.digests import SourceDigests

        with out.progress_bar("repairing") as progress:
            progress.phase("reading headers")
            ckpt = open_checkpoint(model)
            digests = None if dry_run else SourceDigests([h.path for h in ckpt.files])
            from mocli.errors import Refused
            from mocli.render import render_repair
            from mocli.repair import repair

            try:
                summary = repair(ckpt, output, dry_run=dry_run, overwrite=overwrite, progress=progress,
                                 digests=digests)
            except Refused as e:
                if getattr(e, "summary", None) is not None:
                    out.emit(e.summary, render_repair)
                raise
        out.emit(summary, render_repair)
        return 0

    _run(ctx, json_, body, quiet, verbose)


@command("quantize")
def quantize_cmd(
    ctx: typer.Context,
    model: ModelArg,
    output: OutputOpt,
    scheme: Annotated[str, typer.Option("--scheme", metavar="SCHEME", help="fp8: per-tensor FP8 weights, dynamic per-token "
                                        "activations (SEMANTICS §12).")] = "fp8",
    exclude: Annotated[list[str] | None, typer.Option("--exclude", metavar="PATTERN", help="Keep modules matching this wildcard "
                                                      "unquantized (repeatable).", show_default=False)] = None,
    device: DeviceOpt = Device.AUTO,
    overwrite: OverwriteOpt = False,
    max_shard_size: ShardSizeOpt = "2GB",
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Quantize an unquantized checkpoint to FP8 once, offline, exactly as engines do online with
    --quantization fp8 (streaming, resumable); serve the output with no --quantization flag."""

    def body(out: Output) -> None:
        from mocli.checkpoint import open_checkpoint
        from mocli.io.digests import SourceDigests
        from mocli.procenv import reuse_freed_memory, single_thread_blas

        single_thread_blas()  # as convert: no GEMM here, numpy's BLAS workers would only spin
        reuse_freed_memory()  # as convert
        shard_bytes = parse_size(max_shard_size)
        with out.progress_bar("quantizing") as progress:
            progress.phase("reading headers")
            ckpt = open_checkpoint(model)
            digests = SourceDigests([h.path for h in ckpt.files])
            warm_cuda(device.value)  # CUDA's start-up overlaps the torch import
            progress.phase("loading torch")
            from mocli.quantize import quantize
            from mocli.render import render_quantize

            summary = _on_every_process(lambda dist: quantize(
                ckpt, output, scheme=scheme, exclude=exclude or [], device=device.value, overwrite=overwrite,
                max_shard_bytes=shard_bytes, progress=progress, digests=digests, dist=dist))
        if summary is not None:
            out.emit(summary, render_quantize)

    _run(ctx, json_, body, quiet, verbose)


@command("verify")
def verify_cmd(
    ctx: typer.Context,
    output: Annotated[Path, typer.Argument(metavar="OUT", show_default=False,
                                           help="A directory written by mocli convert, quantize or repair.")],
    source: Annotated[str | None, typer.Option("--source", metavar="MODEL",
                                               help="Source checkpoint (default: from provenance).")] = None,
    device: Annotated[Device, typer.Option("--device", metavar="DEVICE", case_sensitive=False,
                                           help="auto, cpu or cuda: where to run the kernels.")] = Device.AUTO,
    kernels: Annotated[Kernels, typer.Option("--kernels", metavar="KERNELS", case_sensitive=False,
                                             help="auto (FlashInfer where its kernels run here, else torch), torch or "
                                                  "flashinfer.")] = Kernels.AUTO,
    rank: Annotated[int | None, typer.Option("--rank", metavar="R", min=0, help="Check one rank of a --tp/--ep "
                                             "output (cross-rank checks need all ranks).")] = None,
    layers: Annotated[str | None, typer.Option("--layers", metavar="PATTERN",
                                               help="Only modules whose name matches this wildcard.")] = None,
    tokens: Annotated[int, typer.Option("--tokens", metavar="N", min=1, help="Activation rows per module.")] = 64,
    seed: Annotated[int, typer.Option("--seed", metavar="S", help="Seed for activations and routing.")] = 0,
    junit_xml: Annotated[Path | None, typer.Option("--junit-xml", metavar="PATH",
                                                   help="Also write a JUnit XML report.")] = None,
    report_html: Annotated[Path | None, typer.Option("--report", metavar="PATH", help="Also write a self-contained "
                                                     "HTML heat map (error / threshold per module and rank).")] = None,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Check every byte of a converted directory and run real GEMMs against the source; exit 1 on failure."""

    def body(out: Output) -> int:
        from mocli.procenv import passive_omp, reuse_freed_memory, single_thread_blas
        from mocli.verify.early import start_digests

        passive_omp()
        single_thread_blas()
        reuse_freed_memory()
        early = start_digests(output, source, rank)  # hashing overlaps the torch import below
        warm_cuda(device.value)  # and so does CUDA's start-up
        try:
            from mocli.render import render_verify
            from mocli.verify import VerifyOptions, verify
            from mocli.verify.html import write_html
            from mocli.verify.junit import write_junit

            opts = VerifyOptions(source=source, device=device.value, kernels=kernels, layers=layers,
                                 tokens=tokens, seed=seed, rank=rank, early_digests=early)
            with out.module_progress("verifying") as progress:
                report = verify(output, opts, progress)
        finally:
            if early is not None:
                early.shutdown(wait=False)  # the process exits next
        if junit_xml is not None:
            write_junit(report, junit_xml)
        if report_html is not None:
            write_html(report, report_html)
        out.emit(report, render_verify)
        return 0 if report["ok"] else EXIT_FINDINGS

    _run(ctx, json_, body, quiet, verbose)


def _on_every_process(run: Callable[[Any], dict]) -> dict | None:
    """Under torchrun every process runs the command (sharing its units); only process 0's summary is
    printed. One process: just the command."""
    from mocli.engine.dist import dist_from_env

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


def main(argv: list[str] | None = None) -> Any:
    """The ``mocli`` program. Once the command has finished (outputs published, files closed, the
    process group left), a process that imported torch exits without tearing the interpreter down:
    unloading torch (and a CUDA context) took 0.35-0.5 s of every whole process on the build machine
    and the H200, time a user waits for nothing. Output streams are flushed first; atexit handlers
    are skipped, so the commands keep nothing for them."""
    try:
        app(args=argv, prog_name="mocli")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if "torch" not in sys.modules or argv is not None:  # argv: called as a library (tests), not as the program
        raise SystemExit(code)
    trace.mark("exit (interpreter teardown skipped)")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # EPIPE after the reader left, or a closed stream
            _silence_broken_pipe()
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
