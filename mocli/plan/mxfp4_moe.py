"""flashinfer-trtllm's MXFP4 experts (SEMANTICS §19.6), per rank (§19.3), as vLLM 0.33 prepares them for
``trtllm_fp4_block_scale_moe``; the BF16- and MXFP8-activation variants store the same bytes.

Per rank: I padded to ``Ip = roundup(I/tp, 128)`` and H to ``Hp = roundup(H, 256)``; fc1 rows as interleaved
(up_i, gate_i) pairs (gpt-oss's interleaved gate_up with each pair swapped, or the [w1; w3] halves stacked
pair by pair); weights, E8M0 scales and float32 biases rows shuffled in 32-row blocks (``shuffle_matrix_a``,
epilogue tile 128); scales then 128x4-interleaved (§5). Padding: weights and biases 0, scale bytes 0 (Quark
inputs: 1, vLLM's ``torch.ones`` initial value). gpt-oss's loaders (native and Quark, interleaved gate_up) split
I unequally in whole 32-blocks (``P = 32·ceil(I/(32·tp))``) and give the down bias to TP rank 0 only; the
other spellings split I equally (§19.3).

Gate/up halves (compressed-tensors): vLLM 0.33 runs compressed-tensors MXFP4 experts on its own CUTLASS MoE
(W4A4) or Marlin, never on TRT-LLM (§19.4); mocli writes them in this layout all the same (the generic
``convert_weight_to_mxfp4_moe_kernel_format`` stacking, equal split), served by mocli's plugin, and says so in
the manifest (``vllm_path``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mocli.census import MoELayer
from mocli.kinds import ModuleKind, Role
from mocli.ops import nvfp4, roundup
from mocli.ops.rows import shuffle_row_indices
from mocli.parallel import block_split, expert_range, intermediate_range
from mocli.plan.context import PlanContext
from mocli.plan.moe import _Moe
from mocli.schemes.mxfp4 import BIAS, BLOCK, NAN_SCALE
from mocli.stream.units import BadData
from mocli.tables import WEIGHT, WEIGHT_SCALE
from mocli.targets.base import ROW_SHUFFLE

if TYPE_CHECKING:
    from mocli.io.safetensors_file import TensorEntry
    from mocli.stream.pool import UnitContext

# gpt-oss's clamped SwiGLU (SEMANTICS §19.2): what the kernel is set up with, not stored
SWIGLUOAI = {"activation": "swigluoai", "swiglu_alpha": 1.702, "swiglu_beta": 1.0, "swiglu_limit": 7.0}
SILU = {"activation": "silu"}
QUARK_PAD = 1  # QuarkOCP_MX_MoEMethod's scale parameters start as torch.ones (§19.3)
CT_PATH = ("vLLM 0.33 runs compressed-tensors MXFP4 experts on its CUTLASS MoE (W4A4) or Marlin, not TRT-LLM "
           "(SEMANTICS §19.4): this TRT-LLM layout serves through mocli's plugin")


def to_f32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """A bias's bytes ([N, itemsize] uint8) as float32 [N] (exact from BF16/F16)."""
    flat = np.ascontiguousarray(raw).reshape(-1)
    if dtype == "BF16":
        return (flat.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return flat.view(np.float16 if dtype == "F16" else np.float32).astype(np.float32)


class _Mxfp4TrtllmMoe(_Moe):
    """One MXFP4 MoE layer in flashinfer-trtllm's layout, every rank (see the module docstring)."""

    def __init__(self, pc: PlanContext, kind: ModuleKind, name: str, layer: MoELayer) -> None:
        self.pc, self.layer, self.kind = pc, layer, kind
        ex = [layer.experts[e] for e in sorted(layer.experts)]
        self.fused = layer.interleaved
        # (gate_up or gate, up or None, down): gpt-oss's interleaved rows, else the halves
        self.mods = [(x.gate_up, None, x.down) if self.fused else (x.gate, x.up, x.down) for x in ex]
        pc.consume(m for trio in self.mods for m in trio)
        self.e_count, self.i, self.h, self.p = len(self.mods), layer.intermediate, layer.hidden, layer.name
        par = pc.parallel
        self.ranks = range(par.ranks)
        self.experts = {r: expert_range(self.e_count, par, r) for r in self.ranks}
        whole = par.expert_parallel
        self.inter = {r: (0, self.i) if whole else block_split(self.i, par.tp, par.tp_rank(r)) if self.fused
                      else intermediate_range(self.i, par, r) for r in self.ranks}
        self.tensors: dict[int, dict[str, str]] = {r: {} for r in self.ranks}
        self.outputs: list = []
        self.bias = BIAS in self.mods[0][0].tensors
        self.pad = QUARK_PAD if pc.census.spelling.name == "quark" else 0

    def slice_transforms(self) -> list[str]:
        if self.pc.parallel.single or self.pc.parallel.expert_parallel or not self.fused:
            return super().slice_transforms()
        return ["intermediate_slice_32_blocks"]

    def plan(self) -> None:
        par = self.pc.parallel
        self.hp = roundup(self.h, 256)
        # vLLM pads I / tp (FusedMoEConfig asserts I % tp), not the gpt-oss loader's rows (Ip >= them, §19.4)
        self.ip = {r: roundup(self.i if par.expert_parallel else self.i // par.tp, 128) for r in self.ranks}
        pairs = "rows_up_gate_pairs" if not self.fused else "swap_every_two_rows"
        for r in self.ranks:
            e, ip, hp, st = self.local(r), self.ip[r], self.hp, ["stack_experts"] + self.slice_transforms()
            w13, w2 = self.w13_sources(r), self.src("down", WEIGHT, r)
            self.add(r, Role.W13_WEIGHT, "U8", (e, 2 * ip, hp // 2), w13[WEIGHT], st + ["pad_to_Ip_Hp", pairs, ROW_SHUFFLE])
            self.add(r, Role.W13_WEIGHT_SCALE, "U8", (e, 2 * ip, hp // BLOCK), w13[WEIGHT_SCALE],
                     st + [f"pad_to_Ip_Hp_{self.pad}", pairs, ROW_SHUFFLE, "swizzle_128x4"])
            self.add(r, Role.W2_WEIGHT, "U8", (e, hp, ip // 2), w2, st + ["pad_to_Hp_Ip", ROW_SHUFFLE])
            self.add(r, Role.W2_WEIGHT_SCALE, "U8", (e, hp, ip // BLOCK), self.src("down", WEIGHT_SCALE, r),
                     st + [f"pad_to_Hp_Ip_{self.pad}", ROW_SHUFFLE, "swizzle_128x4"])
            if self.bias:
                self.add(r, Role.W13_BIAS, "F32", (e, 2 * ip), w13[BIAS], st + ["to_f32", "pad_to_Ip", pairs, ROW_SHUFFLE])
                rank0 = par.single or par.expert_parallel or par.tp_rank(r) == 0
                self.add(r, Role.W2_BIAS, "F32", (e, hp), self.src("down", BIAS, r),
                         st + ["to_f32", "pad_to_Hp", ROW_SHUFFLE] + ([] if rank0 else ["zeros_tp_rank_not_0"]))
        for role in (WEIGHT, WEIGHT_SCALE, BIAS)[:3 if self.bias else 2]:
            for e in range(self.e_count):
                self._w13_unit(e, role)
        for role in (WEIGHT, WEIGHT_SCALE, BIAS)[:3 if self.bias else 2]:
            for e in range(self.e_count):
                self._w2_unit(e, role)
        act = SWIGLUOAI if self.bias else SILU  # gpt-oss is the MoE whose experts carry biases (§19.2)
        for r in self.ranks:
            meta = {"padded_intermediate": self.ip[r], "padded_hidden": self.hp, **act, "activation_dtype": "bf16",
                    "gate_up": "interleaved" if self.fused else "halves", "scale_pad": self.pad, "bias": self.bias,
                    "split": "gpt_oss_32_blocks" if self.fused else "even"}
            self.module(r, meta | ({} if self.fused else {"vllm_path": CT_PATH}))

    def w13_sources(self, r: int) -> dict[str, list[str]]:
        roles = (WEIGHT, WEIGHT_SCALE, BIAS)
        if self.fused:
            return {s: self.src("gate_up", s, r) if s != BIAS or self.bias else [] for s in roles}
        return {s: self.src("up", s, r) + self.src("gate", s, r) if s != BIAS or self.bias else [] for s in roles}

    def _entries(self, e: int, role: str) -> list[TensorEntry]:
        g, u, _ = self.mods[e]
        return [g.tensors[role]] if u is None else [u.tensors[role], g.tensors[role]]

    def _w13_unit(self, e: int, role: str) -> None:
        entries, kind = self._entries(e, role), {WEIGHT: Role.W13_WEIGHT, WEIGHT_SCALE: Role.W13_WEIGHT_SCALE,
                                                 BIAS: Role.W13_BIAS}[role]

        def emit(ctx: UnitContext, _, r: int, rows: tuple[int, int]) -> list:
            (i0, i1), ip = rows, self.ip[r]
            raw = [_read(ctx, x, role) for x in entries]
            if len(raw) == 1:  # interleaved (gate_i, up_i) rows: the rank's pairs, each swapped
                part = raw[0][2 * i0:2 * i1]
                up, gate = part[1::2], part[0::2]
            else:
                up, gate = raw[0][i0:i1], raw[1][i0:i1]
            return [self._fc1(role, up, gate, ip)]

        self.expert_unit(f"w13{role}", e, kind, entries, emit, compute=True)

    def _fc1(self, role: str, up: np.ndarray, gate: np.ndarray, ip: int) -> np.ndarray:
        n = up.shape[0]
        cols = {WEIGHT: self.hp // 2, WEIGHT_SCALE: self.hp // BLOCK, BIAS: 1}[role]
        out = np.full((2 * ip, cols), self.pad if role == WEIGHT_SCALE else 0,
                      dtype=np.float32 if role == BIAS else np.uint8)
        out[0:2 * n:2, :up.shape[1]], out[1:2 * n:2, :gate.shape[1]] = up, gate
        out = nvfp4.permute_rows(out, shuffle_row_indices(2 * ip))
        if role == BIAS:
            return np.ascontiguousarray(out.reshape(-1)).view(np.uint8)
        return nvfp4.swizzle_block_scales(out) if role == WEIGHT_SCALE else out

    def _w2_unit(self, e: int, role: str) -> None:
        d = self.mods[e][2]
        entry, kind = d.tensors[role], {WEIGHT: Role.W2_WEIGHT, WEIGHT_SCALE: Role.W2_WEIGHT_SCALE, BIAS: Role.W2_BIAS}[role]
        par = self.pc.parallel

        def emit(ctx: UnitContext, _, r: int, rows: tuple[int, int]) -> list:
            (i0, i1), ip, hp, h = rows, self.ip[r], self.hp, self.h
            raw = _read(ctx, entry, role)
            if role == BIAS:
                out = np.zeros((hp, 1), dtype=np.float32)
                if par.single or par.expert_parallel or par.tp_rank(r) == 0:
                    out[:h] = raw
                return [np.ascontiguousarray(nvfp4.permute_rows(out, shuffle_row_indices(hp)).reshape(-1)).view(np.uint8)]
            per = 2 if role == WEIGHT else BLOCK
            out = np.full((hp, ip // per), self.pad if role == WEIGHT_SCALE else 0, dtype=np.uint8)
            out[:h, :(i1 - i0) // per] = raw[:, i0 // per:i1 // per]
            out = nvfp4.permute_rows(out, shuffle_row_indices(hp))
            return [nvfp4.swizzle_block_scales(out) if role == WEIGHT_SCALE else out]

        self.expert_unit(f"w2{role}", e, kind, [entry], emit, compute=True)


def _read(ctx: UnitContext, entry: TensorEntry, role: str) -> np.ndarray:
    """An expert's weight or scale bytes [rows, row bytes], or its bias as float32 [rows, 1]; E8M0 NaN refused."""
    raw = ctx.array(entry)
    if role == BIAS:
        return to_f32(raw, entry.dtype).reshape(-1, 1)
    if role == WEIGHT_SCALE and bool((raw == NAN_SCALE).any()):
        raise BadData(entry.name, "E8M0 scale bytes encode NaN (0xFF)")
    return raw
