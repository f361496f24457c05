"""Group a checkpoint's tensors into modules, fused groups, MoE layers and KV-cache scales.

Works from headers only: one pass over the tensor names, tables from ``mocli.tables``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from mocli.io.bulk import paused_gc
from mocli.io.safetensors_file import TensorEntry
from mocli.quant_config import Algo
from mocli.schemes import MODELOPT, Scheme, Spelling, bind, detect, distinct
from mocli.tables import (
    EXPERT_NAMINGS,
    FUSED_GROUPS,
    KV_SUFFIXES,
    NON_LINEAR_NAMES,
    SHARD_TO_FUSED,
    WEIGHT,
    ExpertNaming,
)

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# An expert is ``<layer>.<e>.<proj>``: a layer name ending in ``.<container>``, a decimal index, a projection
# name (``_match_expert``: string methods, ~24k names of a large MoE checkpoint)
_CONTAINERS = tuple((n, f".{n.container}") for n in EXPERT_NAMINGS)
# per naming, its projection names -> Expert's slots
_PROJ = {n.style: {n.gate: "gate", n.up: "up", n.down: "down", n.gate_up or "-": "gate_up"} for n in EXPERT_NAMINGS}


class Kind(StrEnum):
    LINEAR = "linear"
    FUSED_SHARD = "fused shard"
    EXPERT = "expert"
    EMBEDDING = "embedding/lm_head"
    OTHER = "other"  # norms, biases-only, anything without a 2-D weight


@dataclass
class Module:
    name: str
    tensors: dict[str, TensorEntry]  # by canonical suffix (``mocli.schemes.Spelling``)
    kind: Kind = Kind.OTHER
    scheme: Scheme | None = None  # the scheme it is stored in (``mocli.schemes.detect``); None: unquantized
    engine_name: str = ""  # the prefix the engine uses for this module (fused / MoE name)

    @property
    def weight(self) -> TensorEntry | None:
        return self.tensors.get(WEIGHT)

    @property
    def out_in(self) -> tuple[int, int] | None:
        """Logical (N, K) of the weight; NVFP4 packs two values per byte along K."""
        w = self.weight
        if w is None or len(w.shape) != 2:
            return None
        return self.scheme.logical(w.shape) if self.scheme is not None else tuple(w.shape)

    @property
    def is_linear(self) -> bool:
        return self.kind in (Kind.LINEAR, Kind.FUSED_SHARD, Kind.EXPERT)


@dataclass
class FusedGroup:
    name: str  # engine name, e.g. model.layers.0.self_attn.qkv_proj
    fused: str  # qkv_proj | gate_up_proj
    shards: list[Module]  # present shards, in FUSED_GROUPS order
    missing: list[str]


@dataclass
class Expert:
    index: int
    gate: Module | None = None
    up: Module | None = None
    down: Module | None = None
    gate_up: Module | None = None  # gate and up in one tensor, rows interleaved (gpt-oss, ``ExpertNaming.gate_up``)

    def projections(self) -> list[tuple[str, Module | None]]:
        if self.gate_up is not None:
            return [("gate_up", self.gate_up), ("down", self.down)]
        return [("gate", self.gate), ("up", self.up), ("down", self.down)]


@dataclass
class MoELayer:
    name: str  # engine FusedMoE prefix, e.g. model.layers.0.mlp.experts
    naming: ExpertNaming
    experts: dict[int, Expert] = field(default_factory=dict)

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    def _first(self, proj: str) -> Module | None:
        for e in sorted(self.experts):
            m = getattr(self.experts[e], proj)
            if m is not None and m.out_in:
                return m
        return None

    @property
    def interleaved(self) -> bool:
        """gate and up rows interleaved in one tensor per expert (gpt-oss, SEMANTICS §19.2)."""
        return any(e.gate_up is not None for e in self.experts.values())

    @property
    def intermediate(self) -> int | None:
        if self.interleaved:
            m = self._first("gate_up")
            return m.out_in[0] // 2 if m else None
        m = self._first("gate")
        return m.out_in[0] if m else None

    @property
    def hidden(self) -> int | None:
        m = self._first("gate_up" if self.interleaved else "gate")
        return m.out_in[1] if m else None

    @property
    def schemes(self) -> set[Scheme | None]:
        # distinct objects first (``distinct``): a layer holds ~400 modules of one or two
        return set(distinct(m.scheme for e in self.experts.values() for _, m in e.projections() if m is not None))


@dataclass
class Census:
    modules: dict[str, Module]
    fused: list[FusedGroup]
    moe: list[MoELayer]
    kv_scales: list[TensorEntry]
    num_layers: int
    spelling: Spelling = MODELOPT

    def linears(self) -> list[Module]:
        return [m for m in self.modules.values() if m.is_linear]

    def dense_units(self) -> list[tuple[str, list[Module], Scheme]]:
        """Every quantized dense module as an engine builds it, with its scheme: a fused group whose
        shards share one stored scheme (whole), and every other quantized linear alone."""
        out = []
        for g in self.fused:
            schemes = {m.scheme for m in g.shards}
            if len(schemes) == 1 and None not in schemes:
                out.append((g.name, list(g.shards), schemes.pop()))
        out += [(m.name, [m], m.scheme) for m in self.modules.values() if m.scheme is not None and m.kind is Kind.LINEAR]
        return out

    def moe_units(self) -> list[tuple[MoELayer, Scheme]]:
        """Every MoE layer whose experts share one stored scheme, with it."""
        return [(layer, next(iter(schemes))) for layer, schemes in ((m, m.schemes) for m in self.moe)
                if len(schemes) == 1 and None not in schemes]

    def kind_table(self) -> list[dict]:
        """Rows of (kind, modules, quantized, by scheme) for inspect."""
        # counted in C by (kind, scheme identity): a Scheme hashes by walking its fields, and str() of each of
        # ~24k modules' schemes cost more than the count
        schemes = {id(m.scheme): m.scheme for m in self.modules.values()}
        rows: dict[Kind, Counter] = {}
        for (kind, scheme), n in Counter((m.kind, id(m.scheme)) for m in self.modules.values()).items():
            c = rows.setdefault(kind, Counter())
            c["modules"] += n
            c[str(schemes[scheme]) if schemes[scheme] else "unquantized"] += n
        return [{"kind": str(k), **dict(c)} for k, c in sorted(rows.items(), key=lambda kv: list(Kind).index(kv[0]))]


def build_census(tensors: dict[str, TensorEntry], spelling: Spelling = MODELOPT,
                 configured: Callable[[str], Algo | None] | None = None) -> Census:
    """Modules by name (their tensors under the canonical suffixes ``spelling`` maps the file's to),
    each bound to the scheme it is stored in (``configured``: a module's algorithm by the config, for the
    schemes that store their tensors like another: ``mocli.schemes.bind``); fused groups, MoE layers,
    KV-cache scales. ``Checkpoint.census`` passes the checkpoint's own config."""
    with paused_gc():
        return _build(tensors, spelling, configured)


def _group(tensors: dict[str, TensorEntry], spelling: Spelling) -> tuple[dict[str, dict[str, TensorEntry]],
                                                                          list[TensorEntry], set[str], int]:
    """(module -> canonical suffix -> entry, KV-cache scales, modules holding them, number of layers)."""
    by_module: dict[str, dict[str, TensorEntry]] = {}
    kv_scales: list[TensorEntry] = []
    kv_modules: set[str] = set()
    canonical = spelling.canonical if spelling.suffixes else None
    for name, entry in tensors.items():
        module, _, suffix = name.rpartition(".")
        if suffix in KV_SUFFIXES:
            kv_scales.append(entry)
            kv_modules.add(module)
        by_module.setdefault(module, {})[canonical(suffix) if canonical else suffix] = entry
    if spelling.expand is not None:  # tensors that hold several modules each (gpt-oss's experts)
        by_module = spelling.expand(by_module)
    layers = {int(m.group(1)) for module in by_module if (m := _LAYER.search(module + "."))}  # once per module
    return by_module, kv_scales, kv_modules, len(layers)


def _build(tensors: dict[str, TensorEntry], spelling: Spelling, configured) -> Census:
    by_module, kv_scales, kv_modules, num_layers = _group(tensors, spelling)
    modules: dict[str, Module] = {}
    moe: dict[str, MoELayer] = {}
    fused: dict[str, FusedGroup] = {}
    for name, ts in by_module.items():
        mod = Module(name, {s: e for s, e in ts.items() if s not in KV_SUFFIXES} if name in kv_modules else ts)
        if not mod.tensors:  # a module holding only KV-cache scales is not a module of its own
            continue
        mod.scheme = detect(mod.tensors)
        mod.engine_name = name
        modules[name] = mod
        _place(mod, moe, fused)
        if configured is not None and mod.scheme is not None:
            # MIXED_PRECISION lists MoE layers by their container name (ModelOpt 0.47)
            mod.scheme = bind(mod.scheme, configured(mod.name) or configured(mod.engine_name))
    _complete_fused(fused, modules)
    return Census(
        modules=modules,
        fused=sorted(fused.values(), key=lambda g: _natural(g.name)),
        moe=sorted(moe.values(), key=lambda m: _natural(m.name)),
        kv_scales=sorted(kv_scales, key=lambda e: _natural(e.name)),
        num_layers=num_layers,
        spelling=spelling,
    )


def _place(mod: Module, moe: dict[str, MoELayer], fused: dict[str, FusedGroup]) -> None:
    """The module's kind, and its slot in an MoE layer or a fused group."""
    w, name = mod.weight, mod.name
    last = name.rpartition(".")[2]
    if w is None or (len(w.shape) != 2):
        mod.kind = Kind.OTHER
        return
    if last in NON_LINEAR_NAMES:
        mod.kind = Kind.EMBEDDING
        return
    expert = _match_expert(name)
    if expert is not None:
        naming, layer, index, proj = expert
        mod.kind = Kind.EXPERT
        mod.engine_name = layer
        moe_layer = moe.get(layer)  # made once per layer and expert, not once per module
        if moe_layer is None:
            moe_layer = moe[layer] = MoELayer(layer, naming)
        slot = moe_layer.experts.get(index)
        if slot is None:
            slot = moe_layer.experts[index] = Expert(index)
        setattr(slot, proj, mod)
        return
    if last in SHARD_TO_FUSED:
        parent = name.rpartition(".")[0]
        fused_name = f"{parent}.{SHARD_TO_FUSED[last]}"
        mod.kind = Kind.FUSED_SHARD
        mod.engine_name = fused_name
        fused.setdefault(fused_name, FusedGroup(fused_name, SHARD_TO_FUSED[last], [], []))
        return
    mod.kind = Kind.LINEAR


def _complete_fused(fused: dict[str, FusedGroup], modules: dict[str, Module]) -> None:
    """Each group's present and missing shards, in FUSED_GROUPS order; a lone shard is a linear."""
    for group in fused.values():
        parent = group.name.rpartition(".")[0]
        for shard in FUSED_GROUPS[group.fused]:
            m = modules.get(f"{parent}.{shard}")
            if m is not None and m.kind is Kind.FUSED_SHARD:
                group.shards.append(m)
            else:
                group.missing.append(shard)
    # A lone shard (e.g. gate_proj with no up_proj) is an ordinary linear to the engine.
    for key in [k for k, g in fused.items() if len(g.shards) < 2]:
        for m in fused.pop(key).shards:
            m.kind, m.engine_name = Kind.LINEAR, m.name


def _match_expert(name: str) -> tuple[ExpertNaming, str, int, str] | None:
    r"""(naming, layer, index, slot) where ``name`` is ``<layer>.<e>.<proj>``, ``<layer>`` ending in
    ``.<container>``, ``<e>`` decimal digits and ``<proj>`` a projection of that naming; the first naming
    that takes it. What the regex ``^(.*\.<container>)\.(\d+)\.([^.]+)$`` matches, the projection then
    looked up (tests/test_census.py holds that regex against this)."""
    rest, _, proj = name.rpartition(".")
    layer, _, e = rest.rpartition(".")
    if not e.isdecimal() or not proj or "\n" in layer:  # \d is isdecimal; the regex's ``.`` takes no newline
        return None
    for naming, container in _CONTAINERS:
        if layer.endswith(container):
            slot = _PROJ[naming.style].get(proj)
            if slot is not None:
                return naming, layer, int(e), slot
    return None


def _natural(name: str) -> list:
    """Sort key that orders layers.2 before layers.10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
