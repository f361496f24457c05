"""``mocli quantize``: the engines' online FP8 quantization, offline (``mocli.quantize``)."""

from __future__ import annotations

from typing import Annotated

import typer

from mocli.cli.app import (
    DeviceOpt,
    ModelArg,
    OutputOpt,
    OverwriteOpt,
    ShardSizeOpt,
    command,
    on_every_process,
    parse_size,
    run,
)
from mocli.devices import Device, warm_cuda
from mocli.output import Output
from mocli.schemes import FP8


@command("quantize")
def quantize_cmd(
    ctx: typer.Context,
    model: ModelArg,
    output: OutputOpt,
    scheme: Annotated[str, typer.Option("--scheme", metavar="SCHEME", help=f"fp8: {FP8.summary}, dynamic per-token "
                                        "activations (SEMANTICS §12).")] = "fp8",
    exclude: Annotated[list[str] | None, typer.Option("--exclude", metavar="PATTERN", help="Keep modules matching this wildcard "
                                                      "unquantized (repeatable).", show_default=False)] = None,
    device: DeviceOpt = Device.AUTO,
    overwrite: OverwriteOpt = False,
    max_shard_size: ShardSizeOpt = "2GB",
) -> None:
    """Quantize an unquantized checkpoint to FP8 once, offline, exactly as engines do it online at every start
    (vLLM 0.32-0.33: --quantization fp8_per_tensor; SGLang: --quantization fp8), streaming and resumable; serve
    the output with no --quantization flag."""

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

            summary = on_every_process(lambda dist: quantize(
                ckpt, output, scheme=scheme, exclude=exclude or [], device=device.value, overwrite=overwrite,
                max_shard_bytes=shard_bytes, progress=progress, digests=digests, dist=dist))
        if summary is not None:
            out.emit(summary, render_quantize)

    run(ctx, body)
