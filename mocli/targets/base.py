"""What every target provides, and the constraints both FlashInfer targets share."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from mocli.kinds import CARDS, FLASHINFER_KINDS, ModuleKind, Role
from mocli.schemes import FP8, FP8_BLOCK, FP8_CHANNEL, MXFP8, NVFP4, NVFP4_AWQ, Scheme

if TYPE_CHECKING:  # transforms import torch when they run, so validate and inspect never load it
    import numpy as np
    import torch


class Target(StrEnum):
    FLASHINFER_CUTLASS = "flashinfer-cutlass"
    FLASHINFER_TRTLLM = "flashinfer-trtllm"
    MARLIN = "marlin"


@dataclass(frozen=True)
class Constraint:
    """``dim % multiple == 0`` on one rank's shapes, for modules of ``scope`` stored in ``scheme``.

    linear dims: "N" (the rank's fused output rows), "K" (the rank's input columns);
    moe dims: "2I" (twice the rank's intermediate size), "H" (hidden size).
    """

    scope: str
    scheme: Scheme
    dim: str
    multiple: int
    why: str


@dataclass(frozen=True)
class Minimum:
    """``dim >= at_least`` on one rank's linear shapes ("N", "K"), below which the target's kernel declines
    the layer and the engine runs it on another one (a warning: the layout still serves through mocli's plugin)."""

    scheme: Scheme
    dim: str
    at_least: int
    why: str


# Both FlashInfer targets.
SHARED_CONSTRAINTS: tuple[Constraint, ...] = (
    # cuBLASLt / torch._scaled_mm FP8: both GEMM dims a multiple of 16.
    Constraint("linear", FP8, "N", 16, "FP8 tensor-core GEMMs need N % 16 == 0"),
    Constraint("linear", FP8, "K", 16, "FP8 tensor-core GEMMs need K % 16 == 0"),
    # SEMANTICS §7.4/§7.6: fused-MoE kernels check alignTo(I, 64) and H % 64.
    *(c for s in (NVFP4, NVFP4_AWQ) for c in (
        Constraint("moe", s, "2I", 128, "NVFP4 fused-MoE needs 2I % 128 == 0 (SEMANTICS §7)"),
        Constraint("moe", s, "H", 64, "NVFP4 fused-MoE needs H % 64 == 0 (SEMANTICS §7)"))),
    Constraint("moe", FP8, "2I", 16, "FP8 fused-MoE GEMMs need 2I % 16 == 0"),
    Constraint("moe", FP8, "H", 16, "FP8 fused-MoE GEMMs need H % 16 == 0"),
    # SEMANTICS §14.1: one E8M0 scale per 32 values along K, on each rank's columns (KMxfp8Static.create_weights)
    Constraint("linear", MXFP8, "K", 32, "MXFP8 scales blocks of 32 along K (SEMANTICS §14.1)"),
    # ModelOptMxFp8FusedMoE.create_weights: H % 32 and the rank's I % 32
    Constraint("moe", MXFP8, "H", 32, "MXFP8 experts scale blocks of 32 along H (SEMANTICS §14.1)"),
    Constraint("moe", MXFP8, "2I", 64, "MXFP8 experts scale blocks of 32 along the rank's I (SEMANTICS §14.1)"),
    # SEMANTICS §18.3: validate_fp8_block_shape_moe (the rank's I % 128), whole 128-blocks along H
    Constraint("moe", FP8_BLOCK, "2I", 256, "vLLM needs the rank's I % 128 == 0 for 128x128-block experts "
               "(validate_fp8_block_shape_moe, SEMANTICS §18.3)"),
    Constraint("moe", FP8_BLOCK, "H", 128, "128x128-block experts need H % 128 == 0 (SEMANTICS §18.3)"),
)

ROW_SHUFFLE = "shuffle_matrix_a_128"  # the transform FlashInfer's shuffle_matrix_a(., 128) records

# The stored schemes both FlashInfer targets convert, per scope (a scheme outside: TGT002)
SUPPORTED: dict[str, frozenset[Scheme]] = {
    "linear": frozenset({FP8, FP8_CHANNEL, FP8_BLOCK, NVFP4, NVFP4_AWQ, MXFP8}),
    # FP8 per-channel experts: vLLM 0.33 has no FlashInfer MoE path for them (SEMANTICS §18.1)
    "moe": frozenset({FP8, FP8_BLOCK, NVFP4, NVFP4_AWQ}),
}

# Why no target takes a (scheme, scope), where that is not a gap of mocli's: the TGT002 hint
NO_PATH: dict[tuple[Scheme, str], str] = {
    (FP8_CHANNEL, "moe"): "vLLM 0.33 has no FlashInfer path for FP8 per-channel experts: its CUTLASS or Triton "
                          "kernels take them as stored (no load-time transform to do offline); serve the "
                          "checkpoint as it is (SEMANTICS §18.1)",
}


class TargetLayout:
    """One target's layout contract. Forward transforms take and return tensors (optionally into
    ``out`` buffers); ``*_decode`` methods are their inverses, used by verify, on numpy arrays or torch
    tensors alike (``mocli.targets.decode``). Constraints are plain data, so checking them needs no
    torch."""

    target: Target
    # what the target is for, as --help and README's target table say it (``mocli.targets.describe`` adds the
    # schemes it takes, from ``supported``)
    kernels: str = ""
    gpus: str = ""
    constraints: tuple[Constraint, ...] = SHARED_CONSTRAINTS
    minimums: tuple[Minimum, ...] = ()
    supported: dict[str, frozenset[Scheme]] = SUPPORTED
    # FlashInfer's NVFP4 kernels (mm_fp4, NVFP4 cutlass_fused_moe) read this layout (sm_100+)
    fp4_kernels: bool = False
    # Whether ``nvfp4_weight_rows``, ``w13_rows`` and ``w2_rows`` permute rows (a planner asks this, and
    # leaves building the indices to the units)
    shuffles_rows: bool = False
    # The module kinds whose weights (and block scales) this target stores with rows shuffled: their
    # manifest transforms say ``ROW_SHUFFLE``, which tells this layout from one that shares its shapes
    row_shuffled_kinds: frozenset[ModuleKind] = frozenset()
    # Roles this target's kernels take beyond the kind's own (``KINDS[kind].roles``)
    extra_roles: dict[ModuleKind, frozenset[Role]] = {}
    # The module kinds this target writes (a stored scheme converts to one of them: ``kind_for``)
    kinds: frozenset[ModuleKind] = FLASHINFER_KINDS

    @property
    def weight_transforms(self) -> dict[ModuleKind, str]:
        """The transform every weight of these kinds records in this target (a kind absent: none required),
        which tells a layout from another that shares its shapes: the kinds' cards say it (``Card.transforms``)."""
        return {c.kind: t for c in CARDS for target, t in c.transforms if target == self.target}

    def moe_refusal(self, layer) -> str | None:
        """Why this target cannot write an MoE layer whose scheme it takes (TGT002), or None."""
        return None

    def roles(self, kind: ModuleKind) -> frozenset[Role]:
        """Every role a module of ``kind`` always holds in this layout, a bias aside."""
        from mocli.kinds import KINDS

        return KINDS[kind].roles | self.extra_roles.get(kind, frozenset())

    def kind_for(self, scheme, moe: bool) -> ModuleKind | None:
        """The module kind this target converts a stored scheme to (None: it has no path for it)."""
        from mocli.kinds import kind_for

        return kind_for(scheme, moe, self.kinds) if scheme in self.supported["moe" if moe else "linear"] else None

    # --- dense NVFP4 (SEMANTICS §6) ---------------------------------------------------------------

    def nvfp4_weight_shape(self, n: int, k: int) -> tuple[int, int]:
        """Stored shape of a packed [n, k/2] weight."""
        raise NotImplementedError

    def nvfp4_weight_rows(self, n: int) -> np.ndarray | None:
        """Row permutation of the weight and its block scales as a gather index (``mocli.ops.rows``;
        None: natural order)."""
        return None

    def nvfp4_weight_transforms(self, n: int, k: int) -> list[str]:
        raise NotImplementedError

    def nvfp4_weight_decode(self, stored: torch.Tensor, n: int, k: int, what: str) -> torch.Tensor:
        raise NotImplementedError

    def nvfp4_scale_decode(self, stored: torch.Tensor, n: int, kb: int, what: str) -> torch.Tensor:
        """Swizzled (and, trtllm, row-shuffled) block scales -> uint8 [n, kb] in natural order."""
        from mocli.targets import decode

        return self._unrow(decode.unswizzle(stored, n, kb, what))

    def _unrow(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def dense_rows_decode(self, stored: torch.Tensor) -> torch.Tensor:
        """A dense weight's (or its block scales') stored rows in natural order: ``nvfp4_weight_rows``
        undone (rows of any width: an MXFP8 weight's bytes, its scales)."""
        return self._unrow(stored)

    # --- MoE (SEMANTICS §4, §7) -----------------------------------------------------------------------

    def w13_rows(self, rows: int) -> np.ndarray | None:
        """Row permutation applied to each expert's [w3; w1] (weights and block scales)."""
        return None

    def w2_rows(self, rows: int) -> np.ndarray | None:
        return None

    def moe_row_transforms(self, gated: bool) -> list[str]:
        return []

    def moe_rows_decode(self, stored: torch.Tensor, gated: bool) -> torch.Tensor:
        """One expert's stored rows -> logical order ([w3; w1] for w13)."""
        return stored

    def moe_rows_halves(self, stored: torch.Tensor, gated: bool) -> torch.Tensor | None:
        """``moe_rows_decode`` of one expert's [M, cols] as a view, no byte moved: [parts, ..., cols],
        parts 2 where gated (the halves, [w3] and [w1]) else 1; a part's leading dims read in order are
        its rows (see ``decode.shuffled_halves``). None where the rows do not split so."""
        if stored.ndim != 2 or gated and stored.shape[0] % 2:
            return None
        return stored.reshape(2, stored.shape[0] // 2, stored.shape[1]) if gated else stored[None]

    def moe_extra_scales(self, kind: ModuleKind, g1: torch.Tensor, g2: torch.Tensor,
                         a2_inv: torch.Tensor) -> dict[Role, tuple[torch.Tensor, str]]:
        """Extra per-expert scale vectors this target's kernel takes (role -> (value, how))."""
        return {}

    # --- FP8 128x128-block experts (SEMANTICS §18): one expert's [M, K] weight (w13 rows [w3; w1]) -----------

    def block_moe_shape(self, m: int, k: int) -> tuple[int, ...]:
        """Stored shape of one expert's [M, K] weight (FlashInfer CUTLASS: as it is)."""
        return m, k

    def block_moe_transforms(self) -> list[str]:
        return []

    def block_moe_weight(self, w: np.ndarray) -> np.ndarray:
        """uint8 [M, K] -> the stored bytes of ``block_moe_shape``."""
        return w

    def block_moe_decode(self, stored: torch.Tensor) -> torch.Tensor:
        """The inverse: one expert's (or [E, ...] stacked) stored weight -> [M, K] natural rows."""
        return stored
