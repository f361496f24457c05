"""NVFP4_AWQ findings (SEMANTICS §15): a kept ``pre_quant_scale`` is [K], finite and positive; the shards an
engine fuses (q/k/v, gate/up) and the experts of a MoE layer (their gate/up: one input) carry one vector,
which ModelOpt's re-smoothing guarantees and what a converted layer can hold (AWQ001); no fused-MoE kernel
scales an expert's intermediate (AWQ002). And what each engine does with the checkpoint: vLLM 0.32 and 0.33
refuse NVFP4_AWQ (VLL001), SGLang 0.5.23 applies it on linears only (SGL008)."""

from __future__ import annotations

import numpy as np

from mocli.census import Census, Module
from mocli.findings import Findings, few
from mocli.io.safetensors_file import TensorReader
from mocli.quant_config import Algo, QuantConfig
from mocli.schemes import NVFP4_AWQ
from mocli.tables import PRE_QUANT_SCALE

# vLLM refuses NVFP4_AWQ: as quant_algo at load, vllm 0.32.0 (the CPU wheel, read) and 0.33.0
# model_executor/layers/quantization/modelopt.py :: ModelOptQuantConfigBase.from_config (QUANT_ALGOS has no
# NVFP4_AWQ: "ModelOpt currently only supports: [...]"); as a MIXED_PRECISION layer, 0.32.0's resolve
# ("resolve: unsupported ModelOpt linear algo")
VLL001_MESSAGE = ("vLLM 0.32 and 0.33 refuse NVFP4_AWQ at load (\"ModelOpt currently only supports: ...\"): "
                  "stock vLLM does not serve this checkpoint as it is")


def check_awq(quant: QuantConfig, census: Census, engines: frozenset[str], findings: Findings) -> None:
    """VLL001 whenever vLLM's reading is judged, with or without a target (mocli convert leaves it out of
    its own warnings: its output serves through mocli's plugin)."""
    if Algo.NVFP4_AWQ not in {quant.algo, *(lq.algo for lq in quant.quantized_layers.values())}:
        return
    if "vllm" in engines:
        findings.add("VLL001", "quant_algo", VLL001_MESSAGE,
                     hint=f"mocli convert it (--target {' or '.join(_takers())}) and serve the output through "
                          "mocli's vLLM plugin, which applies pre_quant_scale")
    with TensorReader() as reader:
        values = {m.name: _vector(reader, m, findings) for m in census.modules.values() if PRE_QUANT_SCALE in m.tensors}
    for name, shards, _ in census.dense_units():
        _agree(name, [values.get(m.name) for m in shards], [m.name for m in shards], findings)
    for layer in census.moe:
        experts = [layer.experts[e] for e in sorted(layer.experts)]
        down = [ex.down.name for ex in experts if ex.down.name in values]
        if down:
            findings.add("AWQ002", layer.name, f"{len(down)} down projection(s) carry pre_quant_scale ({few(down)})",
                         hint="the fused-MoE kernels scale no expert's intermediate; re-export with it folded")
        halves = [m for ex in experts for m in (ex.gate, ex.up)]
        if any(m.name in values for m in halves):
            _agree(layer.name, [values.get(m.name) for m in halves], [m.name for m in halves], findings)
            if "sglang" in engines:
                findings.add("SGL008", layer.name, "SGLang 0.5.23 does not apply the experts' pre_quant_scale",
                             hint="serve mocli convert's output through mocli's vLLM plugin, or re-export with it folded")


def _takers() -> list[str]:
    from mocli.targets import REGISTRY

    return [str(t) for t, layout in REGISTRY.items() if NVFP4_AWQ in layout.supported["linear"]]


def _vector(reader: TensorReader, m: Module, findings: Findings) -> np.ndarray | None:
    e = m.tensors[PRE_QUANT_SCALE]
    dtypes, shape = NVFP4_AWQ.optional_spec(PRE_QUANT_SCALE)  # the registry's: BF16, or a float convert casts
    if e.dtype not in dtypes:
        findings.add("TNS002", e.name, f"pre_quant_scale is {e.dtype}, {NVFP4_AWQ} stores {', '.join(dtypes)}",
                     hint="ModelOpt writes it in a float dtype; re-export the checkpoint")
        return None
    if tuple(e.shape) != shape(*m.out_in):
        findings.add("TNS003", e.name, f"pre_quant_scale is {list(e.shape)}, expected {list(shape(*m.out_in))} for "
                     f"the module's input of {m.out_in[1]}", hint="the export is broken; re-export the checkpoint")
        return None
    raw = reader.array(e)  # BF16 as its raw 16-bit words
    v = (raw.astype(np.uint32) << 16).view(np.float32) if e.dtype == "BF16" else raw.astype(np.float32)
    if not np.isfinite(v).all():
        findings.add("SCL001", e.name, "pre_quant_scale holds NaN or Inf")
    elif not (v > 0).all():
        findings.add("SCL002", e.name, "pre_quant_scale holds zero or negative values")
    return v


def _agree(where: str, vectors: list, names: list[str], findings: Findings) -> None:
    """One vector for modules that share an input: all present and equal."""
    if all(v is None for v in vectors):
        return
    missing = [n for n, v in zip(names, vectors, strict=True) if v is None]
    if missing:
        findings.add("AWQ001", where, f"pre_quant_scale on some of the modules that share an input, not on {few(missing)}",
                     hint="one input takes one multiplier: re-export (ModelOpt re-smooths shared inputs)")
        return
    first = vectors[0]
    odd = [n for n, v in zip(names, vectors, strict=True) if not np.array_equal(v, first)]
    if odd:
        findings.add("AWQ001", where, f"pre_quant_scale of {names[0]} and {odd[0]} differ ({len(odd)} differ in all)",
                     hint="one input takes one multiplier: re-export (ModelOpt re-smooths shared inputs)")
