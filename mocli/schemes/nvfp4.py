"""NVFP4: packed e2m1 weights (two per byte, low nibble first), an e4m3 block scale per 16 values, a
float32 global scale (``weight_scale_2``) and input scale (SEMANTICS §1, §5-§7)."""

from mocli.quant_config import NVFP4_GROUP_SIZE, Algo
from mocli.schemes.base import INPUT, Merge, ScaleSpec, Scheme, scalar
from mocli.tables import PRE_QUANT_SCALE, WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2


def _detect(tensors) -> bool:
    """A U8 weight whose scale is not MXFP4's U8 (an absent one: a TNS finding of NVFP4's), or an F8_E4M3
    block scale beside any weight."""
    w, s = tensors.get(WEIGHT), tensors.get(WEIGHT_SCALE)
    return w is not None and (w.dtype == "U8" and (s is None or s.dtype != "U8") or s is not None and s.dtype == "F8_E4M3")


NVFP4 = Scheme(Algo.NVFP4, "U8",
               (ScaleSpec(WEIGHT_SCALE, "F8_E4M3", lambda n, k: (n, k // NVFP4_GROUP_SIZE)),
                ScaleSpec(WEIGHT_SCALE_2, "F32", scalar), INPUT),
               pack=2, scale_rows=1, scale_cols=NVFP4_GROUP_SIZE, merge=Merge.RESCALE, merged_scale=WEIGHT_SCALE_2,
               group_size=NVFP4_GROUP_SIZE,
               nan_codes=((WEIGHT_SCALE, (0x7F, 0xFF)),), detect=lambda t: _detect(t) and WEIGHT in t,
               summary="FP4 E2M1 weights (two per byte), one FP8 E4M3 scale per 16 values and a global scale; "
                       "FP4 activations")


# W4A16_NVFP4: the NVFP4 weights without an input scale, activations left in BF16/FP16 (SEMANTICS §13.1).
# Its tensors are NVFP4's less one, so the stored tensors alone do not tell it from an NVFP4 module missing
# its input scale: a module is bound to it where the config says so (``mocli.schemes.bind``).
W4A16_NVFP4 = Scheme(Algo.W4A16_NVFP4, "U8",
                     (ScaleSpec(WEIGHT_SCALE, "F8_E4M3", lambda n, k: (n, k // NVFP4_GROUP_SIZE)),
                      ScaleSpec(WEIGHT_SCALE_2, "F32", scalar)),
                     pack=2, scale_rows=1, scale_cols=NVFP4_GROUP_SIZE, merge=Merge.RESCALE, merged_scale=WEIGHT_SCALE_2,
                     group_size=NVFP4_GROUP_SIZE, nan_codes=((WEIGHT_SCALE, (0x7F, 0xFF)),), stores_like=Algo.NVFP4,
                     summary="NVFP4's weights and scales, BF16/FP16 activations (weight-only)")


# NVFP4_AWQ (ModelOpt 0.47, SEMANTICS §15): NVFP4's tensors, plus a pre_quant_scale [K] on the modules whose
# AWQ smoothing the export could not fold into a preceding norm or linear: y = W (x * pre_quant_scale), the
# product taken in the activation dtype before NVFP4 activation quantization.
NVFP4_AWQ = Scheme(Algo.NVFP4_AWQ, "U8", NVFP4.scales, pack=2, scale_rows=1, scale_cols=NVFP4_GROUP_SIZE,
                   merge=Merge.RESCALE, merged_scale=WEIGHT_SCALE_2, group_size=NVFP4_GROUP_SIZE,
                   nan_codes=((WEIGHT_SCALE, (0x7F, 0xFF)),), stores_like=Algo.NVFP4,
                   optional=((PRE_QUANT_SCALE, ("BF16", "F16", "F32"), lambda n, k: (k,)),),
                   summary="NVFP4, with an AWQ pre_quant_scale per input channel where the export kept one")
