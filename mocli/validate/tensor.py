"""Tensor findings (SEMANTICS §1's table, per stored scheme): every quantized module holds its
scheme's weight and scales with their dtypes and shapes (TNS001-TNS005, TNS007), KV-cache scales are one
float each (TNS002, TNS003), MoE experts are complete and alike (TNS006), and experts calibration never
reached are told apart (SCL003)."""

from __future__ import annotations

from mocli.census import Census, Kind, Module, MoELayer
from mocli.findings import Findings, few
from mocli.io.safetensors_file import TensorEntry
from mocli.quant_config import QuantConfig
from mocli.scales import FLOAT_SCALES
from mocli.schemes import Spelling, by_algo
from mocli.tables import INPUT_SCALE, SCALE_SUFFIXES, WEIGHT


def check_tensors(quant: QuantConfig, census: Census, declared: dict[str, bool | None], findings: Findings) -> None:
    no_input_scale: dict[str, list[Module]] = {}  # MoE layer -> experts' projections without one
    clean = _CleanScaleTensors()
    static_under_dynamic: list[str] = []
    for m in census.modules.values():
        if m.scheme is None:
            _check_unquantized(m, findings)
            continue
        if m.kind is Kind.EMBEDDING:
            findings.add("TNS008", m.name, f"stored {m.scheme}: engines build embeddings and the LM head unquantized "
                         "and fail to load it", hint="re-export with the embedding excluded (compressed-tensors: add "
                                                      f"{m.name!r} to ignore; ModelOpt: to exclude_modules)")
            continue
        w = _checked_weight(m, findings)
        if w is None:
            continue
        if quant.dynamic_activations and m.scheme.static_input and INPUT_SCALE in m.tensors:
            static_under_dynamic.append(m.name)
        configured = quant.algo_for(m.name)
        if declared.get(m.engine_name) and configured is not None and by_algo(configured) is not m.scheme:
            findings.add("TNS005", m.name, f"stored as {m.scheme} but the config says {configured}",
                         hint="the engine will build the wrong kernel for it")
        missing = clean.check(m, w, census.spelling, quant.dynamic_activations, findings)
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
                     f"input_scale ({few(static_under_dynamic, 2)})",
                     hint='set "activation_scheme": "static" (calibrated scales, as a ModelOpt FP8 export has), or '
                          "drop the input_scale tensors to quantize activations per token")
    for layer in census.moe:
        _check_moe_layer(layer, findings)
        _check_expert_input_scales(layer, no_input_scale.get(layer.name, []), findings)
    _check_kv_scales(census, findings)


# The shapes a KV-cache scale loads as (one value, SEMANTICS §16.3): vLLM 0.32's (the CPU wheel, read) and
# 0.33's model_executor/layers/quantization/kv_cache.py :: KVCacheScaleParameter.weight_loader refuses any
# tensor whose numel() != 1 and copies it as reshape(()) into a float32 parameter (copy_ casts F32, BF16,
# F16 alike); its docstring names () and (1,), the shapes ModelOpt and compressed-tensors write.
KV_SCALE_SHAPES = ((), (1,))


def _check_kv_scales(census: Census, findings: Findings) -> None:
    """k_scale / v_scale: a float dtype mocli reads and one value; copied as stored by convert, so anything
    else would reach the engine (which refuses more than one value at load) or be read as a wrong scale."""
    for e in census.kv_scales:
        if e.dtype not in FLOAT_SCALES:
            findings.add("TNS002", e.name, f"KV-cache scale is {e.dtype}, engines load it as one float "
                         f"({', '.join(FLOAT_SCALES)})", hint="the export is broken; re-export the checkpoint")
        elif tuple(e.shape) not in KV_SCALE_SHAPES:
            findings.add("TNS003", e.name, f"KV-cache scale has shape {list(e.shape)}, engines load one value "
                         "(shape [] or [1]; vLLM refuses more at load)", hint="the export is broken; re-export "
                         "the checkpoint")


def _check_unquantized(m: Module, findings: Findings) -> None:
    stray = sorted(set(m.tensors) & SCALE_SUFFIXES)
    if stray and m.weight is None:
        # scales without any weight: the weight is missing, not the scales stray
        findings.add("TNS001", m.name, f"has {', '.join(stray)} but no weight",
                     hint="the export is incomplete; re-export the checkpoint")
    elif stray:
        findings.add("TNS004", m.name, f"unquantized (weight {m.weight.dtype}) but has {', '.join(stray)}",
                     hint="drop the scales or store the weight quantized")


def _checked_weight(m: Module, findings: Findings) -> TensorEntry | None:
    """A quantized module's weight entry when it has the scheme's dtype and a usable shape, else None."""
    w, scheme = m.tensors.get(WEIGHT), m.scheme
    if w is None or len(w.shape) != 2:
        findings.add("TNS001", m.name, "has scales but no 2-D weight",
                     hint="the export is incomplete; re-export the checkpoint")
        return None
    if w.dtype != scheme.weight_dtype:
        findings.add("TNS002", w.name, f"is {w.dtype}, {scheme} stores {scheme.weight_dtype}",
                     hint="the export is broken; re-export the checkpoint")
        return None
    if 0 in w.shape:
        findings.add("TNS003", w.name, f"quantized weight {list(w.shape)} has no elements",
                     hint="an empty layer cannot be quantized or served; re-export the checkpoint")
        return None
    return w


class _CleanScaleTensors:
    """``_check_scale_tensors`` once per kind of module: a module whose scheme, kind and tensors' suffixes,
    dtypes and shapes are those of one already checked without a finding gets that one's outcome (its missing
    suffixes) without the check. The ~24k modules of a large MoE checkpoint are a handful of kinds; a module
    with a finding is never remembered, so each one found wrong is reported by name."""

    def __init__(self) -> None:
        self.seen: dict[tuple, set[str]] = {}

    def check(self, m: Module, w: TensorEntry, spelling: Spelling, dynamic: bool, findings: Findings) -> set[str]:
        key = (id(m.scheme), m.kind, *((s, t.dtype, t.shape) for s, t in m.tensors.items()))
        missing = self.seen.get(key)
        if missing is None:
            before = len(findings)
            missing = _check_scale_tensors(m, spelling, m.scheme.logical(w.shape), dynamic, findings)
            if len(findings) == before:
                self.seen[key] = missing
        return missing


def _check_scale_tensors(m: Module, spelling: Spelling, nk: tuple[int, int], dynamic: bool,
                         findings: Findings) -> set[str]:
    """The scheme's scale tensors' dtypes and shapes for a module of logical [N, K], in the source's
    spelling (its scale dtypes, its one-value shapes, its names); returns the suffixes that are missing
    (an expert's missing input_scale is judged per layer, not here)."""
    missing: set[str] = set()
    scheme, (n, k) = m.scheme, nk
    if not (scheme.rows_split(n) and scheme.cols_split(k)):
        rows, cols = max(scheme.scale_rows, 1), max(scheme.scale_cols, 1)
        findings.add("TNS003", m.weight.name, f"shape [{n}, {k}] is not a multiple of {rows}x{cols}",
                     hint=f"{scheme} needs N % {rows} == K % {cols} == 0")
        return missing
    for suffix, (dtype, shape) in scheme.expected(n, k, dynamic).items():
        t = m.tensors.get(suffix)
        if t is None:
            missing.add(suffix)
            if not (suffix == INPUT_SCALE and m.kind is Kind.EXPERT):
                findings.add("TNS001", m.name, f"{scheme} module has no {spelling.source(suffix)}",
                             hint="the export is incomplete; re-export the checkpoint")
        elif not spelling.scale_dtype_ok(t.dtype, dtype):
            findings.add("TNS002", t.name, f"is {t.dtype}, {scheme} stores {dtype}",
                         hint="the export is broken; re-export the checkpoint")
        elif not (scheme.same_shape(suffix, t.shape, n, k) or shape == () and tuple(t.shape) in spelling.one_value):
            findings.add("TNS003", t.name, f"shape {list(t.shape)}, expected {list(shape)} for weight "
                         f"{list(m.weight.shape)}", hint="the export is broken; re-export the checkpoint")
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


def _check_moe_layer(layer: MoELayer, findings: Findings) -> None:
    idx = sorted(layer.experts)
    if idx != list(range(len(idx))):
        missing = sorted(set(range(max(idx) + 1)) - set(idx))
        findings.add("TNS006", layer.name, f"expert indices are not 0..{len(idx) - 1}: missing {few(missing)}",
                     hint="the export is incomplete; re-export the checkpoint")
    shapes: dict[str, dict[tuple, list[int]]] = {"gate": {}, "up": {}, "down": {}, "gate_up": {}}
    for e in idx:
        for proj, m in layer.experts[e].projections():
            if m is None:
                name = getattr(layer.naming, proj)
                findings.add("TNS006", f"{layer.name}.{e}", f"expert has no {name} projection",
                             hint="the export is incomplete; re-export the checkpoint")
            elif nk := m.out_in:
                shapes[proj].setdefault(nk, []).append(e)
    for proj, by_shape in shapes.items():
        if len(by_shape) > 1:
            common = max(by_shape, key=lambda s: len(by_shape[s]))
            odd = [e for s, es in by_shape.items() if s != common for e in es]
            findings.add("TNS006", layer.name, f"{proj} projections differ in shape: experts {few(odd)} are not "
                         f"{list(common)}", hint="experts of one layer must share shapes")
    gate, up = shapes["gate"], shapes["up"]
    if len(gate) == 1 and len(up) == 1 and set(gate) != set(up):
        findings.add("TNS006", layer.name, f"gate {list(next(iter(gate)))} and up {list(next(iter(up)))} "
                     "projections differ in shape", hint="gate and up projections must share shapes")


KV_BIASES = (".k_bias", ".v_bias")  # NVFP4_AFFINE's (ModelOpt 0.47, SEMANTICS §16.1)


def check_kv_cache(quant: QuantConfig, names, findings: Findings) -> None:
    """NVFP4_AFFINE KV caches (the config's algorithm, or k_bias / v_bias tensors) are refused: vLLM 0.33's
    ModelOpt KV method reads k_scale / v_scale only and no engine path consumes the biases (SEMANTICS §16.3)."""
    biases = sorted(n for n in names if n.endswith(KV_BIASES))
    algo = (quant.kv_cache_algo or "") if quant is not None else ""
    if algo == "NVFP4_AFFINE" or biases:
        findings.add("KVC001", biases[0] if biases else "kv_cache_quant_algo",
                     f"the KV cache is quantized {algo or 'with biases'}" + (f" ({len(biases)} bias tensors)" if biases else ""),
                     hint="re-export with NVFP4_KV_CFG or FP8_KV_CFG (scales only): engines ignore or refuse the biases")
