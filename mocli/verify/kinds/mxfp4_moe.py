"""``mxfp4_moe`` (SEMANTICS §19.6), checked with numpy alone, per rank: the padded sizes trtllm uses
(``Ip = roundup(I/tp, 128)``, ``Hp = roundup(H, 256)``); every expert's e2m1 bytes, E8M0 scale bytes and
float32 biases after the layout's inverses (rows un-shuffled, (up, gate) pairs split, scales unswizzled)
against the source's rows of the rank (gpt-oss's interleaved gate_up or the halves), the padding (weights and
biases 0, scale bytes the manifest's ``scale_pad``) and the down bias on TP rank 0 only; then stage-wise GEMMs
on sampled experts (BF16 input, the stored weights decoded against the source's dequantized)."""

from __future__ import annotations

import numpy as np

from mocli.errors import CorruptFileError
from mocli.formats.manifest import ModuleEntry
from mocli.kinds import ModuleKind
from mocli.numerics.in_numpy import unpack_e2m1
from mocli.schemes.mxfp4 import BIAS
from mocli.tables import WEIGHT, WEIGHT_SCALE
from mocli.targets import mxfp4_decode as dec
from mocli.targets.decode import LayoutError
from mocli.verify.expect import bit_equal
from mocli.verify.kinds.context import CheckContext
from mocli.verify.kinds.moe import MoeCase, check_moe
from mocli.verify.results import CPU_SAMPLE_EXPERTS, Problems, Stages, pick_experts, rel_error, rng
from mocli.verify.source import floats

LABEL = "emulated MXFP4 MoE (decoded layout, BF16 activations, exact products)"


def dequant(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """e2m1 [N, K/2] times E8M0 [N, K/32] -> float32 [N, K] (each block of 32 scaled in place: no [N, K] scale)."""
    v = unpack_e2m1(np.ascontiguousarray(codes))
    n, k = v.shape
    blocks = v.reshape(n, k // 32, 32)
    blocks *= np.exp2(scales.astype(np.float32) - 127.0)[..., None]
    return v


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 rounded to BF16 (nearest even), as float32."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).view(np.float32)


class Mxfp4Moe(MoeCase):
    kind = ModuleKind.MXFP4_MOE

    def __init__(self, name: str, ctx: CheckContext) -> None:
        super().__init__(name, ctx)
        self.opts, self.tp = ctx.opts, ctx.tp
        self.x = bf16(rng(ctx.opts.seed, name).standard_normal((ctx.opts.tokens, self.layer.hidden), dtype=np.float32))

    def load(self, ck):
        return ck.module_arrays(self.name)

    def consistency(self, mod, experts, problems: Problems) -> None:
        hp, i_full = -(-mod.hidden // 256) * 256, self.layer.intermediate
        # vLLM pads I / tp (the gpt-oss loaders' uneven rows fit in it); expert parallel: all of I
        ip = -(-(i_full if mod.intermediate == i_full else i_full // self.tp) // 128) * 128
        if (mod.padded_intermediate, mod.padded_hidden) != (ip, hp):
            problems.append(f"padded (I, H) are {(mod.padded_intermediate, mod.padded_hidden)}, trtllm pads to {(ip, hp)}")

    # --- bytes ---------------------------------------------------------------------------------------

    errors = (LayoutError, CorruptFileError, ValueError)
    bytes_threads = "mocli-verify-mxfp4-bytes"

    def expert_bytes(self, mod, i_slice):
        def one(local: int, ex, found: Problems) -> None:
            got, want = self.decoded_parts(mod, local), self.expected_parts(ex, i_slice, mod)
            for role, parts in want.items():
                if len(got[role]) != len(parts) or not all(g.size == w.size and bit_equal(g, w.reshape(g.shape))
                                                           for g, w in zip(got[role], parts, strict=True)):
                    found.append(f"{role} (expert {ex.index}) differs from the source")

        return one

    def decoded(self, mod, local: int) -> dict[str, np.ndarray]:
        """Expert ``local``'s stored tensors in logical order, padding checked and cut: ``w13_*`` as [up; gate]."""
        return {k: np.concatenate([p.reshape(-1, *p.shape[-1:]) if p.ndim > 2 else p for p in v]) if len(v) > 1
                else np.ascontiguousarray(v[0].reshape(-1, v[0].shape[-1]) if v[0].ndim > 2 else v[0])
                for k, v in self.decoded_parts(mod, local).items()}

    def decoded_parts(self, mod, local: int) -> dict[str, list[np.ndarray]]:
        """``decoded``'s tensors as the views they are cut from, padding checked: ``w13_*`` as [up, gate] (the
        pairs' rows), ``w2_*`` as [rows]. A weight whose kept rows fill whole groups is a view of the stored
        bytes ([rows / r, 8, r, cols], ``dec.row_parts``: a part's leading dims read in order are its rows);
        any other tensor is copied once (its rows un-shuffled) and cut by views of that copy."""
        i, h, pad = mod.intermediate, mod.hidden, mod.scale_pad
        out = {}
        for which, keep, half in (("w13", i, h), ("w2", h, i)):
            stored = getattr(mod, f"{which}_weight")[local]
            views = weight_views(stored, keep, half // 2, which == "w13", f"{mod.name}.{which}_weight (expert {local})")
            if views is not None:
                out[f"{which}_weight"], w = views, None
            else:
                w = dec.rows(np.ascontiguousarray(stored))
            s = dec.scale_rows(np.ascontiguousarray(getattr(mod, f"{which}_weight_scale")[local]),
                               f"{mod.name}.{which}_weight_scale[{local}]")
            b = getattr(mod, f"{which}_bias")
            b = None if b is None else dec.rows(np.ascontiguousarray(b[local]))
            for name, p, cols, fill in ((f"{which}_weight", w, half // 2, 0), (f"{which}_weight_scale", s, half // 32, pad),
                                        (f"{which}_bias", b, None, 0)):
                if p is None:
                    continue
                out[name] = [_cut(q, keep, cols, fill, f"{mod.name}.{name} (expert {local})")
                             for q in (dec.pairs(p) if which == "w13" else (p,))]
        return out

    def expected(self, ex, i_slice: tuple[int, int], mod) -> dict[str, np.ndarray]:
        """The source's bytes for one expert of the rank, in the decoded order ([up; gate] rows of the slice)."""
        return {k: np.concatenate(v) for k, v in self.expected_parts(ex, i_slice, mod).items()}

    def expected_parts(self, ex, i_slice: tuple[int, int], mod) -> dict[str, list[np.ndarray]]:
        """``expected`` as views of the source: ``w13_*`` as [up rows, gate rows] of the slice, ``w2_*`` as [rows]."""
        (i0, i1), arr = i_slice, self.src.reader.array
        out = {}
        for role, name in ((WEIGHT, "weight"), (WEIGHT_SCALE, "weight_scale"), (BIAS, "bias")):
            if ex.gate_up is not None:
                if role not in ex.gate_up.tensors:
                    continue
                e = ex.gate_up.tensors[role]
                a = _values(arr(e), e.dtype, role)
                up, gate = a[2 * i0 + 1:2 * i1:2], a[2 * i0:2 * i1:2]
            else:
                if role not in ex.up.tensors:
                    continue
                up, gate = (_values(arr(m.tensors[role]), m.tensors[role].dtype, role)[i0:i1] for m in (ex.up, ex.gate))
            out[f"w13_{name}"] = [up, gate]
            d = ex.down.tensors.get(role)
            if d is not None:
                a = _values(arr(d), d.dtype, role)
                per = {WEIGHT: 2, WEIGHT_SCALE: 32}.get(role)
                # the down bias: TP rank 0's (the rank whose rows start I), zeros elsewhere (SEMANTICS §19.3)
                out[f"w2_{name}"] = [a[:, i0 // per:i1 // per] if per else (a if i0 == 0 else np.zeros_like(a))]
        return out

    # --- numbers -------------------------------------------------------------------------------------

    def numbers(self, ck, mod, off: int, i_slice: tuple[int, int]):
        i0, i1 = i_slice
        sample = pick_experts(mod.experts, CPU_SAMPLE_EXPERTS, self.opts.seed, mod.name)
        stages = Stages(len(sample))
        for local in sample:
            ex, got = self.layer.experts[off + local], self.decoded(mod, local)
            src = self.expected(ex, i_slice, mod)
            o1 = self.x @ dequant(got["w13_weight"], got["w13_weight_scale"]).T
            ref1 = self.x @ dequant(src["w13_weight"], src["w13_weight_scale"]).T
            if "w13_bias" in got:
                o1, ref1 = o1 + got["w13_bias"], ref1 + src["w13_bias"]
            h = bf16(np.maximum(o1[:, :i1 - i0], 0.0))  # any fixed intermediate: GEMM2 is checked on its own
            o2, ref2 = h @ dequant(got["w2_weight"], got["w2_weight_scale"]).T, h @ dequant(src["w2_weight"], src["w2_weight_scale"]).T
            if "w2_bias" in got:
                o2, ref2 = o2 + got["w2_bias"], ref2 + src["w2_bias"]
            stages.add("gemm1", rel_error(o1, ref1), self.limits.kept)
            stages.add("gemm2", rel_error(o2, ref2), self.limits.gemm2)
        return LABEL, True, stages.errors, stages.result(), None


def weight_views(stored: np.ndarray, keep: int, cols: int, paired: bool, what: str) -> list[np.ndarray] | None:
    """One expert's kept weight rows (``keep`` of each part, ``cols`` bytes) as views of the stored bytes, the
    padding checked (``dec.row_parts``: [keep / r, 8, r, cols] a part); None where ``keep`` does not fill whole
    groups of 8r rows (the caller copies the rows un-shuffled instead)."""
    per = 16 if paired else 32  # rows per index of a part's first dim
    if keep % per or stored.ndim != 2 or stored.shape[0] % 32:
        return None
    return [_cut(q, keep // per, cols, 0, what) for q in dec.row_parts(stored, paired)]


def _cut(p: np.ndarray, rows: int, cols: int | None, fill: int, what: str) -> np.ndarray:
    """The first ``rows`` rows (and ``cols`` columns) of ``p`` as a view (``rows`` counts ``p``'s first dim,
    ``cols`` its last); raises LayoutError unless every other element is ``fill``. Slices, not a mask: a mask as large as the tensor cost verify most of its time."""
    pads = [p[rows:]] if cols is None else [p[rows:], p[:rows, ..., cols:]]
    if any(bool((x != fill).any()) for x in pads if x.size):
        raise LayoutError(f"{what}: padding is not {fill}")
    return p[:rows] if cols is None else p[:rows, ..., :cols]


def _values(a: np.ndarray, dtype: str, role: str) -> np.ndarray:
    """Weights and scales as their bytes [rows, cols]; a bias as float32 (exact from BF16)."""
    return floats(a, dtype).astype(np.float32) if role == BIAS else a.view(np.uint8).reshape(a.shape[0], -1)


def check(name: str, infos: dict[int, ModuleEntry], ctx: CheckContext):
    return check_moe(name, infos, ctx, Mxfp4Moe)
