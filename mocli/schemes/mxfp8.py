"""MXFP8 (ModelOpt ``MXFP8``): e4m3 weights with an E8M0 power-of-two scale per 32 values along K,
stored as U8 biased exponents (value ``2^(b - 127)``, ``b = 255`` is NaN); no global or input scale,
activations quantized at run time (SEMANTICS §14.1). Linears convert to every target (both FlashInfer
targets' layout, which marlin keeps), experts to flashinfer-trtllm only (SEMANTICS §14.3)."""

from mocli.quant_config import Algo
from mocli.schemes.base import ScaleSpec, Scheme, weight_is
from mocli.tables import WEIGHT_SCALE

BLOCK = 32


def _detect(tensors) -> bool:
    s = tensors.get(WEIGHT_SCALE)
    return weight_is(tensors, "F8_E4M3") and s is not None and s.dtype == "U8"


MXFP8 = Scheme(Algo.MXFP8, "F8_E4M3", (ScaleSpec(WEIGHT_SCALE, "U8", lambda n, k: (n, k // BLOCK)),),
               scale_rows=1, scale_cols=BLOCK, group_size=BLOCK, nan_codes=(("weight", (0x7F, 0xFF)), (WEIGHT_SCALE, (0xFF,))),
               detect=_detect, summary="FP8 E4M3 weights, one E8M0 scale per 32 values along K")
