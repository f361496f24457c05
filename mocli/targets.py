"""Conversion targets: one registry, also the CLI's choices.

Adding a target = one enum member + one entry in each table below + its layout module.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from mocli.quant_config import Algo


class Target(StrEnum):
    FLASHINFER_CUTLASS = "flashinfer-cutlass"
    FLASHINFER_TRTLLM = "flashinfer-trtllm"


@dataclass(frozen=True)
class Constraint:
    """``dim % multiple == 0`` for modules of ``scope`` ("linear" | "moe") stored in ``algo``."""

    scope: str
    algo: Algo
    dim: str  # linear: "N", "K"; moe: "2I", "H"
    multiple: int
    why: str


_BOTH = (Target.FLASHINFER_CUTLASS, Target.FLASHINFER_TRTLLM)

CONSTRAINTS: dict[Target, list[Constraint]] = {t: [] for t in Target}
for _t in _BOTH:
    CONSTRAINTS[_t] += [
        # SEMANTICS §1/§8: 128x128 weight blocks.
        Constraint("linear", Algo.FP8_PB_WO, "N", 128, "FP8_PB_WO scales 128x128 blocks (SEMANTICS §8)"),
        Constraint("linear", Algo.FP8_PB_WO, "K", 128, "FP8_PB_WO scales 128x128 blocks (SEMANTICS §8)"),
        # cuBLASLt / torch._scaled_mm FP8: both GEMM dims a multiple of 16.
        Constraint("linear", Algo.FP8, "N", 16, "FP8 tensor-core GEMMs need N % 16 == 0"),
        Constraint("linear", Algo.FP8, "K", 16, "FP8 tensor-core GEMMs need K % 16 == 0"),
        # SEMANTICS §7.4/§7.6: fused-MoE kernels check alignTo(I, 64) and H % 64.
        Constraint("moe", Algo.NVFP4, "2I", 128, "NVFP4 fused-MoE needs 2I % 128 == 0 (SEMANTICS §7)"),
        Constraint("moe", Algo.NVFP4, "H", 64, "NVFP4 fused-MoE needs H % 64 == 0 (SEMANTICS §7)"),
        Constraint("moe", Algo.FP8, "2I", 16, "FP8 fused-MoE GEMMs need 2I % 16 == 0"),
        Constraint("moe", Algo.FP8, "H", 16, "FP8 fused-MoE GEMMs need H % 16 == 0"),
    ]
CONSTRAINTS[Target.FLASHINFER_TRTLLM] += [
    # SEMANTICS §6: shuffle_matrix_a(., 128) and the 128x4 scale interleave without padding.
    Constraint("linear", Algo.NVFP4, "N", 128, "trtllm NVFP4 GEMM shuffles rows in 128-row tiles (SEMANTICS §6)"),
    Constraint("linear", Algo.NVFP4, "K", 64, "trtllm NVFP4 needs (K/16) % 4 == 0 (SEMANTICS §6)"),
    # SEMANTICS §4: shuffle_matrix_a permutes rows in blocks of 32 (w13 rows = 2I, w2 rows = H).
    Constraint("moe", Algo.FP8, "2I", 32, "trtllm FP8 MoE shuffles w13 rows in blocks of 32 (SEMANTICS §4)"),
    Constraint("moe", Algo.FP8, "H", 32, "trtllm FP8 MoE shuffles w2 rows in blocks of 32 (SEMANTICS §4)"),
    # flashinfer 0.7.2 get_shuffle_matrix_sf_a_row_indices asserts M % 128 on the w2 block scales [H, I/16]:
    # stricter than SEMANTICS §7.6's H % 64, which assumes the engine pads H.
    Constraint("moe", Algo.NVFP4, "H", 128, "trtllm shuffles w2 block scales [H, I/16] in 128-row tiles"),
]

# Which stored schemes each target converts, per scope.
SUPPORTED: dict[Target, dict[str, frozenset[Algo]]] = {
    t: {
        "linear": frozenset({Algo.FP8, Algo.FP8_PER_CHANNEL_PER_TOKEN, Algo.FP8_PB_WO, Algo.NVFP4}),
        "moe": frozenset({Algo.FP8, Algo.NVFP4}),
    }
    for t in Target
}
