"""``mocli inspect``: what is in a checkpoint, from headers only."""

from __future__ import annotations

from collections import Counter
from operator import attrgetter
from typing import Any

from mocli.census import Census
from mocli.checkpoint import Checkpoint
from mocli.exclusions import pattern_reports
from mocli.schemes import distinct


def inspect_checkpoint(ckpt: Checkpoint, census: Census | None = None) -> dict[str, Any]:
    census = census or ckpt.census()
    quant = ckpt.quant
    dtypes, dtype_bytes = _by_dtype(ckpt)
    schemes = sorted({str(s) for s in distinct(m.scheme for m in census.modules.values()) if s is not None})
    return {
        "path": str(ckpt.path),
        "source": ckpt.source.describe(),
        "architecture": ckpt.architecture,
        "model_type": ckpt.config.get("model_type"),
        "producer": (quant.producer if quant else None),
        "quant_algo": str(quant.algo) if quant and quant.algo else None,
        "quant_method": quant.method if quant else None,
        "activation_scheme": ("dynamic" if quant.dynamic_activations else "static") if quant and quant.method == "fp8"
        else None,
        "stored_schemes": schemes,
        "kv_cache_quant_algo": quant.kv_cache_algo if quant else None,
        "group_size": quant.group_size if quant else None,
        "config_files": [q.origin for q in (ckpt.hf_quant_config, ckpt.config_quant) if q is not None],
        "quantized_layers": len(quant.quantized_layers) if quant else 0,
        "shards": [{"file": h.path.name, "bytes": h.size, "tensors": len(h.tensors)} for h in ckpt.files],
        "sharded": ckpt.sharded,
        "total_bytes": ckpt.total_bytes,
        "num_tensors": len(ckpt.tensors),
        "num_layers": census.num_layers,
        "dtypes": {d: {"tensors": dtypes[d], "bytes": dtype_bytes[d]} for d in sorted(dtypes)},
        "modules": census.kind_table(),
        "fused_groups": Counter(g.fused for g in census.fused),
        "moe_layers": [
            {"name": layer.name, "naming": layer.naming.style, "experts": layer.num_experts,
             "intermediate": layer.intermediate, "hidden": layer.hidden,
             # gate and up: one tensor per expert with rows interleaved (gpt-oss), else two halves
             "gate_up": "interleaved" if layer.interleaved else "halves",
             "schemes": sorted(str(s) if s else "unquantized" for s in layer.schemes)}
            for layer in census.moe
        ],
        "kv_cache_scales": len(census.kv_scales),
        "exclusions": [r.to_dict() for r in _exclusion_reports(quant, census)],
        "config_findings": [f.to_dict() for f in ckpt.config_findings],
    }


def _by_dtype(ckpt: Checkpoint) -> tuple[Counter, Counter]:
    """(tensors, bytes) per dtype, by C builtins: sorted by dtype, the byte sizes summed a run at a time."""
    entries = sorted(ckpt.tensors.values(), key=attrgetter("dtype"))
    dtypes = Counter(map(attrgetter("dtype"), entries))
    nbytes, at = Counter(), 0
    for dtype, n in dtypes.items():
        nbytes[dtype] = sum(map(attrgetter("nbytes"), entries[at:at + n]))
        at += n
    return dtypes, nbytes


def _exclusion_reports(quant, census: Census) -> list:
    """exclude_modules under ModelOpt's rules, or compressed-tensors' ``ignore`` under its own."""
    if quant is not None and quant.resolver is not None:
        from mocli.compressed_tensors import ignore_reports

        return ignore_reports(quant.resolver, census)
    return pattern_reports(quant.exclude_modules if quant else [], census)
