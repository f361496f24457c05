"""Dense linears as stored by ``mocli convert``: one kernel class per kind, in ``DENSE``.

Each takes ``x`` [T, K] (BF16/FP16, the rank's K) and returns ``y`` [T, N] in ``x.dtype`` (the
rank's N, padding cut off), with the activation quantization of verify's reference semantics
(``mocli.numerics.in_torch``; ``mocli/verify/kinds/`` checks the same math).
"""

from __future__ import annotations

import torch

from mocli.kinds import ModuleKind
from mocli.numerics.in_torch import (
    FP8,
    fp8_per_group_dequant,
    fp8_per_token,
    fp8_static,
    mxfp8_quant,
    nvfp4_quant,
    unpack_e2m1,
)
from mocli.ops import roundup
from mocli.serve.common import F8, F32, U8, Kernel, ServeError, gemm_dtype, mm

FP8_ALIGN = 16  # cuBLASLt FP8 GEMMs: N and K multiples of 16 (targets.base SHARED_CONSTRAINTS)


class DenseKernel(Kernel):
    @classmethod
    def spec(cls, meta, layout):
        n, k = int(meta["n"]), int(meta["k"])
        # a bias keeps its source dtype (None: any)
        return {"weight": (F8, (n, k)), "bias": (None, (n,))} | cls.scales(n, k, layout)

    @classmethod
    def scales(cls, n: int, k: int, layout) -> dict:
        raise NotImplementedError

    def __init__(self, tensors, meta, layout, name: str = "") -> None:
        self.n, self.k = int(meta["n"]), int(meta["k"])  # before the path is chosen: it depends on them
        self._w: torch.Tensor | None = None
        super().__init__(tensors, meta, layout, name)  # emulation: decoded weights, built on first use

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N] in x.dtype (+ bias)."""
        if x.shape[-1] != self.k:
            raise ServeError(f"{self.name}: input has {x.shape[-1]} features, the layout {self.k}")
        lead = x.shape[:-1]
        y = self.forward(x.reshape(-1, self.k)).to(x.dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*lead, self.n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def weights(self) -> torch.Tensor:
        """Emulation: the decoded weight matrix [N, K] in the GEMM dtype, cached."""
        if self._w is None:
            self._w = self.decode().to(gemm_dtype(self.device))
        return self._w

    def decode(self) -> torch.Tensor:
        raise NotImplementedError

    def _fp8_aligned(self) -> bool:
        return self.n % FP8_ALIGN == 0 and self.k % FP8_ALIGN == 0


class Fp8LinearKernel(DenseKernel):
    """FP8 per-tensor: y = (fp8(x / input_scale) @ weight.T) * input_scale * weight_scale."""

    kind = ModuleKind.FP8_LINEAR
    roles = ("weight", "weight_scale", "input_scale")

    @classmethod
    def scales(cls, n, k, layout):
        return {"weight_scale": (F32, ()), "input_scale": (F32, ())}

    def select(self):
        if self.device.at_least(8, 9) and self._fp8_aligned():
            return "torch._scaled_mm", False
        return "emulated FP8 (fp8 codes, float GEMM)", True

    def forward(self, x):
        a, s = self.t["input_scale"], self.t["weight_scale"]
        xq = fp8_static(x, a)
        if not self.emulated:
            return torch._scaled_mm(xq, self.t["weight"].t(), scale_a=a, scale_b=s, out_dtype=torch.bfloat16)
        return mm(xq, self.weights()) * (a.float() * s.float())

    def decode(self):
        return self.t["weight"].float()


class Fp8ChannelLinearKernel(DenseKernel):
    """FP8 per-channel weights [N] scales, dynamic per-token activations."""

    kind = ModuleKind.FP8_CHANNEL_LINEAR
    roles = ("weight", "weight_scale")

    @classmethod
    def scales(cls, n, k, layout):
        return {"weight_scale": (F32, (n,))}

    def select(self):
        if self.device.at_least(8, 9) and self._fp8_aligned():
            return "torch._scaled_mm (rowwise)", False
        return "emulated FP8 per-channel (fp8 codes, float GEMM)", True

    def forward(self, x):
        xq, xs = fp8_per_token(x)
        ws = self.t["weight_scale"].float()
        if not self.emulated:
            return torch._scaled_mm(xq, self.t["weight"].t(), scale_a=xs, scale_b=ws.reshape(1, -1),
                                    out_dtype=torch.bfloat16)
        return mm(xq, self.weights()) * xs * ws.reshape(1, -1)

    def decode(self):
        return self.t["weight"].float()


class Fp8BlockLinearKernel(DenseKernel):
    """FP8 128x128 block weights, dynamic 1x128 activation groups. No tensor-core path here (SEMANTICS
    §9 lists none on sm_90): always emulated, the weights dequantized once."""

    kind = ModuleKind.FP8_BLOCK_LINEAR
    roles = ("weight", "weight_scale")

    @classmethod
    def scales(cls, n, k, layout):
        return {"weight_scale": (F32, (roundup(n, 128) // 128, roundup(k, 128) // 128))}

    def select(self):
        return "emulated FP8 128x128 blocks (dequantized weights, float GEMM)", True

    def forward(self, x):
        return mm(fp8_per_group_dequant(x), self.weights())

    def decode(self):
        s = self.t["weight_scale"].float()
        blocks = s.repeat_interleave(128, dim=0)[: self.n].repeat_interleave(128, dim=1)[:, : self.k]
        return self.t["weight"].float() * blocks


class Nvfp4LinearKernel(DenseKernel):
    """NVFP4: y = (nvfp4(x, input_scale_inv) @ (e2m1 x block scale).T) * alpha. FlashInfer's mm_fp4 on
    sm_100+ for the layout it reads; elsewhere the layout decoded once (exact in BF16)."""

    kind = ModuleKind.NVFP4_LINEAR
    roles = ("weight", "weight_scale", "alpha", "input_scale_inv")

    @classmethod
    def spec(cls, meta, layout):
        n, k = int(meta["n"]), int(meta["k"])
        return super().spec(meta, layout) | {"weight": (U8, layout.nvfp4_weight_shape(n, k))}

    @classmethod
    def scales(cls, n, k, layout):
        return {"weight_scale": (F8, (roundup(n, 128), roundup(k // 16, 4))), "weight_scale_2": (F32, ()),
                "input_scale": (F32, ()), "alpha": (F32, ()), "input_scale_inv": (F32, ()),
                "pre_quant_scale": (torch.bfloat16, (k,))}

    def select(self):
        if self.device.flashinfer and self.layout.fp4_kernels:
            return "flashinfer.mm_fp4", False
        return "emulated NVFP4 (decoded layout, exact products)", True

    def forward(self, x):
        alpha = self.t["alpha"].float()
        if "pre_quant_scale" in self.t:  # NVFP4_AWQ: the activation scaled in BF16 before quantization (§15)
            x = x.bfloat16() * self.t["pre_quant_scale"]
        if not self.emulated:  # pragma: no cover - sm_100+
            return self._mm_fp4(x)
        return mm(nvfp4_quant(x, self.t["input_scale_inv"]), self.weights()) * alpha

    def decode(self):
        n, k = self.n, self.k
        codes = self.layout.nvfp4_weight_decode(self.t["weight"], n, k, f"{self.name}.weight")
        bs = self.layout.nvfp4_scale_decode(self.t["weight_scale"], n, k // 16, f"{self.name}.weight_scale")
        vals = unpack_e2m1(codes.contiguous()).reshape(n, k // 16, 16)
        return (vals * bs.view(FP8).float().reshape(n, k // 16, 1)).reshape(n, k)

    def _mm_fp4(self, x):  # pragma: no cover - sm_100+
        from flashinfer import fp4_quantize, mm_fp4

        pk = int(self.meta.get("padded_k", self.k))
        xp = torch.nn.functional.pad(x.bfloat16(), (0, pk - self.k))
        x_fp4, x_sf = fp4_quantize(xp, self.t["input_scale_inv"].reshape(1).float())
        y = mm_fp4(x_fp4, self.t["weight"].t(), x_sf, self.t["weight_scale"].t(), self.t["alpha"].reshape(1).float(),
                   torch.bfloat16)
        return y[:, : self.n]


class Mxfp8LinearKernel(DenseKernel):
    """MXFP8: y = mxfp8(x) @ (e4m3 x 2^(b - 127)).T, activations quantized per 32 values as the weights
    (SEMANTICS §14). No MX tensor-core path here (sm_90 has none; FlashInfer's mm_mxfp8 needs sm_100):
    the layout decoded once (exact in BF16: e4m3 times a power of two)."""

    kind = ModuleKind.MXFP8_LINEAR
    roles = ("weight", "weight_scale")

    @classmethod
    def spec(cls, meta, layout):
        n, k, np_ = int(meta["n"]), int(meta["k"]), int(meta.get("padded_n", meta["n"]))
        return {"weight": (F8, (np_, k)), "weight_scale": (U8, (roundup(np_, 128), roundup(k // 32, 4))),
                "bias": (None, (n,))}

    def select(self):
        return "emulated MXFP8 (decoded layout, exact products)", True

    def forward(self, x):
        return mm(mxfp8_quant(x), self.weights())

    def decode(self):
        n, k, np_ = self.n, self.k, int(self.meta.get("padded_n", self.n))
        w = self.layout.dense_rows_decode(self.t["weight"].view(U8))
        bs = self.layout.nvfp4_scale_decode(self.t["weight_scale"], np_, k // 32, f"{self.name}.weight_scale")
        if np_ != n and (bool(w[n:].any()) or bool(bs[n:].any())):
            raise ServeError(f"{self.name}: padding rows are not zero")
        scale = torch.exp2(bs[:n].float() - 127.0).repeat_interleave(32, dim=1)
        return w[:n].view(F8).float() * scale

