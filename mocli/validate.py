"""``mocli validate``: config, exclusions, tensor census, scale health, target and per-rank constraints.

Reads headers, plus the small float32 scale tensors (0-dim, per-channel, per-block) for scale health;
``deep`` also scans every weight and block-scale byte for NaN/Inf codes at disk speed. No torch
here: validate starts in a fraction of a second. Never prints; returns a report the CLI renders.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mocli.census import Census, Kind, Module, MoELayer, build_census
from mocli.checkpoint import Checkpoint
from mocli.exclusions import PartialFusedExclusion, is_excluded, pattern_reports
from mocli.findings import Findings
from mocli.parallel import HEAD_SPLIT, Heads, ParallelLayout, Split, rank_slices, split_of
from mocli.quant_config import Algo, QuantConfig
from mocli.scales import read_scales
from mocli.tables import INPUT_SCALE, SCALE_SUFFIXES, WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2
from mocli.targets import Target, layout_of

# Requantizing an FP8 shard to a max scale this many times larger pushes its small values three
# binades down, into e4m3's subnormal range, where they lose mantissa bits (SEMANTICS §3).
SCALE_SPREAD_WARN = 8.0


@dataclass
class ValidationReport:
    findings: Findings
    census: Census
    stats: dict[str, Any] = field(default_factory=dict)

    ignored: int = 0  # findings --select/--ignore left out
    warnings_as_errors: bool = False

    @property
    def ok(self) -> bool:
        return not self.findings.errors and not (self.warnings_as_errors and self.findings.warnings)

    def filter(self, select: list[str], ignore: list[str]) -> None:
        """Keep the findings whose code starts with a ``select`` entry (all when empty) and with no
        ``ignore`` entry (ruff's --select/--ignore)."""
        sel = [c.upper() for c in select]
        ign = [c.upper() for c in ignore]
        kept = [f for f in self.findings if (not sel or f.code.startswith(tuple(sel))) and not f.code.startswith(tuple(ign))]
        self.ignored += len(self.findings) - len(kept)
        self.findings[:] = kept

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "errors": len(self.findings.errors),
            "warnings": len(self.findings.warnings),
            "ignored": self.ignored,
            "findings": [f.to_dict() for f in self.findings],
            "stats": self.stats,
        }


def validate(ckpt: Checkpoint, target: Target | None = None, census: Census | None = None,
             scales: dict[str, np.ndarray] | None = None, parallel: ParallelLayout | None = None,
             deep: bool = False, progress: Any = None) -> ValidationReport:
    """All checks; ``census``/``scales`` may be passed in when the caller already has them."""
    findings = Findings(ckpt.config_findings)
    census = census or build_census(ckpt.tensors)
    report = ValidationReport(findings, census)
    quant = ckpt.quant
    if quant is None or quant.algo is None:
        return report  # CFG00x already says why; nothing else can be judged
    parallel = parallel or ParallelLayout()
    declared = _declared_quantized(quant, census, findings)
    _check_mixed_layers(quant, census, findings)
    _check_exclusions(quant, census, declared, findings)
    _check_tensors(quant, census, declared, findings)
    scales = scales if scales is not None else read_scales(census)
    report.stats["scales"] = _check_scales(scales, census, findings)
    report.stats["scale_names"] = list(scales) if deep else []
    sliceable = _check_parallel(parallel, Heads.from_config(ckpt.config), census, findings)
    if target is not None:
        _check_target(target, parallel, Heads.from_config(ckpt.config), census, sliceable, findings)
    if deep:
        from mocli.deep_scan import scan

        report.stats["deep"] = scan(ckpt, findings, skip=set(report.stats.get("scale_names", ())), progress=progress)
    return report


# --- exclusions -----------------------------------------------------------------------------------

def _declared_quantized(quant: QuantConfig, census: Census, findings: Findings) -> dict[str, bool | None]:
    """engine prefix -> will the engine quantize it? None where the engine would refuse (partial fused)."""
    out: dict[str, bool | None] = {}
    for m in census.modules.values():
        if not m.is_linear or m.engine_name in out:
            continue
        try:
            excluded = is_excluded(m.engine_name, quant.exclude_modules, quant.method)
        except PartialFusedExclusion as e:
            findings.add("EXC002", e.prefix,
                         f"exclude_modules lists {', '.join(e.excluded)} but not {', '.join(e.kept)}",
                         hint="the engine refuses this ('some but not all shards excluded'): exclude all shards or none")
            out[m.engine_name] = None
            continue
        out[m.engine_name] = not excluded and quant.algo_for(m.name) is not None
    return out


def _check_mixed_layers(quant: QuantConfig, census: Census, findings: Findings) -> None:
    for module in quant.quantized_layers:
        if module not in census.modules:
            findings.add("CFG006", f"quantized_layers.{module}", "no such module in the checkpoint",
                         hint="module names must match the checkpoint's tensor prefixes")


def _check_exclusions(quant: QuantConfig, census: Census, declared: dict[str, bool | None],
                      findings: Findings) -> None:
    for r in pattern_reports(quant.exclude_modules, census, quant.method):
        loc = f"exclude_modules: {r.pattern}"
        if r.vlm_alias:
            findings.add("EXC006", loc, f"matches nothing, but {r.vlm_alias!r} would",
                         hint="the VLM prefix differs between exporter and engine; use the engine's spelling")
        elif not r.matches and not r.partial:
            hint = ("it matches checkpoint names " + ", ".join(r.checkpoint_matches[:3]) +
                    " but the engine asks for fused/MoE names (qkv_proj, gate_up_proj, …experts)"
                    if r.checkpoint_matches else "check the spelling against the tensor names")
            findings.add("EXC001", loc, "pattern matches no module", hint=hint)
        if r.after_rewrite_lost:
            findings.add("EXC005", loc,
                         f"after the engine's p* -> p, p.* rewrite it no longer matches {_few(r.after_rewrite_lost)}",
                         hint=f"write it as {r.pattern[:-1]}.* or list the modules explicitly")

    # Stored state against the declaration, one finding per engine prefix.
    by_engine: dict[str, list[Module]] = {}
    for m in census.linears():
        by_engine.setdefault(m.engine_name, []).append(m)
    for prefix, mods in by_engine.items():
        stored_q = [m for m in mods if m.scheme is not None]
        stored_u = [m for m in mods if m.scheme is None]
        if stored_q and stored_u and mods[0].kind is Kind.FUSED_SHARD:
            findings.add("EXC002", prefix,
                         f"shards stored unquantized: {_few([m.name.rpartition('.')[2] for m in stored_u])}; "
                         f"quantized: {_few([m.name.rpartition('.')[2] for m in stored_q])}",
                         hint="the engine loads a fused group in one scheme; quantize or exclude all shards")
            continue
        want = declared.get(prefix)
        if want is None:
            continue
        if not want and stored_q:
            findings.add("EXC003", prefix, f"excluded by the config but {len(stored_q)} module(s) are stored "
                         f"quantized ({_few([m.name for m in stored_q])})",
                         hint="the engine will load quantized bytes as BF16; fix exclude_modules")
        elif want and stored_u:
            findings.add("EXC004", prefix, f"not excluded but {len(stored_u)} module(s) are stored unquantized "
                         f"({_few([m.name for m in stored_u])})",
                         hint="add it to exclude_modules (and config.json ignore)")


# --- tensors --------------------------------------------------------------------------------------

def _expected(scheme: Algo, w_shape: tuple[int, ...], dynamic: bool = False) -> dict[str, tuple[str, tuple[int, ...] | None]]:
    """suffix -> (dtype, shape) a module stored in ``scheme`` must have (SEMANTICS §1 table, §12)."""
    n, k = w_shape
    if scheme is Algo.FP8:
        # fp8 with dynamic activations (SEMANTICS §12) quantizes activations per token at run time
        return {WEIGHT_SCALE: ("F32", ())} if dynamic else {WEIGHT_SCALE: ("F32", ()), INPUT_SCALE: ("F32", ())}
    if scheme is Algo.FP8_PER_CHANNEL_PER_TOKEN:
        return {WEIGHT_SCALE: ("F32", (n,))}
    if scheme is Algo.FP8_PB_WO:
        return {WEIGHT_SCALE: ("F32", (n // 128, 1, k // 128, 1))}
    # NVFP4: weight is U8 [N, K/2], so K/16 = w_shape[1] / 8
    return {WEIGHT_SCALE: ("F8_E4M3", (n, k // 8)), WEIGHT_SCALE_2: ("F32", ()), INPUT_SCALE: ("F32", ())}


def _check_tensors(quant: QuantConfig, census: Census, declared: dict[str, bool | None],
                   findings: Findings) -> None:
    no_input_scale: dict[str, list[Module]] = {}  # MoE layer -> experts' projections without one
    static_under_dynamic: list[str] = []
    for m in census.modules.values():
        if m.scheme is None:
            _check_unquantized(m, findings)
            continue
        w = _checked_weight(m, findings)
        if w is None:
            continue
        if quant.dynamic_activations and m.scheme is Algo.FP8 and INPUT_SCALE in m.tensors:
            static_under_dynamic.append(m.name)
        configured = quant.algo_for(m.name)
        if declared.get(m.engine_name) and configured is not None and configured is not m.scheme:
            findings.add("TNS005", m.name, f"stored as {m.scheme} but the config says {configured}",
                         hint="the engine will build the wrong kernel for it")
        missing = _check_scale_tensors(m, w.shape, quant.dynamic_activations, findings)
        if INPUT_SCALE in missing and m.kind is Kind.EXPERT:
            no_input_scale.setdefault(m.engine_name, []).append(m)
    for g in census.fused:
        ks = {m.out_in[1] for m in g.shards if m.out_in}
        if len(ks) > 1:
            findings.add("TNS003", g.name, f"shards have different input sizes {sorted(ks)}",
                         hint="fused shards must share K")
    if static_under_dynamic:
        # vLLM's Fp8LinearMethod builds no input_scale parameter for a dynamic scheme, so loading these
        # tensors fails (convert refuses the file for the same reason).
        findings.add("TNS007", f"{quant.origin}: quantization_config",
                     f"activation_scheme is dynamic but {len(static_under_dynamic)} FP8 module(s) store a static "
                     f"input_scale ({_few(static_under_dynamic, 2)})",
                     hint='set "activation_scheme": "static" (calibrated scales, as a ModelOpt FP8 export has), or '
                          "drop the input_scale tensors to quantize activations per token")
    for layer in census.moe:
        _check_moe_layer(layer, findings)
        _check_expert_input_scales(layer, no_input_scale.get(layer.name, []), findings)


def _check_unquantized(m: Module, findings: Findings) -> None:
    stray = sorted(set(m.tensors) & SCALE_SUFFIXES)
    if stray and m.weight is None:
        # scales without any weight: the weight is missing, not the scales stray
        findings.add("TNS001", m.name, f"has {', '.join(stray)} but no weight",
                     hint="the export is incomplete; re-export the checkpoint")
    elif stray:
        findings.add("TNS004", m.name, f"unquantized (weight {m.weight.dtype}) but has {', '.join(stray)}",
                     hint="drop the scales or store the weight quantized")


def _checked_weight(m: Module, findings: Findings):
    """A quantized module's weight entry when it has the scheme's dtype and a usable shape, else None."""
    w, scheme = m.tensors.get(WEIGHT), m.scheme
    if w is None or len(w.shape) != 2:
        findings.add("TNS001", m.name, "has scales but no 2-D weight",
                     hint="the export is incomplete; re-export the checkpoint")
        return None
    want = "U8" if scheme is Algo.NVFP4 else "F8_E4M3"
    if w.dtype != want:
        findings.add("TNS002", f"{m.name}.weight", f"is {w.dtype}, {scheme} stores {want}",
                     hint="the export is broken; re-export the checkpoint")
        return None
    if 0 in w.shape:
        findings.add("TNS003", f"{m.name}.weight", f"quantized weight {list(w.shape)} has no elements",
                     hint="an empty layer cannot be quantized or served; re-export the checkpoint")
        return None
    return w


def _check_scale_tensors(m: Module, w_shape: tuple[int, ...], dynamic: bool, findings: Findings) -> set[str]:
    """The scheme's scale tensors' dtypes and shapes; returns the suffixes that are missing (an
    expert's missing input_scale is judged per layer, not here)."""
    scheme, missing = m.scheme, set()
    if scheme is Algo.FP8_PB_WO and (w_shape[0] % 128 or w_shape[1] % 128):
        findings.add("TNS003", f"{m.name}.weight", f"shape {list(w_shape)} is not a multiple of 128x128",
                     hint="FP8_PB_WO needs N % 128 == K % 128 == 0")
        return missing
    for suffix, (dtype, shape) in _expected(scheme, w_shape, dynamic).items():
        t = m.tensors.get(suffix)
        if t is None:
            missing.add(suffix)
            if not (suffix == INPUT_SCALE and m.kind is Kind.EXPERT):
                findings.add("TNS001", m.name, f"{scheme} module has no {suffix}",
                             hint="the export is incomplete; re-export the checkpoint")
        elif t.dtype != dtype:
            findings.add("TNS002", t.name, f"is {t.dtype}, {scheme} stores {dtype}",
                         hint="the export is broken; re-export the checkpoint")
        elif shape is not None and t.shape != shape and not _equivalent_shape(scheme, t.shape, shape):
            findings.add("TNS003", t.name, f"shape {list(t.shape)}, expected {list(shape)} for weight "
                         f"{list(w_shape)}", hint="the export is broken; re-export the checkpoint")
    return missing


def _check_expert_input_scales(layer: MoELayer, missing: list[Module], findings: Findings) -> None:
    """SCL003: experts calibration never routed a token to. Repairable from the layer's other experts
    (SEMANTICS §11.2), w1/w3 and w2 separately; where none of them has one, there is nothing to take."""
    if not missing:
        return
    pools = {"gate/up": ("gate", "up"), "down": ("down",)}
    for pool, projs in pools.items():
        mods = [m for e in layer.experts.values() for p in projs if (m := getattr(e, p)) is not None]
        lacking = [m for m in mods if m in missing]
        if not lacking:
            continue
        if not any(INPUT_SCALE in m.tensors for m in mods):
            findings.add("SCL003", layer.name, f"no expert of this layer has a {pool} input_scale",
                         hint="not repairable: there is no calibrated value to take; re-run calibration "
                              "(mocli never invents a scale)")
            continue
        for m in lacking:
            findings.add("SCL003", m.name, "expert has no input_scale",
                         hint="calibration never routed tokens to it; mocli repair fills it in (SEMANTICS §11)")


def _equivalent_shape(scheme: Algo, got: tuple[int, ...], want: tuple[int, ...]) -> bool:
    # Exporters also write per-channel scales as [N, 1] and block scales without the unit dims.
    if scheme is Algo.FP8_PER_CHANNEL_PER_TOKEN:
        return got == (want[0], 1)
    if scheme is Algo.FP8_PB_WO:
        return got == (want[0], want[2])
    return False


def _check_moe_layer(layer: MoELayer, findings: Findings) -> None:
    idx = sorted(layer.experts)
    if idx != list(range(len(idx))):
        missing = sorted(set(range(max(idx) + 1)) - set(idx))
        findings.add("TNS006", layer.name, f"expert indices are not 0..{len(idx) - 1}: missing {_few(missing)}",
                     hint="the export is incomplete; re-export the checkpoint")
    shapes: dict[str, dict[tuple, list[int]]] = {"gate": {}, "up": {}, "down": {}}
    for e in idx:
        for proj, m in layer.experts[e].projections():
            if m is None:
                name = getattr(layer.naming, proj)
                findings.add("TNS006", f"{layer.name}.{e}", f"expert has no {name} projection",
                             hint="the export is incomplete; re-export the checkpoint")
            elif m.out_in:
                shapes[proj].setdefault(m.out_in, []).append(e)
    for proj, by_shape in shapes.items():
        if len(by_shape) > 1:
            common = max(by_shape, key=lambda s: len(by_shape[s]))
            odd = [e for s, es in by_shape.items() if s != common for e in es]
            findings.add("TNS006", layer.name, f"{proj} projections differ in shape: experts {_few(odd)} are not "
                         f"{list(common)}", hint="experts of one layer must share shapes")
    gate, up = shapes["gate"], shapes["up"]
    if len(gate) == 1 and len(up) == 1 and set(gate) != set(up):
        findings.add("TNS006", layer.name, f"gate {list(next(iter(gate)))} and up {list(next(iter(up)))} "
                     "projections differ in shape", hint="gate and up projections must share shapes")


# --- scale health ---------------------------------------------------------------------------------

def _check_scales(values: dict[str, np.ndarray], census: Census, findings: Findings) -> dict[str, Any]:
    """NaN/Inf/non-positive scales, FP8 shard spread, NVFP4 weight_scale_2 mismatch. Returns stats."""
    _check_scale_values(values, findings)
    return _check_merged_scales(values, census, findings)


def _check_scale_values(values: dict[str, np.ndarray], findings: Findings) -> None:
    """SCL001/SCL002: every scale finite and positive."""
    names = list(values)
    if names:
        # One vectorized pass over every scale, then a look at the few arrays that failed it.
        flat = np.concatenate([values[n].reshape(-1) for n in names])
        sizes = np.fromiter((values[n].size for n in names), dtype=np.int64, count=len(names))
        owner = np.repeat(np.arange(len(names)), sizes)
        bad = np.unique(owner[~(np.isfinite(flat) & (flat > 0))])
        for i in bad.tolist():
            v = values[names[i]]
            if not np.isfinite(v).all():
                findings.add("SCL001", names[i], f"contains {'NaN' if np.isnan(v).any() else 'Inf'}",
                             hint="the export is broken; re-run calibration")
            else:
                findings.add("SCL002", names[i], f"has a non-positive value ({float(v.min()):.3g})",
                             hint="dequant scales must be > 0")


def _check_merged_scales(values: dict[str, np.ndarray], census: Census, findings: Findings) -> dict[str, Any]:
    """SCL004/SCL005 over the shards an engine merges into one scale (fused groups, an expert's w1/w3)."""

    def scalar(m: Module | None, suffix: str) -> float | None:
        t = m.tensors.get(suffix) if m else None
        v = values.get(t.name) if t else None
        if v is None or v.size != 1:
            return None
        x = float(v.reshape(-1)[0])
        return x if math.isfinite(x) and x > 0 else None

    # Pairs/groups of shards that the engine merges into one scale.
    groups: list[tuple[str, str, list[Module | None]]] = [
        (g.name, g.fused, list(g.shards)) for g in census.fused
    ]
    for layer in census.moe:
        for e in sorted(layer.experts):
            ex = layer.experts[e]
            groups.append((f"{layer.name}.{e}", "w1/w3", [ex.gate, ex.up]))

    stats: dict[str, Any] = {"fp8_groups": 0, "fp8_max_spread": 1.0,
                             "nvfp4_groups": 0, "nvfp4_scale2_mismatched": 0, "nvfp4_worst_ratio": 1.0}
    spread_findings: dict[str, list[tuple[str, float]]] = {}
    mismatch: dict[str, list[tuple[str, float]]] = {}
    for name, kind, mods in groups:
        schemes = {m.scheme for m in mods if m is not None}
        if len(schemes) != 1:
            continue
        scheme = schemes.pop()
        key = "weight_scale" if scheme is Algo.FP8 else "weight_scale_2" if scheme is Algo.NVFP4 else None
        if key is None:
            continue
        vals = [scalar(m, key) for m in mods]
        if any(v is None for v in vals):
            continue
        ratio = max(vals) / min(vals)
        layer = name.rpartition(".")[0] if kind == "w1/w3" else kind
        if scheme is Algo.FP8:
            stats["fp8_groups"] += 1
            stats["fp8_max_spread"] = max(stats["fp8_max_spread"], ratio)
            if ratio > SCALE_SPREAD_WARN:
                spread_findings.setdefault(layer, []).append((name, ratio))
        else:
            stats["nvfp4_groups"] += 1
            if ratio != 1.0:
                stats["nvfp4_scale2_mismatched"] += 1
                stats["nvfp4_worst_ratio"] = max(stats["nvfp4_worst_ratio"], ratio)
                mismatch.setdefault(layer, []).append((name, ratio))
    for layer, items in spread_findings.items():
        worst = max(items, key=lambda x: x[1])
        findings.add("SCL004", worst[0] if len(items) == 1 else layer,
                     f"{len(items)} {'group' if len(items) == 1 else 'groups'} with weight_scale spread > "
                     f"{SCALE_SPREAD_WARN:g}x, worst {worst[1]:.1f}x ({worst[0]})",
                     hint="requantizing to the max scale will cost the smaller shards precision")
    for layer, items in mismatch.items():
        worst = max(items, key=lambda x: x[1])
        findings.add("SCL005", layer if len(items) > 1 else worst[0],
                     f"{len(items)} {'pair' if len(items) == 1 else 'groups'} with differing weight_scale_2, "
                     f"worst ratio {worst[1]:.3g}x ({worst[0]})",
                     hint="engines keep one value and silently mis-scale the other; mocli repair and convert "
                          "rescale instead (SEMANTICS §7, §11)")
    return stats


# --- tensor / expert parallel (SEMANTICS §10) ------------------------------------------------------

def _dense_units(census: Census) -> list[tuple[str, list[Module], Algo]]:
    """Every quantized dense module as converted: fused groups whole, other linears alone."""
    out = []
    for g in census.fused:
        schemes = {m.scheme for m in g.shards}
        if len(schemes) == 1 and None not in schemes:
            out.append((g.name, list(g.shards), schemes.pop()))
    out += [(m.name, [m], m.scheme) for m in census.modules.values() if m.scheme is not None and m.kind is Kind.LINEAR]
    return [(n, s, a) for n, s, a in out if all(m.out_in for m in s)]


def _check_parallel(par: ParallelLayout, heads: Heads | None, census: Census, findings: Findings) -> set[str]:
    """PAR findings for a tp/ep layout; returns the dense modules that can be sliced (for TGT checks)."""
    dense = _dense_units(census)
    if par.single:
        return {n for n, _, _ in dense}
    at = f"tp {par.tp}" + (f", ep {par.ep}" if par.ep > 1 else "")
    if par.ep > 1 and par.ep % par.tp:
        findings.add("PAR002", "parallel layout", f"ep {par.ep} is not a multiple of tp {par.tp}",
                     hint="expert parallel spans tp x dp ranks (vLLM); choose ep = tp x dp")
    if par.ep > 1 and not any(layer.schemes - {None} for layer in census.moe):
        # ranks beyond tp would be byte copies of the tensor-parallel ones: data parallelism, which
        # engines serve from the tp ranks' files with no per-rank layout of its own
        findings.add("PAR002", "parallel layout", f"--ep {par.ep} splits MoE experts, and this checkpoint has no "
                     "quantized MoE layer", hint=f"convert with --tp {par.tp} alone; data-parallel replicas load "
                     "the same files")
    attention = [m for _, shards, _ in dense for m in shards if m.name.rpartition(".")[2] in HEAD_SPLIT]
    head_fault = _check_heads(par.tp, heads, attention, findings)
    ok: set[str] = set()
    for name, shards, scheme in dense:
        if split_of(shards[0].name) is None:
            findings.add("PAR004", name, f"mocli does not know how engines split '{name.rpartition('.')[2]}' "
                         f"across ranks ({at})", hint="convert at tp 1, or exclude the layer from quantization")
            continue
        faults = _dense_split_faults(par, heads, shards, scheme, head_fault)
        for f in faults:
            if f != "heads":
                findings.add("PAR003", name, f"{f} ({at})", hint="choose a tp that splits this layer evenly")
        if not faults:
            ok.add(name)
    for layer in census.moe:
        _check_moe_split(par, layer, findings)
    return ok


def _check_heads(tp: int, heads: Heads | None, attention: list[Module], findings: Findings) -> bool:
    """PAR001/PAR005: q/k/v split on whole heads (kv heads divided or replicated). True on a fault."""
    if not attention or tp == 1:
        return False
    if heads is None:
        findings.add("PAR005", "config.json", "no num_attention_heads / num_key_value_heads / head_dim",
                     hint="q/k/v are split on whole heads at tp > 1; add the counts to config.json")
        return True
    fault = False
    if heads.heads % tp:
        findings.add("PAR001", "config.json", f"{heads.heads} attention heads do not divide among {tp} ranks",
                     hint="choose a tp that divides num_attention_heads")
        fault = True
    kv = heads.kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        findings.add("PAR001", "config.json", f"{kv} kv heads neither divide among nor replicate evenly over "
                     f"{tp} ranks", hint="tp must divide num_key_value_heads, or be a multiple of it")
        fault = True
    for m in attention:
        want = (heads.heads if HEAD_SPLIT[m.name.rpartition(".")[2]] == "q" else kv) * heads.head_dim
        if m.out_in[0] != want:
            findings.add("PAR005", m.name, f"has {m.out_in[0]} rows but config.json's heads x head_dim "
                         f"says {want}", hint="fix num_attention_heads / num_key_value_heads / head_dim")
            fault = True
    return fault


def _dense_split_faults(par: ParallelLayout, heads: Heads | None, shards: list[Module], scheme: Algo,
                        head_fault: bool) -> list[str]:
    """Why one dense module cannot be split over par.tp ranks ("heads": a PAR001/PAR005 already said)."""
    tp, faults = par.tp, []
    k = shards[0].out_in[1]
    split = split_of(shards[0].name)
    if split is Split.COLUMN:
        for m in shards:
            if m.name.rpartition(".")[2] in HEAD_SPLIT:
                if head_fault:
                    faults.append("heads")
            elif m.out_in[0] % tp:
                faults.append(f"{m.name.rpartition('.')[2]} has {m.out_in[0]} rows, not divisible by tp {tp}")
        if scheme is Algo.FP8_PB_WO and not faults:
            sl = rank_slices(par, heads, shards)[0]
            for m, (a, b) in zip(shards, sl.rows, strict=True):
                if (b - a) % 128:
                    faults.append(f"{m.name.rpartition('.')[2]}: {b - a} rows per rank is not a whole 128-row "
                                  "FP8 block")
    elif split is Split.ROW:
        if k % tp:
            faults.append(f"K = {k} is not divisible by tp {tp}")
        elif scheme is Algo.NVFP4 and (k // tp) % 16:
            faults.append(f"K / tp = {k // tp} is not a whole number of 16-element NVFP4 blocks")
        elif scheme is Algo.FP8_PB_WO and (k // tp) % 128:
            faults.append(f"K / tp = {k // tp} is not a whole 128-column FP8 block")
    return faults


def _check_moe_split(par: ParallelLayout, layer: MoELayer, findings: Findings) -> None:
    """PAR002/PAR003: experts over ep ranks, or I over tp ranks (whole NVFP4 blocks)."""
    if not (layer.schemes - {None}) or layer.intermediate is None:
        return
    if par.ep > 1:
        if layer.num_experts % par.ep:
            findings.add("PAR002", layer.name, f"{layer.num_experts} experts do not divide among {par.ep} "
                         "expert-parallel ranks", hint="choose an ep that divides the number of experts")
        return
    i, tp = layer.intermediate, par.tp
    if i % tp:
        findings.add("PAR003", layer.name, f"intermediate size {i} is not divisible by tp {tp}",
                     hint="choose a tp that divides I, or use --ep")
    elif Algo.NVFP4 in layer.schemes and (i // tp) % 16:
        findings.add("PAR003", layer.name, f"I / tp = {i // tp} is not a whole number of 16-element "
                     "NVFP4 blocks", hint="choose a smaller tp, or use --ep")


# --- target constraints, on each rank's shapes ---------------------------------------------------------

def _check_target(target: Target, par: ParallelLayout, heads: Heads | None, census: Census,
                  sliceable: set[str], findings: Findings) -> None:
    layout = layout_of(target)
    constraints, supported = layout.constraints, layout.supported
    at = "" if par.single else f" per rank at tp {par.tp}" + (f", ep {par.ep}" if par.ep > 1 else "")
    for name, shards, scheme in _dense_units(census):
        if scheme not in supported["linear"]:
            findings.add("TGT002", name, f"{target} does not take {scheme} linears",
                         hint="convert for another target, or re-export in a supported scheme")
            continue
        if name not in sliceable:
            continue
        sl = rank_slices(par, heads, shards)[0]
        for c in constraints:
            if c.scope == "linear" and c.algo is scheme:
                size = sl.n if c.dim == "N" else sl.k
                if size % c.multiple:
                    findings.add("TGT001", name, f"{c.dim} = {size}{at} is not a multiple of {c.multiple}",
                                 hint=c.why)
    for layer in census.moe:
        schemes = layer.schemes - {None}
        if not schemes:
            continue
        if len(schemes) > 1 or None in layer.schemes:
            findings.add("TGT002", layer.name, "experts are stored in mixed schemes "
                         f"({', '.join(sorted(str(s) for s in layer.schemes))})",
                         hint="the fused-MoE kernel takes one scheme per layer; re-export")
            continue
        scheme = schemes.pop()
        if scheme not in supported["moe"]:
            findings.add("TGT002", layer.name, f"{target} has no fused-MoE path for {scheme} experts",
                         hint="convert for another target, or re-export the experts as FP8 or NVFP4")
            continue
        i, h = layer.intermediate, layer.hidden
        if i is None or h is None:
            continue
        i_rank = i if par.expert_parallel or i % par.tp else i // par.tp
        for c in constraints:
            if c.scope == "moe" and c.algo is scheme:
                size = 2 * i_rank if c.dim == "2I" else h
                if size % c.multiple:
                    findings.add("TGT001", layer.name, f"{c.dim} = {size}{at} is not a multiple of {c.multiple} "
                                 f"(I = {i_rank}, H = {h})", hint=c.why)


def _few(items: list, n: int = 4) -> str:
    shown = ", ".join(str(x) for x in items[:n])
    return shown + (f" (+{len(items) - n} more)" if len(items) > n else "")
