"""Plan a conversion from headers and small scales: every output tensor and every work unit.

Nothing here moves weight bytes. ``build_plan`` decides names, dtypes, shapes, roles and the
per-unit work; ``mocli.execute`` runs the units and writes each result straight to its place.
Layouts follow SEMANTICS §3-§8; scalar scale arithmetic is float32 on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mocli.census import Census, Kind, Module, MoELayer
from mocli.checkpoint import LAYOUT_MANIFEST
from mocli.io.safetensors_file import DTYPE_SIZES, TensorEntry, TensorReader
from mocli.ops.fp8 import requantize_fp8
from mocli.ops.layout import (
    gated_act_row_indices,
    pad_2d,
    roundup,
    shuffle_row_indices,
    swizzle_block_scales,
    swizzled_shape,
)
from mocli.ops.nvfp4 import as_fp8, rescale_block_scales
from mocli.quant_config import Algo
from mocli.tables import INPUT_SCALE, WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2
from mocli.targets import Target

LAYOUT_VERSION = 1
MANIFEST_NAME = LAYOUT_MANIFEST
# cutlass NVFP4 GEMMs take N and K padded to multiples of 32 (SEMANTICS §6).
CUTLASS_FP4_PAD = 32

F32 = torch.float32


@dataclass
class OutTensor:
    name: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    role: str
    sources: list[str]
    transforms: list[str]

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "role": self.role,
                "sources": self.sources, "transforms": self.transforms}


@dataclass
class Piece:
    """Bytes for part of one output tensor: ``data`` goes at ``offset`` bytes into ``tensor``."""

    tensor: str
    offset: int
    data: torch.Tensor


class UnitContext:
    """What a unit may use: a tensor reader and the device to compute on."""

    def __init__(self, reader: TensorReader, device: torch.device) -> None:
        self.reader = reader
        self.device = device

    def load(self, entry: TensorEntry) -> torch.Tensor:
        t = self.reader.read(entry)
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=False)


@dataclass
class Unit:
    id: str
    inputs: list[TensorEntry]
    run: Callable[[UnitContext], list[Piece]]

    @property
    def input_bytes(self) -> int:
        return sum(e.nbytes for e in self.inputs)


@dataclass
class ConvertedModule:
    """Manifest entry: one kernel-facing module and the output tensors that feed it."""

    name: str
    kind: str
    scheme: str
    tensors: dict[str, str]
    sources: list[str]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "scheme": self.scheme, "tensors": self.tensors,
                "sources": self.sources, "meta": self.meta}


@dataclass
class Plan:
    target: Target
    tensors: dict[str, OutTensor] = field(default_factory=dict)
    units: list[Unit] = field(default_factory=list)
    modules: list[ConvertedModule] = field(default_factory=list)
    repairs: dict[str, Any] = field(default_factory=lambda: {
        "fp8_requantized_shards": 0, "nvfp4_rescaled_shards": 0, "nvfp4_rescaled_experts": 0,
        "nvfp4_worst_scale_2_ratio": 1.0})

    def add(self, t: OutTensor) -> str:
        if t.name in self.tensors:
            raise ValueError(f"output tensor {t.name} planned twice")
        self.tensors[t.name] = t
        return t.name

    def manifest(self) -> dict[str, Any]:
        return {
            "format": "mocli-layout",
            "layout_version": LAYOUT_VERSION,
            "target": str(self.target),
            "modules": [m.to_dict() for m in self.modules],
            "tensors": {n: t.to_dict() for n, t in self.tensors.items()},
        }


def _scalar(v: float | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(v, dtype=F32).reshape(())


# --- the planner ----------------------------------------------------------------------------------

def build_plan(census: Census, scales: dict[str, torch.Tensor], target: Target) -> Plan:
    plan = Plan(target)
    consumed: set[str] = set()

    for g in census.fused:
        schemes = {m.scheme for m in g.shards}
        if len(schemes) == 1 and None not in schemes:
            _plan_dense(plan, g.name, g.shards, schemes.pop(), scales, consumed)
    for m in census.modules.values():
        if m.scheme is not None and m.kind is Kind.LINEAR:
            _plan_dense(plan, m.name, [m], m.scheme, scales, consumed)
    for layer in census.moe:
        schemes = layer.schemes
        if schemes == {Algo.FP8}:
            _plan_moe_fp8(plan, layer, scales, consumed)
        elif schemes == {Algo.NVFP4}:
            _plan_moe_nvfp4(plan, layer, scales, consumed)
    _plan_passthrough(plan, census, consumed)
    return plan


def _plan_passthrough(plan: Plan, census: Census, consumed: set[str]) -> None:
    """Unquantized tensors, KV-cache scales, excluded layers: unchanged bytes, unchanged names."""
    batch: list[TensorEntry] = []
    batch_bytes = 0
    entries = [e for m in census.modules.values() for e in m.tensors.values() if e.name not in consumed]
    entries += census.kv_scales
    entries.sort(key=lambda e: (str(e.file), e.start))

    def flush() -> None:
        nonlocal batch, batch_bytes
        if batch:
            group = list(batch)
            plan.units.append(Unit(f"copy:{group[0].name}", group, lambda ctx, g=group: [
                Piece(e.name, 0, torch.frombuffer(ctx.reader.read_bytes(e), dtype=torch.uint8)
                      if e.nbytes else torch.empty(0, dtype=torch.uint8)) for e in g]))
        batch, batch_bytes = [], 0

    for e in entries:
        plan.add(OutTensor(e.name, e.dtype, e.shape, "passthrough", [e.name], []))
        batch.append(e)
        batch_bytes += e.nbytes
        if batch_bytes >= 64 << 20 or len(batch) >= 512:
            flush()
    flush()


# --- dense linears (SEMANTICS §3, §6, §8) ---------------------------------------------------------

def _plan_dense(plan: Plan, prefix: str, shards: list[Module], scheme: Algo, scales: dict[str, torch.Tensor],
                consumed: set[str]) -> None:
    for m in shards:
        consumed.update(e.name for s, e in m.tensors.items() if s in (WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2,
                                                                        INPUT_SCALE, "bias"))
    biases = [m.tensors.get("bias") for m in shards]
    fused = len(shards) > 1
    sources = [m.name for m in shards]
    if scheme is Algo.NVFP4:
        _plan_dense_nvfp4(plan, prefix, shards, scales, sources)
    else:
        _plan_dense_fp8(plan, prefix, shards, scheme, scales, sources)
    if any(b is not None for b in biases):
        if not all(b is not None for b in biases):
            raise ValueError(f"{prefix}: some shards have a bias and some do not")
        n = sum(b.shape[0] for b in biases)
        name = plan.add(OutTensor(f"{prefix}.bias", biases[0].dtype, (n,), "bias", [b.name for b in biases],
                                  ["concat_rows"] if fused else []))
        plan.modules[-1].tensors["bias"] = name
        plan.units.append(Unit(f"bias:{prefix}", biases, lambda ctx: _concat_pieces(
            name, [ctx.reader.read(b) for b in biases])))


def _concat_pieces(name: str, parts: list[torch.Tensor]) -> list[Piece]:
    out, off = [], 0
    for p in parts:
        out.append(Piece(name, off, p))
        off += p.numel() * p.element_size()
    return out


def _plan_dense_fp8(plan: Plan, prefix: str, shards: list[Module], scheme: Algo,
                    scales: dict[str, torch.Tensor], sources: list[str]) -> None:
    n = sum(m.out_in[0] for m in shards)
    k = shards[0].out_in[1]
    fused = ["concat_rows"] if len(shards) > 1 else []
    wname = f"{prefix}.weight"
    tensors = {"weight": wname}
    weights = [m.tensors[WEIGHT] for m in shards]
    if scheme is Algo.FP8:
        s = [scales[m.tensors[WEIGHT_SCALE].name].reshape(()) for m in shards]
        a = [scales[m.tensors[INPUT_SCALE].name].reshape(()) for m in shards]
        big_s = torch.stack(s).max()
        requant = [bool(si != big_s) for si in s]
        plan.repairs["fp8_requantized_shards"] += sum(requant)
        plan.add(OutTensor(wname, "F8_E4M3", (n, k), "weight", [w.name for w in weights],
                           fused + (["requantize_max_scale"] if any(requant) else [])))
        tensors["weight_scale"] = plan.add(OutTensor(f"{prefix}.weight_scale", "F32", (), "weight_scale",
                                                     [m.tensors[WEIGHT_SCALE].name for m in shards],
                                                     ["max"] if fused else []))
        tensors["input_scale"] = plan.add(OutTensor(f"{prefix}.input_scale", "F32", (), "input_scale",
                                                    [m.tensors[INPUT_SCALE].name for m in shards],
                                                    ["max"] if fused else []))
        big_a = torch.stack(a).max()

        def run(ctx: UnitContext) -> list[Piece]:
            pieces, off = [], 0
            for w, si in zip(weights, s, strict=True):
                q = requantize_fp8(ctx.load(w), si, big_s)
                pieces.append(Piece(wname, off, q))
                off += w.nbytes
            pieces += [Piece(tensors["weight_scale"], 0, _scalar(big_s)),
                       Piece(tensors["input_scale"], 0, _scalar(big_a))]
            return pieces
    else:
        plan.add(OutTensor(wname, "F8_E4M3", (n, k), "weight", [w.name for w in weights], fused))
        scale_entries = [m.tensors[WEIGHT_SCALE] for m in shards]
        if scheme is Algo.FP8_PER_CHANNEL_PER_TOKEN:
            sshape: tuple[int, ...] = (n,)
            reshape: Callable[[torch.Tensor], torch.Tensor] = lambda t: t.reshape(-1)  # noqa: E731
        else:  # FP8_PB_WO: [N/128, 1, K/128, 1] -> [N/128, K/128] (SEMANTICS §8)
            sshape = (n // 128, k // 128)
            reshape = lambda t: t.reshape(-1, k // 128)  # noqa: E731
        tensors["weight_scale"] = plan.add(OutTensor(f"{prefix}.weight_scale", "F32", sshape, "weight_scale",
                                                     [e.name for e in scale_entries],
                                                     fused + (["reshape_blocks"] if scheme is Algo.FP8_PB_WO else [])))

        def run(ctx: UnitContext) -> list[Piece]:
            pieces = _concat_pieces(wname, [ctx.reader.read(w) for w in weights])
            pieces += _concat_pieces(tensors["weight_scale"], [reshape(scales[e.name]) for e in scale_entries])
            return pieces

    kind = {Algo.FP8: "fp8_linear", Algo.FP8_PER_CHANNEL_PER_TOKEN: "fp8_channel_linear",
            Algo.FP8_PB_WO: "fp8_block_linear"}[scheme]
    plan.modules.append(ConvertedModule(prefix, kind, str(scheme), tensors, sources,
                                        {"n": n, "k": k, "shard_rows": [m.out_in[0] for m in shards]}))
    plan.units.append(Unit(f"dense:{prefix}", weights, run))


def _plan_dense_nvfp4(plan: Plan, prefix: str, shards: list[Module], scales: dict[str, torch.Tensor],
                      sources: list[str]) -> None:
    target = plan.target
    n = sum(m.out_in[0] for m in shards)
    k = shards[0].out_in[1]
    kb = k // 16
    fused = ["concat_rows"] if len(shards) > 1 else []
    s2 = [scales[m.tensors[WEIGHT_SCALE_2].name].reshape(()) for m in shards]
    a = [scales[m.tensors[INPUT_SCALE].name].reshape(()) for m in shards]
    big_s2, big_a = torch.stack(s2).max(), torch.stack(a).max()
    rescaled = [bool(x != big_s2) for x in s2]
    plan.repairs["nvfp4_rescaled_shards"] += sum(rescaled)
    if any(rescaled):
        ratio = float(big_s2 / torch.stack(s2).min())
        plan.repairs["nvfp4_worst_scale_2_ratio"] = max(plan.repairs["nvfp4_worst_scale_2_ratio"], ratio)
    if target is Target.FLASHINFER_CUTLASS:
        wshape = (roundup(n, CUTLASS_FP4_PAD), roundup(k, CUTLASS_FP4_PAD) // 2)
        wtrans = fused + ([f"pad_to_{CUTLASS_FP4_PAD}"] if wshape != (n, k // 2) else [])
        strans = fused + (["rescale_to_max_scale_2"] if any(rescaled) else []) + ["swizzle_128x4"]
    else:
        wshape = (n, k // 2)
        wtrans = fused + ["shuffle_matrix_a_128"]
        strans = fused + (["rescale_to_max_scale_2"] if any(rescaled) else []) + ["shuffle_matrix_a_128", "swizzle_128x4"]
    sshape = swizzled_shape(n, kb)
    weights = [m.tensors[WEIGHT] for m in shards]
    bscales = [m.tensors[WEIGHT_SCALE] for m in shards]
    t = {
        "weight": plan.add(OutTensor(f"{prefix}.weight", "U8", wshape, "weight", [w.name for w in weights], wtrans)),
        "weight_scale": plan.add(OutTensor(f"{prefix}.weight_scale", "F8_E4M3", sshape, "block_scale",
                                           [b.name for b in bscales], strans)),
        "weight_scale_2": plan.add(OutTensor(f"{prefix}.weight_scale_2", "F32", (), "weight_scale_2",
                                             [m.tensors[WEIGHT_SCALE_2].name for m in shards], ["max"])),
        "input_scale": plan.add(OutTensor(f"{prefix}.input_scale", "F32", (), "input_scale",
                                          [m.tensors[INPUT_SCALE].name for m in shards], ["max"])),
        "alpha": plan.add(OutTensor(f"{prefix}.alpha", "F32", (), "alpha", [], ["input_scale * weight_scale_2"])),
        "input_scale_inv": plan.add(OutTensor(f"{prefix}.input_scale_inv", "F32", (), "input_scale_inv", [],
                                              ["1 / input_scale"])),
    }
    alpha = big_a * big_s2
    inv = torch.reciprocal(big_a)

    def run(ctx: UnitContext) -> list[Piece]:
        pieces: list[Piece] = []
        row_off = 0
        for w in weights:
            q = ctx.load(w)
            if target is Target.FLASHINFER_CUTLASS:
                q = pad_2d(q, q.shape[0], wshape[1])
            else:
                q = q[shuffle_row_indices(q.shape[0]).to(q.device)]
            pieces.append(Piece(t["weight"], row_off * wshape[1], q))
            row_off += w.shape[0]
        if target is Target.FLASHINFER_CUTLASS and wshape[0] > n:
            pieces.append(Piece(t["weight"], n * wshape[1],
                                torch.zeros((wshape[0] - n, wshape[1]), dtype=torch.uint8, device=ctx.device)))
        bs = torch.cat([rescale_block_scales(as_fp8(ctx.load(b)), si, big_s2) for b, si in zip(bscales, s2,
                                                                                              strict=True)])
        if target is Target.FLASHINFER_TRTLLM:
            bs = bs[shuffle_row_indices(n).to(bs.device)]
        pieces.append(Piece(t["weight_scale"], 0, swizzle_block_scales(bs)))
        pieces += [Piece(t["weight_scale_2"], 0, _scalar(big_s2)), Piece(t["input_scale"], 0, _scalar(big_a)),
                   Piece(t["alpha"], 0, _scalar(alpha)), Piece(t["input_scale_inv"], 0, _scalar(inv))]
        return pieces

    plan.modules.append(ConvertedModule(prefix, "nvfp4_linear", str(Algo.NVFP4), t, sources,
                                        {"n": n, "k": k, "shard_rows": [m.out_in[0] for m in shards],
                                         "padded_n": wshape[0], "padded_k": wshape[1] * 2}))
    plan.units.append(Unit(f"dense:{prefix}", weights + bscales, run))


# --- MoE (SEMANTICS §4, §7) -----------------------------------------------------------------------

def _expert_mods(layer: MoELayer) -> list[tuple[Module, Module, Module]]:
    return [(layer.experts[e].gate, layer.experts[e].up, layer.experts[e].down) for e in sorted(layer.experts)]


def _w13_row_index(rows: int, target: Target) -> torch.Tensor | None:
    """Row permutation applied to each expert's [w3; w1] (None = identity)."""
    if target is Target.FLASHINFER_TRTLLM:
        return gated_act_row_indices(rows)[shuffle_row_indices(rows)]
    return None


def _w2_row_index(rows: int, target: Target) -> torch.Tensor | None:
    return shuffle_row_indices(rows) if target is Target.FLASHINFER_TRTLLM else None


def _permute(t: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    return t if idx is None else t[idx.to(t.device)]


def _moe_common(plan: Plan, layer: MoELayer, consumed: set[str]) -> tuple[list, int, int, int]:
    mods = _expert_mods(layer)
    for trio in mods:
        for m in trio:
            consumed.update(e.name for s, e in m.tensors.items()
                            if s in (WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2, INPUT_SCALE))
    return mods, len(mods), layer.intermediate, layer.hidden


def _s(scales: dict[str, torch.Tensor], m: Module, suffix: str) -> torch.Tensor:
    return scales[m.tensors[suffix].name].reshape(())


def _per_expert(scales: dict[str, torch.Tensor], mods: list, suffix: str) -> tuple[torch.Tensor, ...]:
    """([E] gate, [E] up, [E] down) values of one scale suffix."""
    return tuple(torch.stack([_s(scales, trio[j], suffix) for trio in mods]) for j in range(3))


def _moe_input_scales(scales: dict[str, torch.Tensor], mods: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(a13, a2): max input scale over all experts' w1/w3, and over their w2 (SEMANTICS §4, §7.3)."""
    g, u, d = _per_expert(scales, mods, INPUT_SCALE)
    return torch.maximum(g, u).max(), d.max()


def _plan_moe_fp8(plan: Plan, layer: MoELayer, scales: dict[str, torch.Tensor], consumed: set[str]) -> None:
    target = plan.target
    mods, e_count, i, h = _moe_common(plan, layer, consumed)
    p = layer.name
    s1, s3, s2 = _per_expert(scales, mods, WEIGHT_SCALE)
    w13_scale = torch.maximum(s1, s3)
    a1, a2 = _moe_input_scales(scales, mods)
    plan.repairs["fp8_requantized_shards"] += int((s1 != w13_scale).sum() + (s3 != w13_scale).sum())
    g1 = w13_scale * a1
    g2 = s2 * a2
    perm = ["reorder_rows_gated_act", "shuffle_matrix_a_128"] if target is Target.FLASHINFER_TRTLLM else []
    src = lambda proj, suffix: [getattr(layer.experts[e], proj).tensors[suffix].name  # noqa: E731
                                for e in sorted(layer.experts)]
    t = {
        "w13_weight": plan.add(OutTensor(f"{p}.w13_weight", "F8_E4M3", (e_count, 2 * i, h), "w13_weight",
                                         src("up", WEIGHT) + src("gate", WEIGHT),
                                         ["stack_experts", "requantize_max_scale", "rows_w3_w1"] + perm)),
        "w2_weight": plan.add(OutTensor(f"{p}.w2_weight", "F8_E4M3", (e_count, h, i), "w2_weight",
                                        src("down", WEIGHT), ["stack_experts"] + perm[1:])),
    }
    vectors: dict[str, tuple[torch.Tensor, str, list[str]]] = {
        "w13_weight_scale": (w13_scale, "max(w1, w3) per expert", src("gate", WEIGHT_SCALE) + src("up", WEIGHT_SCALE)),
        "w2_weight_scale": (s2, "stack_experts", src("down", WEIGHT_SCALE)),
        "w13_input_scale": (a1, "max over experts", src("gate", INPUT_SCALE) + src("up", INPUT_SCALE)),
        "w2_input_scale": (a2, "max over experts", src("down", INPUT_SCALE)),
        "w13_input_scale_inv": (torch.reciprocal(a1), "1 / w13_input_scale", []),
        "w2_input_scale_inv": (torch.reciprocal(a2), "1 / w2_input_scale", []),
        "g1_alphas": (g1, "w13_weight_scale * w13_input_scale", []),
        "g2_alphas": (g2, "w2_weight_scale * w2_input_scale", []),
    }
    if target is Target.FLASHINFER_TRTLLM:
        vectors |= {
            "output1_scales_scalar": (g1 / a2, "g1_alphas / w2_input_scale", []),
            "output1_scales_gate_scalar": (g1, "g1_alphas", []),
            "output2_scales_scalar": (g2, "g2_alphas", []),
        }
    _plan_moe_vectors(plan, layer, t, vectors)
    w13_idx, w2_idx = _w13_row_index(2 * i, target), _w2_row_index(h, target)
    for e, (g, u, d) in enumerate(mods):
        def run(ctx: UnitContext, e=e, g=g, u=u, d=d) -> list[Piece]:
            s = w13_scale[e]
            up = requantize_fp8(ctx.load(u.tensors[WEIGHT]), s3[e], s)
            gate = requantize_fp8(ctx.load(g.tensors[WEIGHT]), s1[e], s)
            w13 = _permute(torch.cat([up, gate]), w13_idx)  # [w3; w1]: FlashInfer computes act(second half) * first
            w2 = _permute(ctx.load(d.tensors[WEIGHT]), w2_idx)
            return [Piece(t["w13_weight"], e * 2 * i * h, w13), Piece(t["w2_weight"], e * h * i, w2)]

        plan.units.append(Unit(f"expert:{p}.{e}", [g.tensors[WEIGHT], u.tensors[WEIGHT], d.tensors[WEIGHT]], run))
    plan.modules.append(ConvertedModule(p, "fp8_moe", str(Algo.FP8), t, [layer.name],
                                        {"experts": e_count, "intermediate": i, "hidden": h,
                                         "naming": layer.naming.style}))


def _plan_moe_vectors(plan: Plan, layer: MoELayer, t: dict[str, str],
                      vectors: dict[str, tuple[torch.Tensor, str, list[str]]]) -> None:
    p = layer.name
    for role, (v, how, sources) in vectors.items():
        t[role] = plan.add(OutTensor(f"{p}.{role}", "F32", tuple(v.shape), role, sources, [how]))
    frozen = {role: v.to(F32).contiguous() for role, (v, _, _) in vectors.items()}
    plan.units.append(Unit(f"scales:{p}", [], lambda ctx: [Piece(t[r], 0, v) for r, v in frozen.items()]))


def _plan_moe_nvfp4(plan: Plan, layer: MoELayer, scales: dict[str, torch.Tensor], consumed: set[str]) -> None:
    target = plan.target
    mods, e_count, i, h = _moe_common(plan, layer, consumed)
    p = layer.name
    s2_1, s2_3, s2_2 = _per_expert(scales, mods, WEIGHT_SCALE_2)
    w13_s2 = torch.maximum(s2_1, s2_3)  # mocli policy: max, rescale the other half (SEMANTICS §7.1)
    mismatched = s2_1 != s2_3
    plan.repairs["nvfp4_rescaled_experts"] += int(mismatched.sum())
    if bool(mismatched.any()):
        ratio = float((w13_s2 / torch.minimum(s2_1, s2_3)).max())
        plan.repairs["nvfp4_worst_scale_2_ratio"] = max(plan.repairs["nvfp4_worst_scale_2_ratio"], ratio)
    a13, a2 = _moe_input_scales(scales, mods)
    a13_v, a2_v = a13.expand(e_count).clone(), a2.expand(e_count).clone()
    g1 = w13_s2 * a13
    g2 = s2_2 * a2
    trt = target is Target.FLASHINFER_TRTLLM
    perm = ["reorder_rows_gated_act", "shuffle_matrix_a_128"] if trt else []
    src = lambda proj, suffix: [getattr(layer.experts[e], proj).tensors[suffix].name  # noqa: E731
                                for e in sorted(layer.experts)]
    w13_sshape, w2_sshape = swizzled_shape(2 * i, h // 16), swizzled_shape(h, i // 16)
    t = {
        "w13_weight": plan.add(OutTensor(f"{p}.w13_weight", "U8", (e_count, 2 * i, h // 2), "w13_weight",
                                         src("up", WEIGHT) + src("gate", WEIGHT),
                                         ["stack_experts", "rows_w3_w1"] + perm)),
        "w13_weight_scale": plan.add(OutTensor(
            f"{p}.w13_weight_scale", "F8_E4M3", (e_count, *w13_sshape), "w13_block_scale",
            src("up", WEIGHT_SCALE) + src("gate", WEIGHT_SCALE),
            ["stack_experts", "rescale_to_max_scale_2", "rows_w3_w1"] + perm + ["swizzle_128x4"])),
        "w2_weight": plan.add(OutTensor(f"{p}.w2_weight", "U8", (e_count, h, i // 2), "w2_weight",
                                        src("down", WEIGHT), ["stack_experts"] + perm[1:])),
        "w2_weight_scale": plan.add(OutTensor(f"{p}.w2_weight_scale", "F8_E4M3", (e_count, *w2_sshape),
                                              "w2_block_scale", src("down", WEIGHT_SCALE),
                                              ["stack_experts"] + perm[1:] + ["swizzle_128x4"])),
    }
    vectors: dict[str, tuple[torch.Tensor, str, list[str]]] = {
        "w13_weight_scale_2": (w13_s2, "max(w1, w3) per expert", src("gate", WEIGHT_SCALE_2) + src("up", WEIGHT_SCALE_2)),
        "w2_weight_scale_2": (s2_2, "stack_experts", src("down", WEIGHT_SCALE_2)),
        "w13_input_scale": (a13_v, "max over experts and halves, broadcast [E]",
                            src("gate", INPUT_SCALE) + src("up", INPUT_SCALE)),
        "w2_input_scale": (a2_v, "max over experts, broadcast [E]", src("down", INPUT_SCALE)),
        "g1_alphas": (g1, "w13_weight_scale_2 * w13_input_scale", []),
        "g2_alphas": (g2, "w2_weight_scale_2 * w2_input_scale", []),
        "a1_gscale": (torch.reciprocal(a13_v), "1 / w13_input_scale", []),
        "a2_gscale": (torch.reciprocal(a2_v), "1 / w2_input_scale", []),
    }
    if trt:
        vectors |= {
            "output1_scale_scalar": (g1 / a2_v, "g1_alphas / w2_input_scale", []),
            "output1_scale_gate_scalar": (g1, "g1_alphas", []),
            "output2_scale_scalar": (g2, "g2_alphas", []),
        }
    _plan_moe_vectors(plan, layer, t, vectors)
    w13_idx, w2_idx = _w13_row_index(2 * i, target), _w2_row_index(h, target)
    w13_wbytes, w2_wbytes = 2 * i * h // 2, h * i // 2
    w13_sbytes, w2_sbytes = w13_sshape[0] * w13_sshape[1], w2_sshape[0] * w2_sshape[1]
    for e, (g, u, d) in enumerate(mods):
        def run(ctx: UnitContext, e=e, g=g, u=u, d=d) -> list[Piece]:
            big = w13_s2[e]
            w13 = _permute(torch.cat([ctx.load(u.tensors[WEIGHT]), ctx.load(g.tensors[WEIGHT])]), w13_idx)
            bs13 = torch.cat([rescale_block_scales(as_fp8(ctx.load(u.tensors[WEIGHT_SCALE])), s2_3[e], big),
                              rescale_block_scales(as_fp8(ctx.load(g.tensors[WEIGHT_SCALE])), s2_1[e], big)])
            bs13 = swizzle_block_scales(_permute(bs13, w13_idx))
            w2 = _permute(ctx.load(d.tensors[WEIGHT]), w2_idx)
            bs2 = swizzle_block_scales(_permute(as_fp8(ctx.load(d.tensors[WEIGHT_SCALE])), w2_idx))
            return [Piece(t["w13_weight"], e * w13_wbytes, w13), Piece(t["w13_weight_scale"], e * w13_sbytes, bs13),
                    Piece(t["w2_weight"], e * w2_wbytes, w2), Piece(t["w2_weight_scale"], e * w2_sbytes, bs2)]

        inputs = [m.tensors[x] for m in (g, u, d) for x in (WEIGHT, WEIGHT_SCALE)]
        plan.units.append(Unit(f"expert:{p}.{e}", inputs, run))
    plan.modules.append(ConvertedModule(p, "nvfp4_moe", str(Algo.NVFP4), t, [layer.name],
                                        {"experts": e_count, "intermediate": i, "hidden": h,
                                         "naming": layer.naming.style}))
