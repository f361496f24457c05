"""``mocli validate``: findings with codes, exit 1 on errors (``mocli.validate``)."""

from __future__ import annotations

from typing import Annotated

import typer

from mocli.cli.app import (
    EpOpt,
    ModelArg,
    Mxfp4ExpertsOpt,
    OutputFormat,
    TargetOpt,
    TpOpt,
    command,
    run,
)
from mocli.engines import Engine
from mocli.errors import EXIT_FINDINGS, InputError
from mocli.output import Output
from mocli.targets.experts import Mxfp4Experts


@command("validate")
def validate_cmd(
    ctx: typer.Context,
    model: ModelArg,
    target: TargetOpt = None,
    tp: TpOpt = 1,
    ep: EpOpt = 1,
    mxfp4_experts: Mxfp4ExpertsOpt = Mxfp4Experts.NATIVE,
    deep: Annotated[bool, typer.Option("--deep", metavar="", help="Also scan every weight and scale byte for NaN/Inf codes "
                                       "(reads the whole checkpoint at disk speed).")] = False,
    select: Annotated[list[str] | None, typer.Option("--select", metavar="CODE", help="Report only these codes "
                                                     "(a prefix selects a family: EXC, SCL00); repeatable.")] = None,
    ignore: Annotated[list[str] | None, typer.Option("--ignore", metavar="CODE", help="Do not report these codes "
                                                     "(prefixes too); repeatable.")] = None,
    engine: Annotated[Engine, typer.Option("--engine", metavar="ENGINE", case_sensitive=False,
                                           help="Whose reading of exclusions and algorithms to check: vllm "
                                                "(0.32-0.33), sglang (0.5.23) or all.")] = Engine.VLLM,
    warnings_as_errors: Annotated[bool, typer.Option("--warnings-as-errors", metavar="",
                                                     help="Exit 1 on warnings too.")] = False,
    output_format: Annotated[OutputFormat, typer.Option("--output-format", metavar="FORMAT", case_sensitive=False,
                                                        help="full (a table) or concise (one line per finding: "
                                                             "location: CODE severity: message (hint))."
                                                        )] = OutputFormat.FULL,
) -> None:
    """Check config, exclusions, tensors, scales, a target's and a TP/EP layout's constraints, as the engine(s)
    read them; exit 1 on errors. The verdict line names what was judged (engines, target, tp, ep), a "not judged"
    line follows for each thing that was not; where no engine's reading could be judged (e.g. --engine sglang
    on compressed-tensors) the verdict is NOT JUDGED and the exit status 2, never OK."""

    def body(out: Output) -> int:
        from mocli.checkpoint import open_checkpoint
        from mocli.parallel import ParallelLayout
        from mocli.render import render_validation, render_validation_concise
        from mocli.validate import validate

        ckpt = open_checkpoint(model)
        with out.progress_bar("scanning") as progress:
            report = validate(ckpt, target, parallel=ParallelLayout(tp, ep), deep=deep, progress=progress,
                              engine=engine, mxfp4_experts=mxfp4_experts, keep_plan=False)
        report.filter(select or [], ignore or [])
        report.warnings_as_errors = warnings_as_errors
        out.emit(report.to_dict(), render_validation_concise if output_format is OutputFormat.CONCISE
                 else render_validation)
        if report.failed:
            return EXIT_FINDINGS
        if report.nothing_judged:  # never a bare OK: exit 2, as for a question mocli cannot answer
            raise InputError(f"validate --engine {engine}: nothing judged: "
                             + "; ".join(f"{n['label']}: {n['why']}" for n in report.not_judged if n["what"] != "target"),
                             hint="--engine vllm judges this checkpoint" if engine is not Engine.VLLM else None)
        return 0

    run(ctx, body)
