"""``nvfp4_marlin_moe`` (SEMANTICS §13.6), checked with numpy alone: per rank the padded intermediate
size and the two scale factors vLLM would compute over the rank's experts, every expert's bytes after
``mocli.targets.marlin``'s inverses ([w1; w3] halves, each padded to Ip; blocks under 2^-6 once scaled
flushed), the global scale vectors; emulated weight-only GEMMs (BF16 activations and intermediate) on
sampled experts against the source, as ``nvfp4_moe``'s stages."""

from __future__ import annotations

from functools import cached_property
from typing import Any

import numpy as np

from mocli.formats.manifest import ModuleEntry
from mocli.kinds import ModuleKind, Role
from mocli.numerics.in_numpy import bf16_round, scaled_matmul, silu
from mocli.tables import INPUT_SCALE, WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2
from mocli.targets import marlin_decode as lay
from mocli.verify.expect import apply_table
from mocli.verify.kinds.context import CheckContext
from mocli.verify.kinds.marlin_linear import expected_factor, expected_global, top_code
from mocli.verify.kinds.moe import check_moe
from mocli.verify.kinds.nvfp4_moe import Nvfp4Moe
from mocli.verify.results import Problems, rng

EMULATED_MOE = "emulated Marlin W4A16 MoE (decoded layout, exact products)"


class MarlinMoe(Nvfp4Moe):
    """One MoE layer for Marlin: ``Nvfp4Moe``'s source side and stages, Marlin's bytes and arithmetic."""

    kind = ModuleKind.NVFP4_MARLIN_MOE
    label = EMULATED_MOE
    bytes_threads = "mocli-verify-marlin"

    def __init__(self, name: str, ctx: CheckContext) -> None:  # noqa: D107 - no input scales to read
        super(Nvfp4Moe, self).__init__(name, ctx)
        self.layout, self.opts = ctx.layout, ctx.opts

    @cached_property
    def x(self) -> np.ndarray:
        """The reference input, drawn where the numerics need it (a run of expert bytes does not)."""
        shape = (self.opts.tokens, self.layer.hidden)
        return rng(self.opts.seed, self.name).standard_normal(shape, dtype=np.float32)

    @cached_property
    def ref_in(self) -> np.ndarray:
        return bf16_round(self.x)

    def numbers(self, ck, mod, off, i_slice):
        return self.stages(mod, off, i_slice)

    @staticmethod
    def quant(x: np.ndarray, a=None) -> np.ndarray:
        return bf16_round(x)

    def _s2(self, experts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return tuple(np.array([self.src.scalar(getattr(ex, p), WEIGHT_SCALE_2) for ex in experts], dtype=np.float32)
                     for p in ("gate", "up", "down"))

    def consistency(self, mod, experts, problems: Problems) -> None:
        s1, s3, s2 = self._s2(experts)
        problems.scalar("w13_weight_scale_2", mod.w13_weight_scale_2,
                        expected_global(np.maximum(s1, s3), mod.scale_factor_w13, mod.act_dtype))
        problems.scalar("w2_weight_scale_2", mod.w2_weight_scale_2, expected_global(s2, mod.scale_factor_w2, mod.act_dtype))
        every = [self.layer.experts[e] for e in sorted(self.layer.experts)]
        if mod.w13_input_scale is not None and all(INPUT_SCALE in ex.gate.tensors for ex in every):
            a13 = np.max([np.maximum(self.src.scalar(e.gate, INPUT_SCALE), self.src.scalar(e.up, INPUT_SCALE)) for e in every])
            problems.scalar(str(Role.W13_INPUT_SCALE), mod.w13_input_scale, np.full(len(experts), a13, dtype=np.float32))
            a2 = np.max([self.src.scalar(e.down, INPUT_SCALE) for e in every])
            problems.scalar(str(Role.W2_INPUT_SCALE), mod.w2_input_scale, np.full(len(experts), a2, dtype=np.float32))
        want_ip = -(-mod.intermediate // (64 if mod.hidden % 128 == 0 else 128)) * (64 if mod.hidden % 128 == 0 else 128)
        if mod.padded_intermediate != want_ip:
            problems.append(f"padded_intermediate is {mod.padded_intermediate}, vLLM pads I = {mod.intermediate} to {want_ip}")

    def decoded(self, mod, local: int, i: int) -> dict[str, Any]:
        h, ip, what = mod.hidden, mod.padded_intermediate, f"{mod.name}"
        return {
            "w13_weight": lambda: lay.halves(lay.decode_weight(mod.w13_weight[local], 2 * ip, h, f"{what}.w13_weight[{local}]"),
                                             i, ip, f"{what}.w13_weight[{local}]"),
            "w13_weight_scale": lambda: lay.halves(lay.decode_scales(
                mod.w13_weight_scale[local], 2 * ip, h // 16, mod.scale_factor_w13, f"{what}.w13_weight_scale[{local}]"),
                i, ip, f"{what}.w13_weight_scale[{local}]"),
            "w2_weight": lambda: lay.decode_weight(mod.w2_weight[local], h, i, f"{what}.w2_weight[{local}]"),
            "w2_weight_scale": lambda: lay.decode_scales(mod.w2_weight_scale[local], h, i // 16, mod.scale_factor_w2,
                                                         f"{what}.w2_weight_scale[{local}]")}

    def source_codes(self, ex, i_slice: tuple[int, int]) -> dict[str, list[np.ndarray]]:
        """The block-scale codes vLLM starts from: w1/w3 rescaled to their max S2 (mocli's policy), w2's."""
        (i0, i1), src = i_slice, self.src
        s1, s3 = src.scalar(ex.gate, WEIGHT_SCALE_2), src.scalar(ex.up, WEIGHT_SCALE_2)
        big = np.maximum(s1, s3)
        arr = lambda m: src.arr(m.tensors[WEIGHT_SCALE].name)  # noqa: E731
        return {"w13_weight_scale": [apply_table("rescale", arr(ex.gate)[i0:i1], s1, big),
                                     apply_table("rescale", arr(ex.up)[i0:i1], s3, big)],
                "w2_weight_scale": [arr(ex.down)[:, i0 // 16:i1 // 16]]}

    def expert_bytes(self, mod, i_slice):
        """One expert's bytes; it returns, per scale role, the largest code of each of its source parts
        (``marlin_linear.top_code``), from which ``bytes_found`` computes the rank's scale factors."""
        (i0, i1), i, src, sf = i_slice, i_slice[1] - i_slice[0], self.src, _factors(mod)

        def one(local: int, ex, found: Problems) -> dict[str, np.ndarray]:
            got, scales = self.decoded(mod, local, i), self.source_codes(ex, i_slice)
            want = {"w13_weight": [src.arr(ex.gate.tensors[WEIGHT].name)[i0:i1], src.arr(ex.up.tensors[WEIGHT].name)[i0:i1]],
                    "w2_weight": [src.arr(ex.down.tensors[WEIGHT].name)[:, i0 // 2:i1 // 2]]}
            want |= {role: [lay.flushed(c, sf[role]) for c in parts] for role, parts in scales.items()}
            same = {"w13_weight": lambda: lay.weight_matches(mod.w13_weight[local], 2 * mod.padded_intermediate, mod.hidden,
                                                             halves_at(i, mod.padded_intermediate, want["w13_weight"])),
                    "w2_weight": lambda: lay.weight_matches(mod.w2_weight[local], mod.hidden, i,
                                                            [(slice(None), want["w2_weight"][0])])}
            for role, parts in want.items():
                if role not in same or not same[role]():  # not shown equal in C: decoded, a difference said as ever
                    found.expect_parts(f"{role} (expert {ex.index})", got[role](), parts)
            return {role: np.array([top_code(c) for c in parts if c.size], dtype=np.uint8)
                    for role, parts in scales.items()}

        return one

    def bytes_found(self, mod, found, fault, got):
        """All experts read (no fault): the rank's two scale factors as vLLM computes them over them."""
        if fault is not None:
            return found, fault
        for role, stored in _factors(mod).items():
            if stored != (vllm := expected_factor([per[role] for per in got], mod.act_dtype)):
                found.insert(0, f"{role}: scale factor {stored}, vLLM computes {vllm} over the rank's experts")
        return found, None

    def expert_gemms(self, mod, local: int, i: int):
        """One expert as Marlin computes it from the decoded layout: [w1; w3] rows, silu(first) * second,
        the intermediate in BF16. GEMM1 is returned as [up | gate], the order the driver compares."""
        w = self.decoded(mod, local, i)
        g13 = lay.global_of(mod.w13_weight_scale_2[local], mod.scale_factor_w13, mod.act_dtype)
        g2 = lay.global_of(mod.w2_weight_scale_2[local], mod.scale_factor_w2, mod.act_dtype)
        o1 = scaled_matmul(self.ref_in, w["w13_weight"](), w["w13_weight_scale"]()) * g13
        h = bf16_round(silu(o1[:, :i]) * o1[:, i:])
        o2 = scaled_matmul(h, w["w2_weight"](), w["w2_weight_scale"]()) * g2
        ex = self.layer.experts[mod.expert_offset + local]
        rescaled = self.src.scalar(ex.gate, WEIGHT_SCALE_2) != self.src.scalar(ex.up, WEIGHT_SCALE_2)
        return (np.concatenate([o1[:, i:], o1[:, :i]], axis=1), o2, h,
                self.limits.unified if rescaled else self.limits.kept)


def halves_at(i: int, ip: int, parts: list[np.ndarray]) -> list[tuple[slice, np.ndarray]]:
    """Where an expert's two halves of ``i`` rows sit among its stored w13 rows, each half padded to ``ip``."""
    return [(slice(0, i), parts[0]), (slice(ip, ip + i), parts[1])]


def _factors(mod) -> dict[str, float]:
    """The rank's stored scale factors, by the block-scale role each scales."""
    return {"w13_weight_scale": mod.scale_factor_w13, "w2_weight_scale": mod.scale_factor_w2}


def check(name: str, infos: dict[int, ModuleEntry], ctx: CheckContext):
    return check_moe(name, infos, ctx, MarlinMoe)
