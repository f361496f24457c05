"""``mocli inspect``: what is in a checkpoint, from headers only."""

from __future__ import annotations

import typer

from mocli.cli.app import ModelArg, command, run
from mocli.output import Output


@command("inspect")
def inspect_cmd(ctx: typer.Context, model: ModelArg) -> None:
    """Show what is in a checkpoint, from headers only."""
    from mocli.checkpoint import open_checkpoint
    from mocli.inspection import inspect_checkpoint
    from mocli.render import render_inspect

    def body(out: Output) -> None:
        info = inspect_checkpoint(open_checkpoint(model))
        out.emit(info, render_inspect)

    run(ctx, body)
