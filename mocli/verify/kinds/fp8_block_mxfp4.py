"""``fp8_block_moe`` re-encoded from MXFP4 experts (``convert --mxfp4-experts fp8-block``, SEMANTICS §19.7), with
numpy alone: per rank, every expert's stored e4m3 weights (the layout's inverse undone, as ``Fp8BlockMoe``) times
their float32 block scales (clamped to 1e-10 as the engine does) equal the MXFP4 source's e2m1 values times
2^(code - 127), bit for bit, over the rank's rows of I (w13, [w3; w1]) and columns (w2); the manifest must record
the re-encoding; then the emulated GEMMs of ``Fp8BlockMoe`` against the source's exact values. The source is
decoded here, apart from the converter's encoder (``mocli.plan.mxfp4_fp8block``)."""

from __future__ import annotations

import numpy as np

from mocli.errors import CorruptFileError
from mocli.numerics.in_numpy import unpack_e2m1
from mocli.tables import WEIGHT, WEIGHT_SCALE
from mocli.targets.decode import LayoutError
from mocli.verify.kinds.fp8_block_moe import BLOCK, EMULATED, MIN_SCALE, Fp8BlockMoe, dequant
from mocli.verify.results import Problems

REENCODED_FROM = "mxfp4"


def decode_mxfp4(packed: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """e2m1 [N, K/2] times 2^(E8M0 [N, K/32] - 127), float32 [N, K] (exact: a power of two times e2m1)."""
    scale = np.ldexp(np.float32(1.0), codes.astype(np.int32) - 127).astype(np.float32)
    return unpack_e2m1(np.ascontiguousarray(packed)) * np.repeat(scale, 32, axis=1)


class ReencodedFp8BlockMoe(Fp8BlockMoe):
    label = EMULATED + "; re-encoded from MXFP4"

    def __init__(self, name, ctx) -> None:
        super().__init__(name, ctx)
        self._decoded: dict[str, np.ndarray] = {}

    def consistency(self, mod, experts, problems: Problems) -> None:
        super().consistency(mod, experts, problems)
        if getattr(mod, "reencoded_from", None) != REENCODED_FROM:
            problems.append(f"the source's experts are MXFP4 but the manifest records no re-encoding from them "
                            f"(reencoded_from: {getattr(mod, 'reencoded_from', None)!r})")

    def _values(self, m) -> np.ndarray:
        name = m.tensors[WEIGHT].name
        if name not in self._decoded:
            self._decoded[name] = decode_mxfp4(self.src.arr(name), self.src.arr(m.tensors[WEIGHT_SCALE].name))
        return self._decoded[name]

    def source(self, ex, which: str, rows=None, cols=None) -> np.ndarray:
        w = self._values(getattr(ex, which))
        if rows is not None:
            w = w[rows[0]:rows[1]]
        if cols is not None:
            w = w[:, cols[0]:cols[1]]
        return w

    def _all_bytes(self, mod, experts, i_slice) -> tuple[Problems, Exception | None]:
        found = Problems()
        try:
            for local, ex in enumerate(experts):
                got = self.decoded(mod, local)
                want = {"w13_weight": np.concatenate([self.source(ex, "up", rows=i_slice),
                                                      self.source(ex, "gate", rows=i_slice)]),
                        "w2_weight": self.source(ex, "down", cols=i_slice)}
                for which, ref in want.items():
                    scale = np.maximum(got[f"{which}_scale"], MIN_SCALE)
                    _same(found, f"{which} (expert {ex.index})", dequant(got[which], scale), ref)
        except (LayoutError, CorruptFileError, ValueError) as e:
            return found, e
        return found, None


def _same(found: Problems, what: str, got: np.ndarray, want: np.ndarray) -> None:
    """Bit for bit (+0.0 and -0.0 alike: the kernels' products do not tell them apart)."""
    if got.shape != want.shape:
        found.append(f"{what} dequantizes to {list(got.shape)}, the MXFP4 source's slice is {list(want.shape)}")
        return
    diff = (got + np.float32(0)).view(np.uint32) != (want + np.float32(0)).view(np.uint32)
    if bool(diff.any()):
        r, c = (int(v) for v in np.argwhere(diff)[0])
        found.append(f"{what}: dequantized block FP8 differs from the MXFP4 source in {int(diff.sum())} value(s), "
                     f"first at [{r}, {c}] (block ({r // BLOCK}, {c // BLOCK})): {got[r, c]!r}, the source "
                     f"{want[r, c]!r}")
