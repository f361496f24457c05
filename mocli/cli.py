"""The command line: parse options, call one core function, render. No logic of its own."""

from __future__ import annotations

import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from mocli import __version__
from mocli.devices import Device, Kernels
from mocli.errors import (
    EXIT_BROKEN_PIPE,
    EXIT_FINDINGS,
    EXIT_INTERNAL,
    EXIT_UNUSABLE,
    InputError,
    MocliError,
    os_error,
)
from mocli.output import Output
from mocli.targets import Target

app = typer.Typer(
    name="mocli",
    help="Inspect, validate, convert and verify NVIDIA ModelOpt quantized checkpoints for FlashInfer kernels.",
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

ModelArg = Annotated[str, typer.Argument(metavar="MODEL", help="Checkpoint directory or Hugging Face repo id (owner/name[@revision]).",
                                         show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Only errors on stderr; no progress or warnings.")]
VerboseOpt = Annotated[int, typer.Option("--verbose", "-v", count=True,
                                         help="Timing on stderr; -vv also prints tracebacks of internal errors.")]
TargetOpt = Annotated[Target | None, typer.Option("--target", "-t", help="Also check this target's constraints.",
                                                  case_sensitive=False)]


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
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Exit codes: 0 ok, 1 findings (validation/verification failed), 2 unusable input, 3 internal error,
    130 interrupted, 141 stdout closed."""
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
        out.error(e.message, e.hint)
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt:
        out.error("interrupted")
        raise typer.Exit(130) from None
    except typer.Exit:
        raise
    except OSError as e:  # environment, not a bug: full disk, read-only or vanished paths
        out.error(*os_error(e))
        raise typer.Exit(EXIT_UNUSABLE) from None
    except Exception as e:  # noqa: BLE001 - the last line of defence
        if os.environ.get("MOCLI_DEBUG") or out.verbose >= 2:
            traceback.print_exc()
        notes = "; ".join(getattr(e, "__notes__", []))
        out.error(f"internal error: {type(e).__name__}: {e}",
                  "this is a mocli bug; set MOCLI_DEBUG=1 for the traceback and report it" + (f"; {notes}" if notes else ""))
        raise typer.Exit(EXIT_INTERNAL) from None


def _run(ctx: typer.Context, json_: bool, body: Callable[[Output], int | None], quiet: bool = False,
         verbose: int = 0) -> None:
    out = _out(ctx, json_, quiet, verbose)
    t0 = time.perf_counter()
    with _errors(out):
        code = body(out)
    if out.verbose:
        out.info(f"[dim]{ctx.info_name} finished in {time.perf_counter() - t0:.2f} s (exit {code or 0})[/]")
    if code:
        raise typer.Exit(code)


@app.command("inspect")
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


SHARD_HELP = ("Shard size limit (decimal units, e.g. 5GB, 500MB). Each shard is hashed in one pass: smaller "
              "shards hash and load in parallel.")
# Options of the commands that write a checkpoint (convert, repair, quantize).
_OUTPUT_HELP = "Output directory (created; must be empty)."
OutputOpt = Annotated[Path, typer.Option("--output", "-o", help=_OUTPUT_HELP, show_default=False)]
DeviceOpt = Annotated[Device, typer.Option("--device", help="Where to compute: auto picks CUDA when present.",
                                           case_sensitive=False)]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace a non-empty OUTPUT.")]
ShardSizeOpt = Annotated[str, typer.Option("--max-shard-size", help=SHARD_HELP)]
TpOpt = Annotated[int, typer.Option("--tp", min=1, help="Tensor-parallel size (SEMANTICS §10).")]
EpOpt = Annotated[int, typer.Option("--ep", min=1, help="Expert-parallel size for MoE layers (ep = tp x dp; 1: MoE "
                                    "tensor-parallel over --tp).")]


@app.command("validate")
def validate_cmd(
    ctx: typer.Context,
    model: ModelArg,
    target: TargetOpt = None,
    tp: TpOpt = 1,
    ep: EpOpt = 1,
    deep: Annotated[bool, typer.Option("--deep", help="Also scan every weight and scale byte for NaN/Inf codes "
                                       "(reads the whole checkpoint at disk speed).")] = False,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Check config, exclusions, tensors, scales, a target's and a TP/EP layout's constraints; exit 1 on errors."""

    def body(out: Output) -> int:
        from mocli.checkpoint import open_checkpoint
        from mocli.parallel import ParallelLayout
        from mocli.render import render_validation
        from mocli.validate import validate

        ckpt = open_checkpoint(model)
        with out.progress_bar("scanning") as progress:
            report = validate(ckpt, target, parallel=ParallelLayout(tp, ep), deep=deep, progress=progress)
        out.emit(report.to_dict(), render_validation)
        return 0 if report.ok else EXIT_FINDINGS

    _run(ctx, json_, body, quiet, verbose)


@app.command("convert")
def convert_cmd(
    ctx: typer.Context,
    model: ModelArg,
    output: OutputOpt,
    target: Annotated[Target, typer.Option("--target", "-t", case_sensitive=False, help="Kernel layout to write.",
                                           show_default=False)],
    tp: TpOpt = 1,
    ep: EpOpt = 1,
    device: DeviceOpt = Device.AUTO,
    overwrite: OverwriteOpt = False,
    max_shard_size: ShardSizeOpt = "2GB",
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Convert a checkpoint into kernel-ready FlashInfer shards, per rank with --tp/--ep (streaming, resumable;
    under torchrun the processes share the work)."""

    def body(out: Output) -> None:
        from mocli.checkpoint import open_checkpoint
        from mocli.io.digests import SourceDigests

        shard_bytes = parse_size(max_shard_size)
        with out.progress_bar("converting") as progress:
            progress.phase("reading headers")
            ckpt = open_checkpoint(model)
            digests = SourceDigests([h.path for h in ckpt.files])  # hashing overlaps the torch import
            progress.phase("loading torch")
            from mocli.convert import convert
            from mocli.render import render_convert

            summary = _on_every_process(lambda dist: convert(
                ckpt, output, target, device=device.value, overwrite=overwrite, max_shard_bytes=shard_bytes,
                progress=progress, tp=tp, ep=ep, digests=digests, dist=dist))
        if summary is not None:
            out.emit(summary, render_convert)

    _run(ctx, json_, body, quiet, verbose)


@app.command("repair")
def repair_cmd(
    ctx: typer.Context,
    model: ModelArg,
    output: Annotated[Path | None, typer.Option("--output", "-o", help=_OUTPUT_HELP, show_default=False)] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the repair plan and write nothing.")] = False,
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


@app.command("quantize")
def quantize_cmd(
    ctx: typer.Context,
    model: ModelArg,
    output: OutputOpt,
    scheme: Annotated[str, typer.Option("--scheme", help="fp8: per-tensor FP8 weights, dynamic per-token "
                                        "activations (SEMANTICS §12).")] = "fp8",
    exclude: Annotated[list[str] | None, typer.Option("--exclude", help="Keep modules matching this wildcard "
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

        shard_bytes = parse_size(max_shard_size)
        with out.progress_bar("quantizing") as progress:
            progress.phase("reading headers")
            ckpt = open_checkpoint(model)
            digests = SourceDigests([h.path for h in ckpt.files])
            progress.phase("loading torch")
            from mocli.quantize import quantize
            from mocli.render import render_quantize

            summary = _on_every_process(lambda dist: quantize(
                ckpt, output, scheme=scheme, exclude=exclude or [], device=device.value, overwrite=overwrite,
                max_shard_bytes=shard_bytes, progress=progress, digests=digests, dist=dist))
        if summary is not None:
            out.emit(summary, render_quantize)

    _run(ctx, json_, body, quiet, verbose)


@app.command("verify")
def verify_cmd(
    ctx: typer.Context,
    output: Annotated[Path, typer.Argument(metavar="OUT", show_default=False,
                                           help="A directory written by mocli convert or quantize.")],
    source: Annotated[str | None, typer.Option("--source", help="Source checkpoint (default: from provenance).")]
    = None,
    device: Annotated[Device, typer.Option("--device", case_sensitive=False,
                                           help="Where to run the kernels.")] = Device.AUTO,
    kernels: Annotated[Kernels, typer.Option("--kernels", case_sensitive=False,
                                             help="auto: FlashInfer where its kernels run here, else torch.")]
    = Kernels.AUTO,
    rank: Annotated[int | None, typer.Option("--rank", min=0, help="Check one rank of a --tp/--ep output "
                                             "(cross-rank checks need all ranks).")] = None,
    layers: Annotated[str | None, typer.Option("--layers", help="Only modules whose name matches this wildcard.")]
    = None,
    tokens: Annotated[int, typer.Option("--tokens", min=1, help="Activation rows per module.")] = 64,
    seed: Annotated[int, typer.Option("--seed", help="Seed for activations and routing.")] = 0,
    junit_xml: Annotated[Path | None, typer.Option("--junit-xml", help="Also write a JUnit XML report.")] = None,
    report_html: Annotated[Path | None, typer.Option("--report", help="Also write a self-contained HTML heat map "
                                                     "(error / threshold per module and rank).")] = None,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Check every byte of a converted directory and run real GEMMs against the source; exit 1 on failure."""

    def body(out: Output) -> int:
        from mocli.render import render_verify
        from mocli.verify import VerifyOptions, verify
        from mocli.verify.html import write_html
        from mocli.verify.junit import write_junit

        opts = VerifyOptions(source=source, device=device.value, kernels=kernels, layers=layers,
                             tokens=tokens, seed=seed, rank=rank)
        with out.module_progress("verifying") as progress:
            report = verify(output, opts, progress)
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


def parse_size(text: str) -> int:
    """'5GB' / '500MB' / '123' -> bytes (decimal units, as huggingface_hub)."""
    units = {"TB": 1000**4, "GB": 1000**3, "MB": 1000**2, "KB": 1000, "B": 1}
    t = text.strip().upper()
    for suffix, mult in units.items():
        if t.endswith(suffix) and t[: -len(suffix)].strip().replace(".", "", 1).isdigit():
            return int(float(t[: -len(suffix)]) * mult)
    if t.isdigit() and int(t) > 0:
        return int(t)
    raise InputError(f"--max-shard-size {text!r}: not a size", hint="use e.g. 5GB, 500MB or a byte count")


def main(argv: list[str] | None = None) -> Any:
    return app(args=argv, prog_name="mocli")


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
