"""``mocli verify``: every byte of an output and real GEMMs against the source (``mocli.verify``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mocli import trace
from mocli.cli.app import command, run
from mocli.devices import Device, Kernels, warm_cuda
from mocli.errors import EXIT_FINDINGS
from mocli.output import Output


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
) -> None:
    """Check every byte of a converted directory and run real GEMMs against the source; exit 1 on failure."""

    def body(out: Output) -> int:
        from mocli.formats import DirKind, detect
        from mocli.formats.layout import read_layout
        from mocli.procenv import passive_omp, reuse_freed_memory, single_thread_blas
        from mocli.verify.early import gpu_context_wanted, start_digests

        passive_omp()
        single_thread_blas()
        reuse_freed_memory()
        kind = detect(output)  # what the directory is, and its manifest, found once for both
        layout = read_layout(output) if kind is DirKind.LAYOUT else None
        early = start_digests(layout, source, rank)  # hashing overlaps the torch import below
        warm_cuda(device.value, context=gpu_context_wanted(layout, kernels))  # and so does CUDA's start-up
        trace.mark("manifest read, hashing started")
        try:
            from mocli.render import render_verify
            from mocli.verify import VerifyOptions, verify
            from mocli.verify.html import write_html
            from mocli.verify.junit import write_junit

            trace.mark("verify's modules imported")
            opts = VerifyOptions(source=source, device=device.value, kernels=kernels, layers=layers,
                                 tokens=tokens, seed=seed, rank=rank, early_digests=early)
            with out.module_progress("verifying") as progress:
                report = verify(output, opts, progress, kind=kind, layout=layout)
        finally:
            if early is not None:
                early.shutdown(wait=False)  # the process exits next
        if junit_xml is not None:
            write_junit(report, junit_xml)
        if report_html is not None:
            write_html(report, report_html)
        out.emit(report, render_verify)
        return 0 if report["ok"] else EXIT_FINDINGS

    run(ctx, body)
