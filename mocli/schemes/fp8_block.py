"""FP8 128x128 blocks, weight-only (ModelOpt ``FP8_PB_WO``): one float32 scale per 128x128 block,
[N/128, 1, K/128, 1] (ModelOpt) or [N/128, K/128]; activations per token group of 128 at run time
(SEMANTICS §8)."""

from mocli.quant_config import Algo
from mocli.schemes.base import ScaleSpec, Scheme, weight_is
from mocli.tables import WEIGHT, WEIGHT_SCALE

BLOCK = 128


def _detect(tensors) -> bool:
    """4-D (ModelOpt), or 2-D [ceil(N/128), ceil(K/128)] and not per channel's [N, 1] (with K <= 128 the
    block grid is [N/128, 1] too: its row count tells them apart)."""
    s, w = tensors.get(WEIGHT_SCALE), tensors.get(WEIGHT)
    if not weight_is(tensors, "F8_E4M3") or s is None or s.dtype == "U8":
        return False
    if len(s.shape) == 4:
        return True
    if len(s.shape) != 2 or len(w.shape) != 2:
        return False
    n, k = w.shape
    return tuple(s.shape) != (n, 1) and (s.shape[1] != 1 or s.shape[0] == -(-n // BLOCK))


FP8_BLOCK = Scheme(Algo.FP8_PB_WO, "F8_E4M3",
                   (ScaleSpec(WEIGHT_SCALE, "F32", lambda n, k: (n // BLOCK, 1, k // BLOCK, 1),
                              also=lambda n, k: ((n // BLOCK, k // BLOCK),)),),
                   scale_rows=BLOCK, scale_cols=BLOCK, nan_codes=(("weight", (0x7F, 0xFF)),), detect=_detect,
                   summary="FP8 E4M3 weights, one scale per 128x128 block")
