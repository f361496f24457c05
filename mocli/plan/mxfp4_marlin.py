"""The marlin target's MXFP4 planners (SEMANTICS §19.5): linears per rank (§10 slicing first, then
vLLM's padding, the NVFP4 repack and the E8M0 scale moves), in numpy, without torch.

No global scale, no scale factor, no flush, nothing unified across shards: MXFP4 shards concatenate
as they are (§19.1). Scales are stored as E8M0 bytes (U8), one per 32 values along K, [Kp/32, Np].
Activations are BF16 (``ACT_DTYPE``): for them the scale chain is a byte permutation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mocli.io.safetensors_file import TensorEntry
from mocli.kinds import REPACK, Role
from mocli.ops import mxfp4_marlin as mx
from mocli.ops import roundup
from mocli.plan.dense import _Dense
from mocli.plan.marlin import _MarlinBias
from mocli.plan.moe import _Moe
from mocli.plan.mxfp4_moe import SWIGLUOAI, _Mxfp4TrtllmMoe, _read
from mocli.schemes.mxfp4 import BIAS
from mocli.stream.units import BadData, Piece
from mocli.tables import WEIGHT, WEIGHT_SCALE

if TYPE_CHECKING:
    from mocli.stream.pool import UnitContext

ACT_DTYPE = "bfloat16"  # vLLM's params_dtype the scales pass through (fp16 would clip codes: §19.5)
E8M0_NAN = 0xFF
SCALE_STEPS = ["marlin_pad", "marlin_permute_scales", "mxfp4_marlin_process_scales"]


def checked_scales(raw: np.ndarray, entry: TensorEntry) -> np.ndarray:
    """E8M0 scale bytes, refused where a code is 255 (NaN: the kernel would read +inf or NaN)."""
    if bool((raw == E8M0_NAN).any()):
        raise BadData(entry.name, "E8M0 scale bytes encode NaN (0xFF)")
    return raw


class _Mxfp4MarlinDense(_MarlinBias, _Dense):
    """A linear (a fused group or alone): weight repacked, E8M0 scales permuted, bias padded and
    permuted, per tp rank."""

    def plan(self) -> None:
        weights, scales = [m.tensors[WEIGHT] for m in self.shards], [m.tensors[WEIGHT_SCALE] for m in self.shards]
        shape = {t: mx.padded_nk(sl.n, sl.k) for t, sl in self.slices.items()}
        for r in self.ranks:
            (np_, kp), rows = shape[self.slice_of(r).tp_rank], self.slice_transforms()
            self.add(r, Role.WEIGHT, "I32", (kp // 16, 2 * np_), [w.name for w in weights],
                     self.fused + rows + ["marlin_pad", REPACK])
            self.add(r, Role.WEIGHT_SCALE, "U8", (kp // mx.GROUP, np_), [s.name for s in scales],
                     self.fused + rows + SCALE_STEPS)

        def run(ctx: UnitContext) -> list[Piece]:
            sc = [checked_scales(ctx.array(s), s) for s in scales]
            pieces: list[Piece] = []
            for t, sl in self.slices.items():
                (np_, kp), (c0, c1) = shape[t], sl.cols
                w = np.concatenate([ctx.array(e)[a:b, c0 // 2:c1 // 2] for e, (a, b) in zip(weights, sl.rows, strict=True)])
                codes = np.concatenate([x[a:b, c0 // mx.GROUP:c1 // mx.GROUP] for x, (a, b) in zip(sc, sl.rows, strict=True)])
                out = {Role.WEIGHT: mx.repack(w, np_, kp), Role.WEIGHT_SCALE: mx.permute_scales(codes, np_, kp)}
                for r in (r for r in self.ranks if self.pc.parallel.tp_rank(r) == t):
                    pieces += [Piece(self.key(r, role), 0, v) for role, v in out.items()]
            return pieces + self._bias(ctx, shape)

        self.finish(lambda r: {"padded_n": shape[self.slice_of(r).tp_rank][0], "padded_k": shape[self.slice_of(r).tp_rank][1],
                               "act_dtype": ACT_DTYPE}, weights + scales, run)


class _Mxfp4MarlinMoe(_Moe):
    """An MoE layer whose experts load as [w1; w3] halves (compressed-tensors, Quark's non-gpt-oss MoE),
    per rank (equal split of I, §19.3): per expert w13 [w1; w3] (Ip rows each, no swap) and w2 repacked,
    their E8M0 scales permuted (``prepare_moe_fp4_layer_for_marlin``: no padding of its own, so Ip = the
    rank's I). SiLU-gated, no biases: gpt-oss's experts (interleaved rows, biases, clamped SwiGLU) are
    refused before planning (``MarlinLayout.moe_refusal``)."""

    def plan(self) -> None:
        h = self.h
        for r in self.ranks:
            e, ip, st = self.local(r), self.i_r(r), self.slice_transforms()
            self.add(r, Role.W13_WEIGHT, "I32", (e, h // 16, 4 * ip), self.src("gate", WEIGHT, r) + self.src("up", WEIGHT, r),
                     ["stack_experts"] + st + [REPACK])
            self.add(r, Role.W13_WEIGHT_SCALE, "U8", (e, h // mx.GROUP, 2 * ip), self.src("gate", WEIGHT_SCALE, r)
                     + self.src("up", WEIGHT_SCALE, r), ["stack_experts"] + st + SCALE_STEPS[1:])
            self.add(r, Role.W2_WEIGHT, "I32", (e, ip // 16, 2 * h), self.src("down", WEIGHT, r),
                     ["stack_experts"] + st + [REPACK])
            self.add(r, Role.W2_WEIGHT_SCALE, "U8", (e, ip // mx.GROUP, h), self.src("down", WEIGHT_SCALE, r),
                     ["stack_experts"] + st + SCALE_STEPS[1:])
        for e, (g, u, d) in enumerate(self.mods):
            self._units(e, g, u, d)
        for r in self.ranks:
            self.module(r, {"padded_intermediate": self.i_r(r), "act_dtype": ACT_DTYPE, "activation": "silu",
                            "w13_rows": "halves"})

    def _units(self, e: int, g, u, d) -> None:
        h = self.h

        def w13(ctx: UnitContext, _, r: int, rows: tuple[int, int]) -> list:
            (i0, i1), ip = rows, rows[1] - rows[0]
            out = ctx.empty((h // 16, 16 * ip))
            for half, m in enumerate((g, u)):
                mx.repack(ctx.array(m.tensors[WEIGHT])[i0:i1], ip, h, out=out[:, 8 * ip * half:8 * ip * (half + 1)])
            return [out]

        def w13s(ctx: UnitContext, _, r: int, rows: tuple[int, int]) -> list:
            (i0, i1), ip = rows, rows[1] - rows[0]
            out = ctx.empty((h // mx.GROUP, 2 * ip))
            for half, m in enumerate((g, u)):
                codes = checked_scales(ctx.array(m.tensors[WEIGHT_SCALE]), m.tensors[WEIGHT_SCALE])[i0:i1]
                mx.permute_scales(codes, ip, h, out=out[:, ip * half:ip * (half + 1)])
            return [out]

        def w2(ctx: UnitContext, _, r: int, rows: tuple[int, int]) -> list:
            (i0, i1) = rows
            return [mx.repack(ctx.array(d.tensors[WEIGHT])[:, i0 // 2:i1 // 2], h, i1 - i0, out=ctx.empty(((i1 - i0) // 16, 8 * h)))]

        def w2s(ctx: UnitContext, _, r: int, rows: tuple[int, int]) -> list:
            (i0, i1) = rows
            codes = checked_scales(ctx.array(d.tensors[WEIGHT_SCALE]), d.tensors[WEIGHT_SCALE])
            return [mx.permute_scales(codes[:, i0 // mx.GROUP:i1 // mx.GROUP], h, i1 - i0,
                                      out=ctx.empty(((i1 - i0) // mx.GROUP, h)))]

        self.expert_unit("w13", e, Role.W13_WEIGHT, [g.tensors[WEIGHT], u.tensors[WEIGHT]], w13, compute=True, in_place=True)
        self.expert_unit("w13s", e, Role.W13_WEIGHT_SCALE, [g.tensors[WEIGHT_SCALE], u.tensors[WEIGHT_SCALE]], w13s, in_place=True)
        self.expert_unit("w2", e, Role.W2_WEIGHT, [d.tensors[WEIGHT]], w2, compute=True, in_place=True)
        self.expert_unit("w2s", e, Role.W2_WEIGHT_SCALE, [d.tensors[WEIGHT_SCALE]], w2s, in_place=True)


class _Mxfp4MarlinGptOssMoe(_Mxfp4TrtllmMoe):
    """gpt-oss's experts (native and Quark: gate_up rows interleaved, biases, clamped SwiGLU) in Marlin's
    layout, per rank (§19.3: the unequal 32-block split, the down bias on TP rank 0 only): the rank's rows
    copied into the start of vLLM's padded parameters (Ip = roundup(I/tp, 128), Hp = roundup(H, 256); scale
    padding 0, Quark's 1), then per expert the repack, the E8M0 scale moves and ``marlin_permute_bias`` on
    BF16 biases (``prepare_moe_mxfp4_layer_for_marlin``, §19.5). w13 rows stay interleaved (gate, up)."""

    def plan(self) -> None:
        par = self.pc.parallel
        self.hp = roundup(self.h, 256)
        self.ip = {r: roundup(self.i if par.expert_parallel else self.i // par.tp, 128) for r in self.ranks}
        for r in self.ranks:
            e, ip, hp, st = self.local(r), self.ip[r], self.hp, ["stack_experts"] + self.slice_transforms()
            w13 = self.w13_sources(r)
            rank0 = par.single or par.expert_parallel or par.tp_rank(r) == 0
            self.add(r, Role.W13_WEIGHT, "I32", (e, hp // 16, 4 * ip), w13[WEIGHT], st + ["pad_to_Ip_Hp", REPACK])
            self.add(r, Role.W13_WEIGHT_SCALE, "U8", (e, hp // mx.GROUP, 2 * ip), w13[WEIGHT_SCALE],
                     st + [f"pad_to_Ip_Hp_{self.pad}"] + SCALE_STEPS[1:])
            self.add(r, Role.W2_WEIGHT, "I32", (e, ip // 16, 2 * hp), self.src("down", WEIGHT, r), st + ["pad_to_Hp_Ip", REPACK])
            self.add(r, Role.W2_WEIGHT_SCALE, "U8", (e, ip // mx.GROUP, hp), self.src("down", WEIGHT_SCALE, r),
                     st + [f"pad_to_Hp_Ip_{self.pad}"] + SCALE_STEPS[1:])
            self.add(r, Role.W13_BIAS, "BF16", (e, 2 * ip), w13[BIAS], st + ["to_bf16", "pad_to_Ip", "marlin_permute_bias"])
            self.add(r, Role.W2_BIAS, "BF16", (e, hp), self.src("down", BIAS, r),
                     st + ["to_bf16", "pad_to_Hp", "marlin_permute_bias"] + ([] if rank0 else ["zeros_tp_rank_not_0"]))
        for e in range(self.e_count):
            self._gpt_oss_units(e)
        for r in self.ranks:
            self.module(r, {"padded_intermediate": self.ip[r], "padded_hidden": self.hp, "act_dtype": ACT_DTYPE,
                            **SWIGLUOAI, "w13_rows": "interleaved", "scale_pad": self.pad,
                            "split": "gpt_oss_32_blocks"})

    def _gpt_oss_units(self, e: int) -> None:
        gu, _, d = self.mods[e]
        par, hp, pad = self.pc.parallel, self.hp, self.pad

        def w13(ctx, _, r, rows):
            return [mx.repack(_read(ctx, gu.tensors[WEIGHT], WEIGHT)[2 * rows[0]:2 * rows[1]], 2 * self.ip[r], hp)]

        def w13s(ctx, _, r, rows):
            codes = _read(ctx, gu.tensors[WEIGHT_SCALE], WEIGHT_SCALE)[2 * rows[0]:2 * rows[1]]
            return [mx.permute_scales(codes, 2 * self.ip[r], hp, fill=pad)]

        def w13b(ctx, _, r, rows):
            b = _read(ctx, gu.tensors[BIAS], BIAS).reshape(-1)[2 * rows[0]:2 * rows[1]]
            return [mx.permute_bias(bf16_words(b), 2 * self.ip[r])]

        def w2(ctx, _, r, rows):
            return [mx.repack(_read(ctx, d.tensors[WEIGHT], WEIGHT)[:, rows[0] // 2:rows[1] // 2], hp, self.ip[r])]

        def w2s(ctx, _, r, rows):
            codes = _read(ctx, d.tensors[WEIGHT_SCALE], WEIGHT_SCALE)[:, rows[0] // mx.GROUP:rows[1] // mx.GROUP]
            return [mx.permute_scales(codes, hp, self.ip[r], fill=pad)]

        def w2b(ctx, _, r, rows):
            b = _read(ctx, d.tensors[BIAS], BIAS).reshape(-1)
            if not (par.single or par.expert_parallel or par.tp_rank(r) == 0):
                b = np.zeros_like(b)  # the kernel adds it per rank before the all-reduce: rank 0 only (§19.3)
            return [mx.permute_bias(bf16_words(b), hp)]

        for kind, role, entry, emit in (("w13", Role.W13_WEIGHT, gu.tensors[WEIGHT], w13),
                                        ("w13s", Role.W13_WEIGHT_SCALE, gu.tensors[WEIGHT_SCALE], w13s),
                                        ("w13b", Role.W13_BIAS, gu.tensors[BIAS], w13b),
                                        ("w2", Role.W2_WEIGHT, d.tensors[WEIGHT], w2),
                                        ("w2s", Role.W2_WEIGHT_SCALE, d.tensors[WEIGHT_SCALE], w2s),
                                        ("w2b", Role.W2_BIAS, d.tensors[BIAS], w2b)):
            self.expert_unit(kind, e, role, [entry], emit, compute=kind in ("w13", "w2"))


def bf16_words(x: np.ndarray) -> np.ndarray:
    """float32 values -> BF16 words uint16 (nearest even: exact for a BF16 source; a Quark F32 bias rounds as
    vLLM's ``.to(params_dtype)`` does)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def moe_planner(pc, kind, name, layer) -> _Moe:
    """The card's planner: gpt-oss's interleaved experts, or the [w1; w3] halves."""
    return (_Mxfp4MarlinGptOssMoe if layer.interleaved else _Mxfp4MarlinMoe)(pc, kind, name, layer)
