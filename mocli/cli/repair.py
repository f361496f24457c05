"""``mocli repair``: a fixed ModelOpt checkpoint engines load as before (``mocli.repair``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mocli.cli.app import OUTPUT_HELP, ModelArg, OverwriteOpt, command, run
from mocli.output import Output


@command("repair")
def repair_cmd(
    ctx: typer.Context,
    model: ModelArg,
    output: Annotated[Path | None, typer.Option("--output", "-o", metavar="DIR", help=OUTPUT_HELP,
                                                show_default=False)] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", metavar="", help="Print the repair plan and write nothing.")]
    = False,
    overwrite: OverwriteOpt = False,
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

    run(ctx, body)
