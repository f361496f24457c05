"""FP8 per output channel, activations per token (ModelOpt ``FP8_PER_CHANNEL_PER_TOKEN``): one float32
scale per weight row, [N] (ModelOpt) or [N, 1] (compressed-tensors), no input scale (SEMANTICS §8)."""

from mocli.quant_config import Algo
from mocli.schemes.base import ScaleSpec, Scheme, weight_is
from mocli.tables import WEIGHT_SCALE


def _detect(tensors) -> bool:
    # after per-tensor and block (``mocli.schemes.SCHEMES`` order): any other float scale of an e4m3
    # weight is per channel, so a malformed one is named by its shape (TNS003), not left unquantized
    s = tensors.get(WEIGHT_SCALE)
    return weight_is(tensors, "F8_E4M3") and s is not None and s.dtype != "U8"


FP8_CHANNEL = Scheme(Algo.FP8_PER_CHANNEL_PER_TOKEN, "F8_E4M3",
                     (ScaleSpec(WEIGHT_SCALE, "F32", lambda n, k: (n,), also=lambda n, k: ((n, 1),)),),
                     scale_rows=1, nan_codes=(("weight", (0x7F, 0xFF)),), detect=_detect,
                     summary="FP8 E4M3 weights, one scale per output channel; activations per token")
