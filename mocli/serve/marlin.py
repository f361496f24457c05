"""The marlin target's modules as stored (SEMANTICS §13.5-§13.6): NVFP4 weights, BF16 activations.

    y = (x @ (e2m1 x block scale).T) * S2          S2 = weight_global_scale * sf / 2^119 (bf16 scales)

Two paths. With vLLM's Marlin kernels importable on a CUDA device (sm_75+), the stored tensors are what
``apply_fp4_marlin_linear`` and ``fused_marlin_moe`` take, as they are: nothing is computed at load.
Each kernel proves itself once per process on its first module (``_proven``): a few random tokens
through the Marlin kernel and through the decode below must agree, or that module kind falls back to
the decode with a warning. Elsewhere, and always on the CPU: the layout decoded once by
``mocli.targets.marlin``'s inverses (flushed blocks read as zero, exactly as the kernel reads them),
products exact in BF16, float32 accumulation. A bias is the stored one (padded to Np, permuted).
"""

from __future__ import annotations

import logging
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from mocli.kinds import ModuleKind
from mocli.numerics.in_torch import FP8, unpack_e2m1
from mocli.serve.common import F8, F32, Kernel, ServeError, gemm_dtype, mm
from mocli.serve.dense import DenseKernel
from mocli.serve.moe import MoeKernel
from mocli.targets import marlin_decode as lay

I32 = torch.int32
log = logging.getLogger("mocli.serve")
PROBE_TOKENS, PROBE_TOLERANCE = 8, 0.02  # relative rms of the kernel's output against the decode's


@lru_cache(maxsize=1)
def _vllm_marlin():
    """vLLM's Marlin entry points, or None where vLLM (its CUDA build) is not importable."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe
        from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_make_workspace_new
        from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import apply_fp4_marlin_linear
        from vllm.scalar_type import scalar_types
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return apply_fp4_marlin_linear, fused_marlin_moe, marlin_make_workspace_new, scalar_types.float4_e2m1f.id


_proven: dict[ModuleKind, bool] = {}


def _prove(k: Kernel, run_kernel, run_decode, x: torch.Tensor) -> bool:
    """Whether vLLM's Marlin kernel agrees with the decode on ``x`` (once per kind and process)."""
    if k.kind not in _proven:
        try:
            got, want = run_kernel(x).float(), run_decode(x).float()
            err = float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt().clamp(min=1e-30))
            _proven[k.kind] = err <= PROBE_TOLERANCE
            why = f"relative rms {err:.3g}"
        except Exception as e:  # noqa: BLE001 - a kernel that cannot run is not used
            _proven[k.kind], why = False, f"{type(e).__name__}: {e}"
        if not _proven[k.kind]:
            log.warning("mocli: vLLM's Marlin kernel disagrees with the layout's decode on %s (%s); %s modules "
                        "run decoded instead", k.name, why, k.kind)
    return _proven[k.kind]


def _sizes(meta) -> tuple[str, float]:
    act = str(meta.get("act_dtype", "bfloat16"))
    if act not in lay.GLOBAL_SHIFT:
        raise ServeError(f"act_dtype {act!r} is not bfloat16 or float16")
    return act, float(meta.get("scale_factor", 1.0))


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy()


def _dequant(packed: np.ndarray, codes: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    """e2m1 values times their e4m3 block scales, float32 [rows, cols]: exact in BF16 (<= 7 significant bits)."""
    vals = unpack_e2m1(torch.from_numpy(packed)).reshape(rows, cols // 16, 16)
    return (vals * torch.from_numpy(codes).view(FP8).float().reshape(rows, cols // 16, 1)).reshape(rows, cols)


class MarlinLinearKernel(DenseKernel):
    kind = ModuleKind.NVFP4_MARLIN_LINEAR
    roles = ("weight", "weight_scale", "weight_global_scale")

    @classmethod
    def spec(cls, meta, layout):
        np_, kp = int(meta["padded_n"]), int(meta["padded_k"])
        return {"weight": (I32, (kp // 16, 2 * np_)), "weight_scale": (F8, (kp // 16, np_)),
                "weight_global_scale": (F32, ()), "input_global_scale": (F32, ()), "bias": (None, (np_,))}

    def __init__(self, tensors, meta, layout, name: str = "") -> None:
        self.act, self.sf = _sizes(meta)
        self.np_, self.kp = int(meta["padded_n"]), int(meta["padded_k"])
        self._bias: tuple[int, torch.Tensor] | None = None
        super().__init__(tensors, meta, layout, name)
        self.s2 = float(lay.global_of(self.t["weight_global_scale"].item(), self.sf, self.act))

    def select(self):
        if self.device.cuda and _vllm_marlin() is not None:
            return "vllm apply_fp4_marlin_linear (Marlin, W4A16)", False
        return "emulated Marlin W4A16 (decoded layout, exact products)", True

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N] in x.dtype; ``bias``: the stored Marlin bias [Np] (padded, permuted)."""
        if x.shape[-1] != self.k:
            raise ServeError(f"{self.name}: input has {x.shape[-1]} features, the layout {self.k}")
        lead, x2 = x.shape[:-1], x.reshape(-1, self.k)
        if not self.emulated and _prove(self, lambda a: self._marlin(a, None), self._decoded, x2[:PROBE_TOKENS]):
            y = self._marlin(x2, bias)
        else:
            y = self._decoded(x2)
            if bias is not None:
                y = y + self._logical_bias(bias)
        return y.to(x.dtype).reshape(*lead, self.n)

    def _decoded(self, x: torch.Tensor) -> torch.Tensor:
        return mm(x, self.weights()) * self.s2

    def _marlin(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # pragma: no cover - CUDA vLLM
        apply, _, workspace, _ = _vllm_marlin()
        if not hasattr(self, "_ws"):
            self._ws = workspace(x.device)
        return apply(x.to(getattr(torch, self.act)), self.t["weight"], self.t["weight_scale"],
                     self.t["weight_global_scale"], self._ws, self.n, self.k, bias)

    def _logical_bias(self, bias: torch.Tensor) -> torch.Tensor:
        """The stored bias un-permuted to [N] once (per bias tensor)."""
        if self._bias is None or self._bias[0] != bias.data_ptr():
            raw = bias.detach().cpu().contiguous()
            back = lay.decode_bias(raw.view(torch.uint8).numpy().reshape(self.np_, -1), self.n, f"{self.name}.bias")
            self._bias = (bias.data_ptr(), torch.from_numpy(back.copy()).reshape(-1).view(raw.dtype).to(bias.device))
        return self._bias[1].float()

    def decode(self):
        what = self.name
        packed = lay.decode_weight(_np(self.t["weight"]), self.n, self.k, f"{what}.weight")
        codes = lay.decode_scales(_np(self.t["weight_scale"]), self.n, self.k // 16, self.sf, f"{what}.weight_scale")
        return _dequant(packed, codes, self.n, self.k).to(self.t["weight"].device)


class MarlinMoeKernel(MoeKernel):
    """Experts with w13 rows [w1; w3] (each half zero-padded to Ip): act = silu(first half) * second half."""

    kind = ModuleKind.NVFP4_MARLIN_MOE
    roles = ("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w2_weight", "w2_weight_scale",
             "w2_weight_scale_2")

    @classmethod
    def spec(cls, meta, layout):
        e, h, ip = int(meta["experts"]), int(meta["hidden"]), int(meta["padded_intermediate"])
        return {"w13_weight": (I32, (e, h // 16, 4 * ip)), "w13_weight_scale": (F8, (e, h // 16, 2 * ip)),
                "w2_weight": (I32, (e, ip // 16, 2 * h)), "w2_weight_scale": (F8, (e, ip // 16, h))} | {
                r: (F32, (e,)) for r in ("w13_weight_scale_2", "w2_weight_scale_2", "w13_input_scale", "w2_input_scale")}

    def __init__(self, tensors, meta, layout, name: str = "") -> None:
        self.act_dtype, _ = _sizes(meta)
        self.ip = int(meta["padded_intermediate"])
        self.sf13, self.sf2 = float(meta["scale_factor_w13"]), float(meta["scale_factor_w2"])
        self.total = int(meta.get("experts_total", meta["experts"]))
        super().__init__(tensors, meta, layout, name)
        self.g13 = torch.from_numpy(lay.global_of(_np(self.t["w13_weight_scale_2"]).view(np.float32), self.sf13,
                                                  self.act_dtype))
        self.g2 = torch.from_numpy(lay.global_of(_np(self.t["w2_weight_scale_2"]).view(np.float32), self.sf2,
                                                 self.act_dtype))

    def select(self):
        if self.device.cuda and _vllm_marlin() is not None:
            return "vllm fused_marlin_moe (Marlin, W4A16)", False
        return "emulated Marlin W4A16 MoE (decoded layout, exact products)", True

    def forward(self, x, topk_weights, local):
        decoded = lambda a: super(MarlinMoeKernel, self).forward(a, topk_weights[:len(a)], local[:len(a)])  # noqa: E731
        if not self.emulated and _prove(self, lambda a: self._marlin(a, topk_weights[:len(a)], local[:len(a)]), decoded,
                                        x[:PROBE_TOKENS]):
            return self._marlin(x, topk_weights, local)
        return super().forward(x, topk_weights, local)

    def act(self, o1: torch.Tensor) -> torch.Tensor:
        return F.silu(o1[:, : self.inter]) * o1[:, self.inter:]

    def expert(self, e, x, w13, w2):
        o1 = mm(x, w13) * self.g13[e].item()
        h = self.act(o1).to(x.dtype)  # the kernel keeps the intermediate in the activation dtype
        return mm(h, w2) * self.g2[e].item()

    def decode_w13(self, e):
        h, i, what = self.hidden, self.inter, f"{self.name}.w13"
        packed = lay.halves(lay.decode_weight(_np(self.t["w13_weight"][e]), 2 * self.ip, h, f"{what}_weight[{e}]"),
                            i, self.ip, f"{what}_weight[{e}]")
        codes = lay.halves(lay.decode_scales(_np(self.t["w13_weight_scale"][e]), 2 * self.ip, h // 16, self.sf13,
                                             f"{what}_weight_scale[{e}]"), i, self.ip, f"{what}_weight_scale[{e}]")
        return _dequant(packed, codes, 2 * i, h).to(self.t["w13_weight"].device)

    def decode_w2(self, e):
        h, i, what = self.hidden, self.inter, f"{self.name}.w2"
        packed = lay.decode_weight(_np(self.t["w2_weight"][e]), h, i, f"{what}_weight[{e}]")
        codes = lay.decode_scales(_np(self.t["w2_weight_scale"][e]), h, i // 16, self.sf2, f"{what}_weight_scale[{e}]")
        return _dequant(packed, codes, h, i).to(self.t["w2_weight"].device)

    def _marlin(self, x, topk_weights, local):  # pragma: no cover - CUDA vLLM
        _, fused, workspace, fp4_id = _vllm_marlin()
        if not hasattr(self, "_ws"):
            self._ws = workspace(x.device)
        ids = torch.where(local >= 0, local, torch.zeros_like(local))
        w = torch.where(local >= 0, topk_weights.float(), torch.zeros_like(topk_weights, dtype=torch.float32))
        out = fused(x.to(getattr(torch, self.act_dtype)), self.t["w13_weight"], self.t["w2_weight"], None, None,
                    self.t["w13_weight_scale"], self.t["w2_weight_scale"], w, ids.to(torch.int32), fp4_id,
                    global_num_experts=self.experts, global_scale1=self.t["w13_weight_scale_2"],
                    global_scale2=self.t["w2_weight_scale_2"], workspace=self._ws)
        return out.float()


__all__ = ["MarlinLinearKernel", "MarlinMoeKernel", "gemm_dtype"]
