"""``mocli convert``: kernel-ready shards for one target, per rank (``mocli.convert``)."""

from __future__ import annotations

from typing import Annotated

import typer

from mocli import trace
from mocli.cli.app import (
    TARGETS,
    ConvertDeviceOpt,
    EpOpt,
    ModelArg,
    Mxfp4ExpertsOpt,
    OutputOpt,
    OverwriteOpt,
    ShardSizeOpt,
    TpOpt,
    command,
    on_every_process,
    parse_size,
    run,
    target_help,
)
from mocli.devices import Device, warm_cuda
from mocli.output import Output
from mocli.targets import Target
from mocli.targets.experts import Mxfp4Experts


@command("convert")
def convert_cmd(
    ctx: typer.Context,
    model: ModelArg,
    output: OutputOpt,
    target: Annotated[Target, typer.Option("--target", "-t", metavar="TARGET", case_sensitive=False,
                                           help=f"Kernel layout to write, one of {TARGETS}. {target_help()}",
                                           show_default=False)],
    tp: TpOpt = 1,
    ep: EpOpt = 1,
    mxfp4_experts: Mxfp4ExpertsOpt = Mxfp4Experts.NATIVE,
    device: ConvertDeviceOpt = Device.AUTO,
    overwrite: OverwriteOpt = False,
    max_shard_size: ShardSizeOpt = "2GB",
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

            summary = on_every_process(lambda dist: convert(
                ckpt, output, target, device=device.value, overwrite=overwrite, max_shard_bytes=shard_bytes,
                progress=progress, tp=tp, ep=ep, digests=digests, dist=dist, mxfp4_experts=mxfp4_experts))
        if summary is not None:
            out.emit(summary, render_convert)

    run(ctx, body)
