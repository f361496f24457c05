"""AMD Quark quantization configs (``quant_method: "quark"``), read as vLLM reads them (SEMANTICS §19.2).

vLLM's ``quark/quark.py :: QuarkConfig`` takes a layer's config from ``layer_quant_config`` (module-name
patterns), else ``layer_type_quant_config``, else ``global_quant_config`` (``_find_matched_config``); a config
with ``output_tensors`` or ``bias`` quantized is refused (``_get_scheme_cls_from_config``), and OCP MX weights are
``dtype "fp4"``, ``qscheme "per_group"``, ``group_size 32``, ``scale_format "e8m0"``
(``utils/ocp_mx_utils.py :: ocp_mx_weight_dtype_and_rows``), with inputs none (W4A16), dynamic fp4 (W4A4) or
others mocli does not read (``quark.py :: _is_w_ocp_mx_a_x``). ``exclude`` is matched as compressed-tensors'
``ignore`` (``quark/utils.py :: should_ignore_layer`` calls the same ``find_matching_patterns``: exact or ``re:``).
Read from the vLLM 0.32.0 CPU wheel's source; §19.2 names the same functions in 0.33.0. mocli reads MXFP4 (weight-
only and W4A4); any other Quark scheme is CFG003 naming it.
"""

from __future__ import annotations

from typing import Any

from mocli.compressed_tensors import Resolver
from mocli.findings import Findings
from mocli.quant_config import MXFP4_GROUP_SIZE, Algo, QuantConfig

METHOD = "quark"
_HINT = "mocli reads Quark's MXFP4 (weights fp4 per_group 32 e8m0; inputs none or dynamic fp4)"


def _one(spec: Any) -> Any:
    """A one-entry list is its entry (``_unwrap_single_quant_config``); longer lists are other schemes."""
    return spec[0] if isinstance(spec, list) and len(spec) == 1 else spec


def _describe(spec: Any) -> str:
    if not isinstance(spec, dict):
        return repr(spec)[:80]
    keys = ("dtype", "qscheme", "group_size", "scale_format", "is_dynamic")
    return "{" + ", ".join(f"{k}: {spec.get(k)!r}" for k in keys if k in spec) + "}"


def _is_mxfp4_weight(w: Any) -> bool:
    return (isinstance(w, dict) and w.get("dtype") == "fp4" and w.get("qscheme") == "per_group"
            and w.get("group_size") == MXFP4_GROUP_SIZE and w.get("scale_format") == "e8m0")


def scheme(config: Any, where: str, findings: Findings) -> Algo | None:
    """The stored scheme one Quark layer config names (None with a finding where mocli does not read it)."""
    if not isinstance(config, dict):
        findings.add("CFG002", where, "must be an object with weight / input_tensors")
        return None
    if config.get("output_tensors") or config.get("bias"):
        findings.add("CFG003", where, "output_tensors or bias quantized: vLLM refuses it (\"Quark models with "
                     "output_tensors and bias quantized are not supported\")", hint=_HINT)
        return None
    w, a = _one(config.get("weight")), _one(config.get("input_tensors"))
    if not _is_mxfp4_weight(w):
        findings.add("CFG003", where, f"a Quark scheme mocli does not read (weight {_describe(w)})", hint=_HINT)
        return None
    if a is None:
        return Algo.MXFP4
    if not isinstance(a, dict) or a.get("dtype") != "fp4" or not a.get("is_dynamic"):
        findings.add("CFG003", where, f"MXFP4 weights with input_tensors {_describe(a)}: a Quark scheme mocli does "
                     "not read (W4A8 with FP8 or MXFP8 inputs, or static inputs)", hint=_HINT)
        return None
    if a.get("qscheme") != "per_group" or a.get("group_size") != MXFP4_GROUP_SIZE:
        findings.add("CFG002", where, f"fp4 input_tensors {_describe(a)}: OCP MX activations are per_group 32",
                     hint=_HINT)
        return None
    return Algo.MXFP4


def _others(q: dict, algo: Algo | None, where: str, findings: Findings) -> None:
    """layer_quant_config / layer_type_quant_config entries: read where they name the global scheme."""
    for key in ("layer_quant_config", "layer_type_quant_config"):
        entries = q.get(key) or {}
        if not isinstance(entries, dict):
            findings.add("CFG002", f"{where}: {key}", "must be an object {pattern: config}")
            continue
        for name, spec in entries.items():
            got = scheme(spec, f"{where}: {key}.{name}", findings)
            if got is not None and got is not algo:
                findings.add("CFG003", f"{where}: {key}.{name}", f"{got} beside a global scheme {algo}: mocli "
                             "reads one Quark scheme per checkpoint", hint=_HINT)
    export = q.get("export") if isinstance(q.get("export"), dict) else {}
    if export.get("kv_cache_group") or q.get("kv_cache_quant_config"):
        findings.add("CFG003", f"{where}: kv_cache_quant_config", "a quantized Quark KV cache, which mocli does not "
                     "read", hint="re-export without KV-cache quantization")


def parse(q: dict[str, Any], where: str, findings: Findings) -> QuantConfig:
    """``config.json["quantization_config"]`` with ``quant_method: quark``."""
    cfg = QuantConfig(origin="config.json", method=METHOD, producer={"name": "quark", "version": q.get("version")})
    glob = q.get("global_quant_config")
    if not isinstance(glob, dict):
        findings.add("CFG001", where, "Quark config has no global_quant_config object")
        return cfg
    cfg.algo = scheme(glob, f"{where}: global_quant_config", findings)
    _others(q, cfg.algo, where, findings)
    exclude = q.get("exclude") or []
    if not isinstance(exclude, list) or not all(isinstance(x, str) for x in exclude):
        findings.add("CFG002", where, "exclude must be a list of strings")
        exclude = []
    cfg.group_size = MXFP4_GROUP_SIZE if cfg.algo is not None else None
    targets = {"Linear": cfg.algo} if cfg.algo is not None else {}
    # exclude is matched by the resolver under compressed-tensors' rules, never §2's (so not exclude_modules)
    cfg.resolver = Resolver(targets, exclude, findings, where, {p: "exclude" for p in exclude})
    return cfg
