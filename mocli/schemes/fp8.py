"""FP8 per tensor (ModelOpt ``FP8``; vLLM's serialized ``fp8``, what ``mocli quantize`` writes):
e4m3 weights, one float32 weight scale and (static activations) one input scale (SEMANTICS §1, §3)."""

from mocli.quant_config import Algo
from mocli.schemes.base import INPUT, Merge, ScaleSpec, Scheme, scalar, weight_is
from mocli.tables import WEIGHT_SCALE


def _detect(tensors) -> bool:
    s = tensors.get(WEIGHT_SCALE)
    # 0-dim (ModelOpt) or [1] (compressed-tensors): one value
    return weight_is(tensors, "F8_E4M3") and (s is None or s.dtype != "U8" and len(s.shape) <= 1 and s.numel == 1)


FP8 = Scheme(Algo.FP8, "F8_E4M3", (ScaleSpec(WEIGHT_SCALE, "F32", scalar), INPUT),
             merge=Merge.REQUANTIZE, merged_scale=WEIGHT_SCALE, nan_codes=(("weight", (0x7F, 0xFF)),), detect=_detect,
             summary="FP8 E4M3 weights, one scale per tensor")
