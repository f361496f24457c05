"""MXFP4: packed e2m1 weights (two per byte, the even element in the low nibble) with an E8M0
power-of-two scale per 32 values along K, stored as U8 biased exponents (value ``2^(c - 127)``; code 255
is NaN to torch's ``float8_e8m0fnu`` and +inf to the engines' bit-cast decoders), an optional bias; no
global or input scale (SEMANTICS §19.1). gpt-oss, compressed-tensors ``mxfp4-pack-quantized``, AMD Quark
and ModelOpt 0.47 ``mxfp4`` all store these bytes (§19.2), under their own names (``Spelling``).

Told apart from NVFP4 by the scale: both pack the weight as U8 [N, K/2], NVFP4's scale is F8_E4M3
[N, K/16], MXFP4's U8 [N, K/32]. Converted by `marlin` (dense and MoE) and `flashinfer-trtllm` (MoE), and re-encoded as block FP8 for both
FlashInfer targets with `--mxfp4-experts fp8-block` (§19.5-§19.7)."""

from mocli.quant_config import MXFP4_GROUP_SIZE, Algo
from mocli.schemes.base import ScaleSpec, Scheme, weight_is
from mocli.tables import WEIGHT_SCALE

BLOCK = MXFP4_GROUP_SIZE
BIAS = "bias"
NAN_SCALE = 0xFF  # E8M0 code 255


def _detect(tensors) -> bool:
    s = tensors.get(WEIGHT_SCALE)
    return weight_is(tensors, "U8") and s is not None and s.dtype == "U8"


MXFP4 = Scheme(Algo.MXFP4, "U8", (ScaleSpec(WEIGHT_SCALE, "U8", lambda n, k: (n, k // BLOCK)),),
               pack=2, scale_rows=1, scale_cols=BLOCK, group_size=BLOCK, nan_codes=((WEIGHT_SCALE, (NAN_SCALE,)),),
               detect=_detect, optional=((BIAS, ("BF16", "F16", "F32"), lambda n, k: (n,)),),
               summary="FP4 E2M1 weights (two per byte), one E8M0 scale per 32 values along K, optional bias")
