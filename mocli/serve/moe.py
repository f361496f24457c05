"""Fused MoE layers as stored by ``mocli convert``: one kernel class per kind, in ``MOE``.

Routing is the caller's (the engine's router): ``topk_ids`` [T, top_k] are global expert ids,
``topk_weights`` [T, top_k] their weights. A rank holds experts ``[expert_offset, expert_offset +
experts)`` (expert parallel) or all of them with ``I / tp`` of the intermediate size (tensor
parallel); ``expert_map`` (global id -> local slot, -1 elsewhere) may say the same. The result is
this rank's **unreduced** [T, H]: the engine sums the ranks.

Per expert (SEMANTICS §4, §7; ``mocli/verify/kinds/`` checks the same math): fc1 rows are
[w3; w1], so ``act = silu(second half) * first half``; the input is quantized with the layer's a1,
the intermediate with a2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mocli.kinds import ModuleKind
from mocli.numerics import FP8_MAX
from mocli.numerics.in_torch import FP8, fp8_per_group_dequant, mxfp8_quant, nvfp4_quant, unpack_e2m1
from mocli.ops import roundup
from mocli.serve.common import F8, F32, U8, Kernel, ServeError, gemm_dtype, mm, row_order
from mocli.targets.decode import unswizzle

# flashinfer-trtllm's extra per-expert output scales (LAYOUT.md), FP8 and NVFP4 spellings
TRTLLM_SCALES = ("output1_scales_scalar", "output1_scales_gate_scalar", "output2_scales_scalar",
                 "output1_scale_scalar", "output1_scale_gate_scalar", "output2_scale_scalar")


class MoeKernel(Kernel):
    @classmethod
    def spec(cls, meta, layout):
        e, i, h = int(meta["experts"]), int(meta["intermediate"]), int(meta["hidden"])
        per_expert = {r: (F32, (e,)) for r in ("g1_alphas", "g2_alphas", *TRTLLM_SCALES)}
        return per_expert | cls.tensors(e, i, h)

    @classmethod
    def tensors(cls, e: int, i: int, h: int) -> dict:
        raise NotImplementedError

    def __init__(self, tensors, meta, layout, name: str = "") -> None:
        # sizes first: the path chosen in Kernel.__init__ depends on them
        self.experts, self.inter, self.hidden = int(meta["experts"]), int(meta["intermediate"]), int(meta["hidden"])
        self.offset = int(meta.get("expert_offset", 0))
        self._w13: torch.Tensor | None = None  # emulation: decoded [E, 2I, H], logical rows
        self._w2: torch.Tensor | None = None  # emulation: decoded [E, H, I]
        super().__init__(tensors, meta, layout, name)

    def local_ids(self, topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
        """Global expert ids -> this rank's slots (-1: another rank's expert), int64 [T, top_k]."""
        ids = topk_ids.long()
        if expert_map is not None:
            return expert_map.to(ids.device).long()[ids]
        local = ids - self.offset
        return torch.where((local >= 0) & (local < self.experts), local, torch.full_like(local, -1))

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 expert_map: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H], topk_weights [T, top_k], topk_ids [T, top_k] global -> this rank's [T, H] in x.dtype."""
        if x.shape[-1] != self.hidden:
            raise ServeError(f"{self.name}: input has {x.shape[-1]} features, the layout {self.hidden}")
        return self.forward(x, topk_weights, self.local_ids(topk_ids, expert_map)).to(x.dtype)

    def forward(self, x, topk_weights, local):
        """Emulation: one GEMM pair per expert that has tokens, float32 accumulation of the weighted sum."""
        w13, w2 = self.decoded()
        out = torch.zeros(x.shape[0], self.hidden, dtype=torch.float32, device=x.device)
        for e in torch.unique(local[local >= 0]).tolist():
            tok, slot = (local == e).nonzero(as_tuple=True)
            y = self.expert(e, x[tok], w13[e], w2[e])
            out.index_add_(0, tok, y * topk_weights[tok, slot].float().unsqueeze(-1))
        return out

    def expert(self, e: int, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """One expert on its tokens: x [t, H] -> float32 [t, H]."""
        raise NotImplementedError

    def decoded(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._w13 is None:
            dt = gemm_dtype(self.device)
            self._w13 = torch.stack([self.decode_w13(e) for e in range(self.experts)]).to(dt)
            self._w2 = torch.stack([self.decode_w2(e) for e in range(self.experts)]).to(dt)
        return self._w13, self._w2

    def decode_w13(self, e: int) -> torch.Tensor:
        raise NotImplementedError

    def decode_w2(self, e: int) -> torch.Tensor:
        raise NotImplementedError

    def act(self, o1: torch.Tensor) -> torch.Tensor:
        """FlashInfer's gated activation on [up | gate] rows: silu(second half) * first half."""
        return F.silu(o1[:, self.inter:]) * o1[:, : self.inter]


def _fp8(x: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """fp8(x * (1/a)): the kernels take the reciprocal input scale (``*_input_scale_inv``)."""
    return (x.float() * inv_scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8)


class Fp8MoeKernel(MoeKernel):
    """FP8 per-tensor experts: torch._scaled_grouped_mm on sm_90+ (SEMANTICS §9), emulated elsewhere."""

    kind = ModuleKind.FP8_MOE
    roles = ("w13_weight", "w2_weight", "w13_input_scale_inv", "w2_input_scale_inv", "g1_alphas", "g2_alphas")

    @classmethod
    def tensors(cls, e, i, h):
        scalar = {r: (F32, ()) for r in ("w13_input_scale", "w2_input_scale", "w13_input_scale_inv",
                                         "w2_input_scale_inv")}
        return {"w13_weight": (F8, (e, 2 * i, h)), "w2_weight": (F8, (e, h, i)), "w13_weight_scale": (F32, (e,)),
                "w2_weight_scale": (F32, (e,))} | scalar

    def select(self):
        # grouped FP8 GEMMs read rows of 16-byte multiples: H and the rank's I
        if self.device.at_least(9, 0) and self.inter % 16 == 0 and self.hidden % 16 == 0:
            return "torch._scaled_grouped_mm", False
        return "emulated FP8 MoE (fp8 codes, float GEMMs per expert)", True

    def forward(self, x, topk_weights, local):
        if self.emulated:
            return super().forward(x, topk_weights, local)
        return self._grouped(x, topk_weights, local)

    def expert(self, e, x, w13, w2):
        o1 = mm(_fp8(x, self.t["w13_input_scale_inv"]), w13) * self.t["g1_alphas"][e].float()
        hq = _fp8(self.act(o1), self.t["w2_input_scale_inv"])
        return mm(hq, w2) * self.t["g2_alphas"][e].float()

    def decode_w13(self, e):
        return self.layout.moe_rows_decode(self.t["w13_weight"][e].view(torch.uint8), gated=True).view(FP8).float()

    def decode_w2(self, e):
        return self.layout.moe_rows_decode(self.t["w2_weight"][e].view(torch.uint8), gated=False).view(FP8).float()

    def _grouped(self, x, topk_weights, local):
        """Tokens sorted by expert, both GEMMs as one grouped FP8 GEMM each on the stored weights; a
        target's row order (trtllm) is undone on the outputs' columns, not on the weights. No host
        synchronisation (CUDA-graph safe): another rank's experts sort last, past the last group's end,
        and their rows are masked out of the sum."""
        k = local.shape[1]
        ids = torch.where(local >= 0, local, self.experts).reshape(-1)
        order = torch.argsort(ids, stable=True)
        tok, slot, ids = order // k, order % k, ids[order]
        bounds = torch.arange(1, self.experts + 1, device=ids.device, dtype=ids.dtype)
        offs = torch.searchsorted(ids, bounds).to(torch.int32)  # rows of experts 0..e, cumulative
        g1, g2, rows13, rows2 = self._constants()
        a = _fp8(x, self.t["w13_input_scale_inv"])[tok]
        ones = torch.ones(a.shape[0], dtype=torch.float32, device=x.device)
        o1 = torch._scaled_grouped_mm(a, self.t["w13_weight"].transpose(-2, -1), ones, g1, offs=offs,
                                      out_dtype=torch.bfloat16).float()
        if rows13 is not None:
            o1 = o1[:, rows13]
        hq = _fp8(self.act(o1), self.t["w2_input_scale_inv"])
        o2 = torch._scaled_grouped_mm(hq, self.t["w2_weight"].transpose(-2, -1), ones, g2, offs=offs,
                                      out_dtype=torch.bfloat16).float()
        if rows2 is not None:
            o2 = o2[:, rows2]
        # rows past the last group are never written by the GEMMs: where(), not a product, drops them
        y = torch.where((ids < self.experts).unsqueeze(-1), o2 * topk_weights[tok, slot].float().unsqueeze(-1), 0.0)
        out = torch.zeros(x.shape[0], self.hidden, dtype=torch.float32, device=x.device)
        return out.index_add_(0, tok, y)

    def _constants(self):
        """Per-expert output scales as [E, N] rows (what the grouped GEMM takes) and the row orders:
        shape work on the stored scales, done on the first call and kept."""
        if not hasattr(self, "_c"):
            dev = self.t["w13_weight"].device
            g1 = self.t["g1_alphas"].float().reshape(-1, 1).expand(self.experts, 2 * self.inter).contiguous()
            g2 = self.t["g2_alphas"].float().reshape(-1, 1).expand(self.experts, self.hidden).contiguous()
            self._c = (g1, g2, row_order(self.layout, 2 * self.inter, True, dev),
                       row_order(self.layout, self.hidden, False, dev))
        return self._c


class Nvfp4MoeKernel(MoeKernel):
    """NVFP4 experts: FlashInfer's cutlass_fused_moe on sm_100+ for the layout it reads; elsewhere
    emulated (layout decoded once, exact in BF16; sm_90 has no NVFP4 tensor cores, SEMANTICS §9)."""

    kind = ModuleKind.NVFP4_MOE
    roles = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale", "g1_alphas", "g2_alphas",
             "a1_gscale", "a2_gscale")

    @classmethod
    def tensors(cls, e, i, h):
        per_expert = {r: (F32, (e,)) for r in ("w13_weight_scale_2", "w2_weight_scale_2", "w13_input_scale",
                                                "w2_input_scale", "a1_gscale", "a2_gscale")}
        return {"w13_weight": (U8, (e, 2 * i, h // 2)), "w2_weight": (U8, (e, h, i // 2)),
                "w13_weight_scale": (F8, (e, roundup(2 * i, 128), roundup(h // 16, 4))),
                "w2_weight_scale": (F8, (e, roundup(h, 128), roundup(i // 16, 4))),
                "pre_quant_scale": (torch.bfloat16, (h,))} | per_expert

    def select(self):
        if self.device.flashinfer and self.layout.fp4_kernels:
            return "flashinfer.cutlass_fused_moe", False
        return "emulated NVFP4 MoE (decoded layout, exact products)", True

    def forward(self, x, topk_weights, local):
        if "pre_quant_scale" in self.t:  # NVFP4_AWQ: the layer's input scaled once, in BF16 (§15.3)
            x = x.bfloat16() * self.t["pre_quant_scale"]
        if self.emulated:
            return super().forward(x, topk_weights, local)
        return self._cutlass(x, topk_weights, local)  # pragma: no cover - sm_100+

    def expert(self, e, x, w13, w2):
        o1 = mm(nvfp4_quant(x, self.t["a1_gscale"][e]), w13) * self.t["g1_alphas"][e].float()
        ha = nvfp4_quant(self.act(o1), self.t["a2_gscale"][e])
        return mm(ha, w2) * self.t["g2_alphas"][e].float()

    def decode_w13(self, e):
        return self._decode("w13", e, 2 * self.inter, self.hidden, gated=True)

    def decode_w2(self, e):
        return self._decode("w2", e, self.hidden, self.inter, gated=False)

    def _decode(self, which: str, e: int, rows: int, cols: int, gated: bool) -> torch.Tensor:
        """One expert's e2m1 codes times their block scales, logical row order, float32 [rows, cols]."""
        lay = self.layout
        codes = lay.moe_rows_decode(self.t[f"{which}_weight"][e], gated=gated)
        bs = lay.moe_rows_decode(unswizzle(self.t[f"{which}_weight_scale"][e], rows, cols // 16,
                                           f"{self.name}.{which}_weight_scale[{e}]"), gated=gated)
        vals = unpack_e2m1(codes.contiguous()).reshape(rows, cols // 16, 16)
        return (vals * bs.view(FP8).float().reshape(rows, cols // 16, 1)).reshape(rows, cols)

    def _cutlass(self, x, topk_weights, local):  # pragma: no cover - sm_100+
        from flashinfer import fp4_quantize
        from flashinfer.fused_moe import cutlass_fused_moe

        scales = [self.t["a1_gscale"], self.t["w13_weight_scale"].view(torch.int32), self.t["g1_alphas"],
                  self.t["a2_gscale"], self.t["w2_weight_scale"].view(torch.int32), self.t["g2_alphas"]]
        x_fp4, x_sf = fp4_quantize(x.bfloat16(), self.t["a1_gscale"][:1].float())
        # local slots, weight 0 where the expert is another rank's (its slot is clamped to 0)
        w = torch.where(local >= 0, topk_weights.float(), torch.zeros_like(topk_weights, dtype=torch.float32))
        out = cutlass_fused_moe(input=x_fp4, token_selected_experts=local.clamp(min=0).to(torch.int32),
                                token_final_scales=w, fc1_expert_weights=self.t["w13_weight"].view(torch.long),
                                fc2_expert_weights=self.t["w2_weight"].view(torch.long),
                                output_dtype=torch.bfloat16, quant_scales=scales, input_sf=x_sf)
        return (out[0] if isinstance(out, list | tuple) else out).float()


class Mxfp8MoeKernel(MoeKernel):
    """MXFP8 experts as flashinfer-trtllm stores them (SEMANTICS §14.3: I and H padded, [w3; w1], gated
    interleave, shuffles): emulated, the layout decoded once; the input and the intermediate MXFP8-quantized
    per 32 values (trtllm_fp8_block_scale_moe's MxFp8 mode needs sm_100)."""

    kind = ModuleKind.MXFP8_MOE
    roles = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")

    @classmethod
    def spec(cls, meta, layout):
        e, ip, hp = int(meta["experts"]), int(meta["padded_intermediate"]), int(meta["padded_hidden"])
        return {"w13_weight": (F8, (e, 2 * ip, hp)), "w13_weight_scale": (U8, (e, 2 * ip, hp // 32)),
                "w2_weight": (F8, (e, hp, ip)), "w2_weight_scale": (U8, (e, hp, ip // 32))}

    def select(self):
        return "emulated MXFP8 MoE (decoded layout, exact products)", True

    def expert(self, e, x, w13, w2):
        o1 = mm(mxfp8_quant(x), w13)
        return mm(mxfp8_quant(self.act(o1)), w2)

    def decode_w13(self, e):
        ip, i, h = int(self.meta["padded_intermediate"]), self.inter, self.hidden
        w, s = self._rows("w13", e, gated=True)
        keep = torch.cat([torch.arange(i), torch.arange(ip, ip + i)]).to(w.device)
        return _mx_dequant(w[keep, :h], s[keep, :h // 32])

    def decode_w2(self, e):
        w, s = self._rows("w2", e, gated=False)
        return _mx_dequant(w[:self.hidden, :self.inter], s[:self.hidden, :self.inter // 32])

    def _rows(self, which: str, e: int, gated: bool) -> tuple[torch.Tensor, torch.Tensor]:
        w, s = self.t[f"{which}_weight"][e], self.t[f"{which}_weight_scale"][e]
        rows, kb = s.shape
        s = unswizzle(s, rows, kb, f"{self.name}.{which}_weight_scale[{e}]")
        return (self.layout.moe_rows_decode(w.view(U8), gated=gated).view(FP8),
                self.layout.moe_rows_decode(s, gated=gated))


class Fp8BlockMoeKernel(MoeKernel):
    """FP8 128x128-block experts (SEMANTICS §18.2), either target's layout: emulated, the layout decoded once,
    the input and the intermediate FP8-quantized per token and group of 128 as the kernels do (FlashInfer's
    block-scale MoE kernels: CUTLASS on sm_90, TRT-LLM on sm_100, not called here)."""

    kind = ModuleKind.FP8_BLOCK_MOE
    roles = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")

    @classmethod
    def spec(cls, meta, layout):
        e, i, h = int(meta["experts"]), int(meta["intermediate"]), int(meta["hidden"])
        return {"w13_weight": (F8, (e, *layout.block_moe_shape(2 * i, h))), "w13_weight_scale": (F32, (e, 2 * i // 128, h // 128)),
                "w2_weight": (F8, (e, *layout.block_moe_shape(h, i))), "w2_weight_scale": (F32, (e, h // 128, i // 128))}

    def select(self):
        return "emulated FP8 block-scale MoE (decoded layout, per-group FP8 activations)", True

    def expert(self, e, x, w13, w2):
        o1 = mm(fp8_per_group_dequant(x), w13)
        return mm(fp8_per_group_dequant(self.act(o1)), w2)

    def decoded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 on every device: an e4m3 code times a float32 block scale is no BF16 value."""
        if self._w13 is None:
            self._w13 = torch.stack([self.decode_w13(e) for e in range(self.experts)])
            self._w2 = torch.stack([self.decode_w2(e) for e in range(self.experts)])
        return self._w13, self._w2

    def decode_w13(self, e):
        return self._dequant("w13", e)

    def decode_w2(self, e):
        return self._dequant("w2", e)

    def _dequant(self, which: str, e: int) -> torch.Tensor:
        w = self.layout.block_moe_decode(self.t[f"{which}_weight"][e].view(U8)).contiguous().view(FP8).float()
        s = self.t[f"{which}_weight_scale"][e].float()
        return w * s.repeat_interleave(128, 0).repeat_interleave(128, 1)


def _mx_dequant(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return w.float() * torch.exp2(s.float() - 127.0).repeat_interleave(32, dim=1)

