"""A stored quantization scheme, as data: what a module stored in it holds, and how it slices.

One module per scheme in this package (gguf-py keeps one class per quantization type; mocli's
targets are one module each too). What the rest of mocli asks of a scheme is here: the weight's
dtype and packing, each scale's dtype and shape rule, how many weight rows and columns one scale
entry covers (so per-rank granularity follows), which scale engines merge across fused shards and
how, and which codes of its 1-byte tensors are NaN. Names are the canonical roles (ModelOpt's
tensor suffixes, ``mocli.tables``); an input format that spells them otherwise is a ``Spelling``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from mocli.quant_config import Algo
from mocli.tables import INPUT_SCALE, WEIGHT

if TYPE_CHECKING:
    from mocli.io.safetensors_file import TensorEntry

Shape = tuple[int, ...]


class Merge(StrEnum):
    """How engines make one scale of the shards they fuse (q/k/v, gate/up, an expert's w1/w3)."""

    NONE = "none"  # nothing to merge (per-channel or per-block scales concatenate)
    REQUANTIZE = "requantize"  # one max scale, the other shards' weights requantized to it (SEMANTICS §3)
    RESCALE = "rescale"  # one max global scale, the other shards' block scales rescaled (SEMANTICS §6)


@dataclass(frozen=True)
class ScaleSpec:
    """One scale tensor of a module stored in the scheme (SEMANTICS §1's table)."""

    suffix: str  # canonical role
    dtype: str  # safetensors dtype, as ModelOpt writes it
    shape: Callable[[int, int], Shape]  # the module's logical (N, K) -> the shape ModelOpt writes
    # other shapes engines read as the same tensor ([N] and [N, 1] per channel; [N/128, 1, K/128, 1] and
    # [N/128, K/128] per block)
    also: Callable[[int, int], tuple[Shape, ...]] = lambda n, k: ()
    activation: bool = False  # a static activation scale: absent where activations are dynamic


@dataclass(frozen=True, repr=False)
class Scheme:
    algo: Algo
    weight_dtype: str
    scales: tuple[ScaleSpec, ...]
    pack: int = 1  # logical values per stored weight element along K (NVFP4: two e2m1 per byte)
    # weight rows / columns one entry of ``weight_scale`` covers: 0 = all of them (per tensor);
    # a rank's slice must hold whole entries
    scale_rows: int = 0
    scale_cols: int = 0
    merge: Merge = Merge.NONE
    merged_scale: str | None = None  # the per-tensor scale engines merge (``merge``)
    group_size: int | None = None  # the config's ``group_size`` for it (hf_quant_config.json, quantized_layers)
    # the scheme whose stored tensors this one's are (less the ones it lacks): a module detected as that
    # one is bound to this one where its configured algorithm says so (W4A16_NVFP4 is NVFP4's weights)
    stores_like: Algo | None = None
    # NaN codes of 1-byte tensors beyond their dtype's own (deep scan, convert): suffix -> codes
    nan_codes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    detect: Callable[[dict[str, TensorEntry]], bool] = lambda tensors: False
    # tensors a module may carry beyond ``scales`` (NVFP4_AWQ's pre_quant_scale, where the export could not
    # fold it): checked where present, dtypes any of the listed
    optional: tuple[tuple[str, tuple[str, ...], Callable[[int, int], Shape]], ...] = ()
    # one line for a person: what is stored (mocli convert --help, README's tables)
    summary: str = ""

    def __str__(self) -> str:
        return self.algo.value

    def __repr__(self) -> str:
        return f"Scheme({self.algo.value})"

    @property
    def name(self) -> str:
        return self.algo.value

    def logical(self, weight_shape: Shape) -> tuple[int, int]:
        """(N, K) of a stored [N, K / pack] weight."""
        n, k = weight_shape
        return n, k * self.pack

    def expected(self, n: int, k: int, dynamic: bool = False) -> dict[str, tuple[str, Shape]]:
        """suffix -> (dtype, shape) of every scale a module of logical [N, K] must have (``dynamic``:
        activations quantized at run time, so no static activation scale)."""
        return {s.suffix: (s.dtype, s.shape(n, k)) for s in self.scales if not (dynamic and s.activation)}

    def same_shape(self, suffix: str, got: Shape, n: int, k: int) -> bool:
        """Whether ``got`` is a shape engines read as the scale ``suffix`` of a [N, K] module."""
        spec = next(s for s in self.scales if s.suffix == suffix)
        return tuple(got) == spec.shape(n, k) or tuple(got) in spec.also(n, k)

    def rows_split(self, rows: int) -> bool:
        """Whether ``rows`` output rows (a rank's slice) hold whole scale entries."""
        return self.scale_rows <= 1 or rows % self.scale_rows == 0

    def cols_split(self, cols: int) -> bool:
        """Whether ``cols`` input columns (a rank's slice) hold whole scale entries."""
        return self.scale_cols <= 1 or cols % self.scale_cols == 0

    @property
    def static_input(self) -> bool:
        return any(s.activation for s in self.scales)

    def optional_spec(self, suffix: str) -> tuple[tuple[str, ...], Callable[[int, int], Shape]] | None:
        """(dtypes, shape rule) of an optional tensor ``suffix`` (None: the scheme has no such tensor)."""
        return next(((dtypes, shape) for s, dtypes, shape in self.optional if s == suffix), None)

    def nan_codes_of(self, suffix: str) -> tuple[int, ...]:
        return dict(self.nan_codes).get(suffix, ())


def distinct(schemes: Iterable[Scheme | None]) -> list[Scheme | None]:
    """The schemes once each, in first-seen order, told apart by identity: a Scheme hashes by walking all its
    fields, and a large checkpoint holds ~24k modules of a handful of scheme objects."""
    return list({id(s): s for s in schemes}.values())


def scalar(n: int, k: int) -> Shape:
    return ()


INPUT = ScaleSpec(INPUT_SCALE, "F32", scalar, activation=True)


def weight_is(tensors: dict[str, TensorEntry], dtype: str) -> bool:
    w = tensors.get(WEIGHT)
    return w is not None and w.dtype == dtype
