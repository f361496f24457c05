"""The marlin target's MXFP4 modules as stored (SEMANTICS §19.5), weight-only with BF16 activations:

    y = x @ (e2m1 x 2^(c - 127)).T (+ bias)

Served by decoding: the layout read back once by ``mocli.targets.mxfp4_marlin_decode`` (weight words as
NVFP4's repack, E8M0 scales un-permuted, the bias un-permuted), products exact in BF16 (an e2m1 value has
2 significant bits, the scale is a power of two), float32 accumulation. vLLM's CUDA Marlin kernel
(``apply_fp4_marlin_linear`` with no global scale) would take the stored tensors as they are; mocli does
not call it yet (a CUDA run decodes too).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from mocli.kinds import ModuleKind
from mocli.serve.common import U8, ServeError, mm
from mocli.serve.dense import DenseKernel
from mocli.serve.marlin import MarlinLinearKernel
from mocli.serve.moe import MoeKernel
from mocli.targets import mxfp4_marlin_decode as lay

I32 = torch.int32


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy()


class Mxfp4MarlinLinearKernel(DenseKernel):
    kind = ModuleKind.MXFP4_MARLIN_LINEAR
    roles = ("weight", "weight_scale")

    @classmethod
    def spec(cls, meta, layout):
        np_, kp = int(meta["padded_n"]), int(meta["padded_k"])
        return {"weight": (I32, (kp // 16, 2 * np_)), "weight_scale": (U8, (kp // lay.GROUP, np_)),
                "bias": (None, (np_,))}

    def __init__(self, tensors, meta, layout, name: str = "") -> None:
        if str(meta.get("act_dtype", "bfloat16")) != "bfloat16":
            raise ServeError(f"{name}: act_dtype {meta.get('act_dtype')!r}: mocli writes MXFP4 Marlin scales for bfloat16")
        self.np_ = int(meta["padded_n"])
        self._bias: tuple[int, torch.Tensor] | None = None
        super().__init__(tensors, meta, layout, name)

    def select(self):
        return "emulated Marlin MXFP4 W4A16 (decoded layout, exact products)", True

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N] in x.dtype; ``bias``: the stored Marlin bias [Np] (padded, permuted)."""
        if x.shape[-1] != self.k:
            raise ServeError(f"{self.name}: input has {x.shape[-1]} features, the layout {self.k}")
        lead = x.shape[:-1]
        y = mm(x.reshape(-1, self.k), self.weights())
        if bias is not None:
            y = y + self._logical_bias(bias)
        return y.to(x.dtype).reshape(*lead, self.n)

    _logical_bias = MarlinLinearKernel._logical_bias  # the same un-permute (marlin_decode.decode_bias)

    def decode(self):
        packed = lay.decode_weight(_np(self.t["weight"]), self.n, self.k, f"{self.name}.weight")
        codes = lay.decode_scales(_np(self.t["weight_scale"]), self.n, self.k // lay.GROUP, f"{self.name}.weight_scale")
        return torch.from_numpy(lay.dequant(packed, codes)).to(self.t["weight"].device)


class Mxfp4MarlinMoeKernel(MoeKernel):
    """MXFP4 experts in Marlin's layout. ``w13_rows`` "halves": [w1; w3] (each Ip rows), act = silu(w1 x) *
    w3 x. "interleaved" (gpt-oss): (gate, up) row pairs, biases, act = (u + 1) * g * sigmoid(alpha g) with
    g = min(gate, limit), u = clamp(up, -limit, limit) (SEMANTICS §19.2). The intermediate in the activation
    dtype, as Marlin keeps it. Emulated from the decode."""

    kind = ModuleKind.MXFP4_MARLIN_MOE
    roles = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")

    @classmethod
    def spec(cls, meta, layout):
        e, ip = int(meta["experts"]), int(meta["padded_intermediate"])
        hp = int(meta.get("padded_hidden") or meta["hidden"])
        return {"w13_weight": (I32, (e, hp // 16, 4 * ip)), "w13_weight_scale": (U8, (e, hp // lay.GROUP, 2 * ip)),
                "w2_weight": (I32, (e, ip // 16, 2 * hp)), "w2_weight_scale": (U8, (e, ip // lay.GROUP, hp)),
                "w13_bias": (torch.bfloat16, (e, 2 * ip)), "w2_bias": (torch.bfloat16, (e, hp))}

    def __init__(self, tensors, meta, layout, name: str = "") -> None:
        self.rows = meta.get("w13_rows")
        if (meta.get("activation"), self.rows) not in (("silu", "halves"), ("swigluoai", "interleaved")):
            raise ServeError(f"{name}: activation {meta.get('activation')!r} with w13 rows {self.rows!r}: mocli serves "
                             "MXFP4 Marlin experts as silu on [w1; w3] halves or swigluoai on interleaved rows")
        self.ip, self.pad = int(meta["padded_intermediate"]), int(meta.get("scale_pad", 0))
        self.hp = int(meta.get("padded_hidden") or meta["hidden"])
        self.alpha, self.limit = float(meta.get("swiglu_alpha") or 1.702), float(meta.get("swiglu_limit") or 7.0)
        super().__init__(tensors, meta, layout, name)
        self.b13 = self._bias("w13_bias", 2 * self.ip, 2 * self.inter)
        self.b2 = self._bias("w2_bias", self.hp, self.hidden)

    def select(self):
        return "emulated Marlin MXFP4 W4A16 MoE (decoded layout, exact products)", True

    def _bias(self, role: str, stored_n: int, n: int) -> torch.Tensor | None:
        t = self.t.get(role)
        if t is None:
            return None
        raw = t.detach().cpu().contiguous().view(torch.uint8).numpy().reshape(t.shape[0], stored_n, -1)
        back = np.stack([lay.decode_bias(raw[e], n, f"{self.name}.{role}[{e}]") for e in range(t.shape[0])])
        return torch.from_numpy(np.ascontiguousarray(back)).view(torch.bfloat16).reshape(t.shape[0], n).float().to(t.device)

    def act(self, o1: torch.Tensor) -> torch.Tensor:
        if self.rows == "halves":
            return F.silu(o1[:, : self.inter]) * o1[:, self.inter:]
        g, u = o1[:, 0::2].clamp(max=self.limit), o1[:, 1::2].clamp(-self.limit, self.limit)
        return (u + 1) * g * torch.sigmoid(self.alpha * g)

    def expert(self, e, x, w13, w2):
        o1 = mm(x, w13)
        if self.b13 is not None:
            o1 = o1 + self.b13[e]
        o2 = mm(self.act(o1).to(x.dtype), w2)
        return o2 + self.b2[e] if self.b2 is not None else o2

    def decode_w13(self, e):
        h, i, what = self.hidden, self.inter, f"{self.name}.w13"
        if self.rows == "interleaved":  # the rank's 2i rows first, the padding rows and columns after them
            packed = lay.decode_weight(_np(self.t["w13_weight"][e]), 2 * i, h, f"{what}_weight[{e}]")
            codes = lay.decode_scales(_np(self.t["w13_weight_scale"][e]), 2 * i, h // lay.GROUP,
                                      f"{what}_weight_scale[{e}]", fill=self.pad)
        else:
            packed = lay.halves(lay.decode_weight(_np(self.t["w13_weight"][e]), 2 * self.ip, h, f"{what}_weight[{e}]"),
                                i, self.ip, f"{what}_weight[{e}]")
            codes = lay.halves(lay.decode_scales(_np(self.t["w13_weight_scale"][e]), 2 * self.ip, h // lay.GROUP,
                                                 f"{what}_weight_scale[{e}]"), i, self.ip, f"{what}_weight_scale[{e}]")
        return torch.from_numpy(lay.dequant(packed, codes)).to(self.t["w13_weight"].device)

    def decode_w2(self, e):
        h, i, what = self.hidden, self.inter, f"{self.name}.w2"
        packed = lay.decode_weight(_np(self.t["w2_weight"][e]), h, i, f"{what}_weight[{e}]")
        codes = lay.decode_scales(_np(self.t["w2_weight_scale"][e]), h, i // lay.GROUP, f"{what}_weight_scale[{e}]",
                                  fill=self.pad)
        return torch.from_numpy(lay.dequant(packed, codes)).to(self.t["w2_weight"].device)


__all__ = ["Mxfp4MarlinLinearKernel", "Mxfp4MarlinMoeKernel"]
