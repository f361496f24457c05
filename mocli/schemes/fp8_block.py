"""FP8 128x128 blocks, weight-only (ModelOpt ``FP8_PB_WO``): one float32 scale per 128x128 block,
[N/128, 1, K/128, 1] (ModelOpt) or [N/128, K/128]; activations per token group of 128 at run time
(SEMANTICS §8)."""

from mocli.quant_config import Algo
from mocli.schemes.base import ScaleSpec, Scheme, weight_is
from mocli.tables import WEIGHT_SCALE

BLOCK = 128


def _detect(tensors) -> bool:
    s = tensors.get(WEIGHT_SCALE)
    return (weight_is(tensors, "F8_E4M3") and s is not None and s.dtype != "U8"
            and (len(s.shape) == 4 or len(s.shape) == 2 and s.shape[1] != 1))


FP8_BLOCK = Scheme(Algo.FP8_PB_WO, "F8_E4M3",
                   (ScaleSpec(WEIGHT_SCALE, "F32", lambda n, k: (n // BLOCK, 1, k // BLOCK, 1),
                              also=lambda n, k: ((n // BLOCK, k // BLOCK),)),),
                   scale_rows=BLOCK, scale_cols=BLOCK, nan_codes=(("weight", (0x7F, 0xFF)),), detect=_detect)
