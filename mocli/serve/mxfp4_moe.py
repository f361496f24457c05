"""flashinfer-trtllm's MXFP4 experts (SEMANTICS §19.6) served: emulated, the stored layout decoded once to
float32 (e2m1 codes times E8M0 scales: exact), BF16 activations as vLLM's default variant for gpt-oss
(``activation_dtype``; the MXFP8 variant's bytes are the same, only its run-time quantization differs: not
emulated here). ``trtllm_fp4_block_scale_moe`` needs sm_100 and is not called.

Per expert: ``o1 = x @ [up; gate].T + b13``; ``silu``: ``silu(gate) * up``; ``swigluoai`` (gpt-oss, §19.2):
``g = min(gate, L)``, ``u = clamp(up, -L, L)``, ``(u + 1) * g * sigmoid(alpha * g)``; then ``h @ w2.T + b2``
(b2 zero on TP ranks other than 0, so the engine's sum over ranks adds it once)."""

from __future__ import annotations

import torch

from mocli.kinds import ModuleKind
from mocli.numerics.in_torch import unpack_e2m1
from mocli.serve.common import F32, U8, mm
from mocli.serve.moe import MoeKernel
from mocli.targets import mxfp4_decode as dec


class Mxfp4MoeKernel(MoeKernel):
    kind = ModuleKind.MXFP4_MOE
    roles = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")

    @classmethod
    def spec(cls, meta, layout):
        e, ip, hp = int(meta["experts"]), int(meta["padded_intermediate"]), int(meta["padded_hidden"])
        return {"w13_weight": (U8, (e, 2 * ip, hp // 2)), "w13_weight_scale": (U8, (e, 2 * ip, hp // 32)),
                "w2_weight": (U8, (e, hp, ip // 2)), "w2_weight_scale": (U8, (e, hp, ip // 32)),
                "w13_bias": (F32, (e, 2 * ip)), "w2_bias": (F32, (e, hp))}

    def select(self):
        return "emulated MXFP4 MoE (decoded layout, BF16 activations, exact products)", True

    def decoded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 weights on every device (an E8M0 scale beyond BF16's range stays exact), with the biases."""
        if self._w13 is None:
            self._w13 = torch.stack([self.decode_w13(e) for e in range(self.experts)])
            self._w2 = torch.stack([self.decode_w2(e) for e in range(self.experts)])
            i, h = self.inter, self.hidden
            b13, b2 = self.t.get("w13_bias"), self.t.get("w2_bias")
            self._b13 = None if b13 is None else torch.stack(
                [torch.cat(dec.pairs(dec.rows(b13[e].float()))).reshape(2, -1)[:, :i].reshape(-1) for e in range(self.experts)])
            self._b2 = None if b2 is None else torch.stack([dec.rows(b2[e].float())[:h] for e in range(self.experts)])
        return self._w13, self._w2

    def expert(self, e, x, w13, w2):
        o1 = mm(x.bfloat16().float(), w13)
        if self._b13 is not None:
            o1 = o1 + self._b13[e]
        h = self.act(o1).bfloat16().float()  # the kernel's BF16 intermediate
        o2 = mm(h, w2)
        return o2 + self._b2[e] if self._b2 is not None else o2

    def act(self, o1: torch.Tensor) -> torch.Tensor:
        up, gate = o1[:, :self.inter], o1[:, self.inter:]
        if self.meta.get("activation") != "swigluoai":
            return torch.nn.functional.silu(gate) * up
        lim, alpha = float(self.meta["swiglu_limit"]), float(self.meta["swiglu_alpha"])
        g, u = gate.clamp(max=lim), up.clamp(-lim, lim)
        return (u + float(self.meta.get("swiglu_beta", 1.0))) * g * torch.sigmoid(alpha * g)

    def decode_w13(self, e):
        """[up (I rows); gate (I rows)] float32 [2I, H]."""
        i, h = self.inter, self.hidden
        w, s = self._rows("w13", e)
        up, gate = dec.pairs(w)
        su, sg = dec.pairs(s)
        return torch.cat([_dequant(up[:i], su[:i], h), _dequant(gate[:i], sg[:i], h)])

    def decode_w2(self, e):
        w, s = self._rows("w2", e)
        return _dequant(w[:self.hidden], s[:self.hidden], self.inter)

    def _rows(self, which: str, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        w, s = self.t[f"{which}_weight"][e], self.t[f"{which}_weight_scale"][e]
        return dec.rows(w.view(U8)), dec.scale_rows(s.view(U8), f"{self.name}.{which}_weight_scale[{e}]")


def _dequant(codes: torch.Tensor, scales: torch.Tensor, k: int) -> torch.Tensor:
    """e2m1 codes [N, >= K/2] times E8M0 scales [N, >= K/32] -> float32 [N, K] (the padding columns cut)."""
    vals = unpack_e2m1(codes[:, :k // 2].contiguous())
    return vals * torch.exp2(scales[:, :k // 32].float() - 127.0).repeat_interleave(32, dim=1)
