"""flashinfer-trtllm: TensorRT-LLM-generated kernels, rows shuffled in tiles (SEMANTICS §4, §6, §7)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mocli.kinds import BLOCK_MAJOR_K, FLASHINFER_KINDS, ModuleKind, Role
from mocli.schemes import FP8, MXFP4, MXFP8, NVFP4, NVFP4_AWQ
from mocli.targets.base import ROW_SHUFFLE, SHARED_CONSTRAINTS, SUPPORTED, Constraint, Target, TargetLayout

BLOCK_SHUFFLE = "shuffle_matrix_a_64"  # the 16-row shuffle of FP8 block-scale experts (SEMANTICS §18.2)

if TYPE_CHECKING:
    import numpy as np
    import torch


class TrtllmLayout(TargetLayout):
    target = Target.FLASHINFER_TRTLLM
    kernels = "FlashInfer's TensorRT-LLM kernels (rows shuffled)"
    gpus = "sm_100/sm_103 (B200, GB200, B300)"
    shuffles_rows = True
    row_shuffled_kinds = frozenset({ModuleKind.NVFP4_LINEAR, ModuleKind.FP8_MOE, ModuleKind.NVFP4_MOE,
                                    ModuleKind.MXFP8_LINEAR, ModuleKind.MXFP8_MOE, ModuleKind.MXFP4_MOE})
    # TRT-LLM's MXFP4 experts (SEMANTICS §19.6); its dense MXFP4 is not vLLM's (TGT002 names marlin, §19.7)
    kinds = FLASHINFER_KINDS | {ModuleKind.MXFP4_MOE}
    # vLLM 0.33 runs MXFP8 MoE on FlashInfer's TRT-LLM kernel only (no CUTLASS MXFP8 MoE: SEMANTICS §14.3)
    supported = {"linear": SUPPORTED["linear"], "moe": SUPPORTED["moe"] | {MXFP8, MXFP4}}
    extra_roles = {
        ModuleKind.FP8_MOE: frozenset({Role.OUTPUT1_SCALES_SCALAR, Role.OUTPUT1_SCALES_GATE_SCALAR,
                                       Role.OUTPUT2_SCALES_SCALAR}),
        ModuleKind.NVFP4_MOE: frozenset({Role.OUTPUT1_SCALE_SCALAR, Role.OUTPUT1_SCALE_GATE_SCALAR,
                                         Role.OUTPUT2_SCALE_SCALAR}),
    }
    constraints = SHARED_CONSTRAINTS + (
        # SEMANTICS §6: shuffle_matrix_a(., 128) and the 128x4 scale interleave without padding.
        *(c for s in (NVFP4, NVFP4_AWQ) for c in (
            Constraint("linear", s, "N", 128, "trtllm NVFP4 GEMM shuffles rows in 128-row tiles (SEMANTICS §6)"),
            Constraint("linear", s, "K", 64, "trtllm NVFP4 needs (K/16) % 4 == 0 (SEMANTICS §6)"),
            Constraint("moe", s, "H", 128, "trtllm shuffles w2 block scales [H, I/16] in 128-row tiles (SEMANTICS §7)"))),
        # SEMANTICS §14.2: FlashInferTrtllmMxfp8LinearKernel requires K % 256
        Constraint("linear", MXFP8, "K", 256, "trtllm's MXFP8 GEMM needs K % 256 == 0 (SEMANTICS §14.2)"),
        # SEMANTICS §4: shuffle_matrix_a permutes rows in blocks of 32 (w13 rows = 2I, w2 rows = H).
        Constraint("moe", FP8, "2I", 32, "trtllm FP8 MoE shuffles w13 rows in blocks of 32 (SEMANTICS §4)"),
        Constraint("moe", FP8, "H", 32, "trtllm FP8 MoE shuffles w2 rows in blocks of 32 (SEMANTICS §4)"),
    )

    def nvfp4_weight_shape(self, n: int, k: int) -> tuple[int, int]:
        return n, k // 2

    def nvfp4_weight_rows(self, n: int) -> np.ndarray | None:
        from mocli.ops.rows import shuffle_row_indices

        return shuffle_row_indices(n)

    def nvfp4_weight_transforms(self, n: int, k: int) -> list[str]:
        return [ROW_SHUFFLE]

    def nvfp4_weight_decode(self, stored: torch.Tensor, n: int, k: int, what: str) -> torch.Tensor:
        from mocli.targets import decode

        return decode.unshuffle_rows(stored)

    def _unrow(self, t: torch.Tensor) -> torch.Tensor:
        from mocli.targets import decode

        return decode.unshuffle_rows(t)

    def w13_rows(self, rows: int) -> np.ndarray | None:
        from mocli.ops.rows import gated_shuffled_row_indices

        return gated_shuffled_row_indices(rows)

    def w2_rows(self, rows: int) -> np.ndarray | None:
        from mocli.ops.rows import shuffle_row_indices

        return shuffle_row_indices(rows)

    def moe_row_transforms(self, gated: bool) -> list[str]:
        return (["reorder_rows_gated_act"] if gated else []) + [ROW_SHUFFLE]

    def moe_rows_decode(self, stored: torch.Tensor, gated: bool) -> torch.Tensor:
        from mocli.targets import decode

        rows = decode.unshuffle_rows(stored)
        return decode.ungate_rows(rows) if gated else rows

    def moe_rows_halves(self, stored: torch.Tensor, gated: bool) -> torch.Tensor | None:
        from mocli.targets import decode

        return decode.shuffled_halves(stored, gated) if stored.ndim == 2 and stored.shape[0] % 32 == 0 else None

    # FP8 128x128-block experts: trtllm_fp8_block_scale_moe's DeepSeekFp8 BlockMajorK weights (SEMANTICS §18.2):
    # rows shuffled in 16-row blocks (shuffle_matrix_a(., 64)), then [K/128, M, 128]

    def block_moe_shape(self, m: int, k: int) -> tuple[int, ...]:
        return k // 128, m, 128

    def block_moe_transforms(self) -> list[str]:
        return [BLOCK_SHUFFLE, BLOCK_MAJOR_K]

    def block_moe_weight(self, w: np.ndarray) -> np.ndarray:
        from mocli.ops.rows import shuffle16_row_indices

        m, k = w.shape
        return w[shuffle16_row_indices(m)].reshape(m, k // 128, 128).transpose(1, 0, 2)

    def block_moe_decode(self, stored: torch.Tensor) -> torch.Tensor:
        from mocli.targets import decode

        return decode.unshuffle16_block_major(stored)

    def moe_extra_scales(self, kind: ModuleKind, g1: torch.Tensor, g2: torch.Tensor,
                         a2_inv: torch.Tensor) -> dict[Role, tuple[torch.Tensor, str]]:
        # SEMANTICS §4/§7.6: output1 = g1 * (1/a2) with the float32 reciprocal, as vLLM computes it
        # (g1 / a2 differs by one ulp in about a third of real experts).
        out1 = (g1 * a2_inv, "g1_alphas * (1 / w2_input_scale)")
        if kind is ModuleKind.FP8_MOE:
            return {Role.OUTPUT1_SCALES_SCALAR: out1, Role.OUTPUT1_SCALES_GATE_SCALAR: (g1, "g1_alphas"),
                    Role.OUTPUT2_SCALES_SCALAR: (g2, "g2_alphas")}
        return {Role.OUTPUT1_SCALE_SCALAR: out1, Role.OUTPUT1_SCALE_GATE_SCALAR: (g1, "g1_alphas"),
                Role.OUTPUT2_SCALE_SCALAR: (g2, "g2_alphas")}
