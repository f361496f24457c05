"""gpt-oss's native MXFP4 experts (``quant_method: "mxfp4"``, SEMANTICS §19.2), presented per expert.

Per MoE layer ``<layer>.mlp.experts`` the checkpoint holds all experts in one tensor per projection:
``gate_up_proj_blocks`` U8 [E, 2I, H/32, 16], ``gate_up_proj_scales`` U8 [E, 2I, H/32], ``gate_up_proj_bias``
[E, 2I] (rows interleaved: 2i gate_i, 2i+1 up_i) and ``down_proj_*`` alike with [E, H, I/32, 16]. vLLM reshapes
the blocks, never re-packs them (``models/gpt_oss.py :: GptOssModel._load_weights_mxfp4``: ``view(E, 2I, -1)``),
so expert ``e``'s bytes are one contiguous [N, K/2] U8 slice. ``expand`` turns each well-formed projection into
per-expert modules ``<layer>.mlp.experts.<e>.{gate_up_proj, down_proj}`` whose entries point at those slices and
keep the checkpoint tensor's name (findings and ``validate --deep`` name the real tensor). A projection whose
tensors do not fit that layout is left as it is; ``mocli.validate.mxfp4`` names what is wrong with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mocli.schemes.mxfp4 import BIAS, BLOCK
from mocli.schemes.spelling import Spelling
from mocli.tables import WEIGHT, WEIGHT_SCALE

if TYPE_CHECKING:
    from mocli.io.safetensors_file import TensorEntry

PROJECTIONS = ("gate_up_proj", "down_proj")
BLOCKS, SCALES, BIASES = "_blocks", "_scales", "_bias"
BLOCK_BYTES = BLOCK // 2  # 16 bytes hold one 32-value block


def layout_fault(blocks: TensorEntry, scales: TensorEntry | None, bias: TensorEntry | None) -> str:
    """Why one projection's tensors are not gpt-oss's layout ("" when they are)."""
    if blocks.dtype != "U8" or len(blocks.shape) != 4 or blocks.shape[3] != BLOCK_BYTES or 0 in blocks.shape:
        return (f"is {blocks.dtype} {list(blocks.shape)}: gpt-oss stores U8 [E, N, K/32, {BLOCK_BYTES}] "
                f"({BLOCK_BYTES} bytes hold one block of {BLOCK} e2m1 values)")
    if scales is None:
        return f"has no {blocks.name.removesuffix(BLOCKS).rpartition('.')[2]}{SCALES} (its E8M0 block scales)"
    if scales.dtype != "U8" or tuple(scales.shape) != tuple(blocks.shape[:3]):
        return (f"does not match its scales {scales.name} ({scales.dtype} {list(scales.shape)}): one U8 scale per "
                f"block, [E, N, K/32] = {list(blocks.shape[:3])}")
    if bias is not None and tuple(bias.shape) != tuple(blocks.shape[:2]):
        return f"does not match its bias {bias.name} {list(bias.shape)}: one per output row, [E, N] = {list(blocks.shape[:2])}"
    return ""


def _slice(e: TensorEntry, index: int, shape: tuple[int, ...]) -> TensorEntry:
    """Expert ``index``'s part of an expert-major tensor, under the tensor's own name."""
    stride = e.nbytes // e.shape[0]
    return e._replace(shape=shape, start=e.start + index * stride, nbytes=stride)


def _per_expert(layer: str, proj: str, ts: dict[str, TensorEntry]) -> dict[str, dict[str, TensorEntry]] | None:
    blocks, scales, bias = ts.get(proj + BLOCKS), ts.get(proj + SCALES), ts.get(proj + BIASES)
    if blocks is None or layout_fault(blocks, scales, bias):
        return None
    experts, n, groups, _ = blocks.shape
    out = {}
    for e in range(experts):
        mod = {WEIGHT: _slice(blocks, e, (n, groups * BLOCK_BYTES)), WEIGHT_SCALE: _slice(scales, e, (n, groups))}
        if bias is not None:
            mod[BIAS] = _slice(bias, e, (n,))
        out[f"{layer}.{e}.{proj}"] = mod
    return out


def expand(by_module: dict[str, dict[str, TensorEntry]]) -> dict[str, dict[str, TensorEntry]]:
    """Each ``…experts`` module's well-formed projections as per-expert modules; the rest left as they are."""
    out: dict[str, dict[str, TensorEntry]] = {}
    for module, ts in by_module.items():
        if not module.endswith(".experts"):
            out[module] = ts
            continue
        rest = dict(ts)
        for proj in PROJECTIONS:
            split = _per_expert(module, proj, ts)
            if split is not None:
                out |= split
                for suffix in (BLOCKS, SCALES, BIASES):
                    rest.pop(proj + suffix, None)
        if rest:
            out[module] = rest
    return out


GPT_OSS = Spelling("mxfp4", expand=expand)
