"""Findings: what validate reports. Codes are stable; their table lives in ``CODES``."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum


class Severity(StrEnum):
    ERROR = "error"
    WARNING = "warning"


# code -> (severity, title). The README's finding table is generated from this dict's contents.
CODES: dict[str, tuple[Severity, str]] = {
    # configuration (SEMANTICS §1)
    "CFG001": (Severity.ERROR, "required quantization field missing"),
    "CFG002": (Severity.ERROR, "quantization field has the wrong type or value"),
    "CFG003": (Severity.ERROR, "unknown quantization algorithm"),
    "CFG004": (Severity.ERROR, "hf_quant_config.json and config.json disagree"),
    "CFG005": (Severity.ERROR, "no ModelOpt quantization config"),
    "CFG006": (Severity.ERROR, "MIXED_PRECISION layer names a module that is not in the checkpoint"),
    "CFG007": (Severity.WARNING, "a stale hf_quant_config.json beside another format's config.json (ignored)"),
    "CFG008": (Severity.ERROR, "a compressed-tensors re: pattern is invalid or too slow to match"),
    "CFG009": (Severity.WARNING, "a compressed-tensors re: pattern hangs or fails under Python's re (SGLang), "
                                 "not under vLLM's regex"),
    # exclusions (SEMANTICS §2)
    "EXC001": (Severity.WARNING, "exclude pattern matches no module"),
    "EXC002": (Severity.ERROR, "fused group partly excluded"),
    "EXC003": (Severity.ERROR, "module excluded but stored quantized"),
    "EXC004": (Severity.ERROR, "module not excluded but stored unquantized"),
    "EXC005": (Severity.WARNING, "engine's p* -> p, p.* rewrite changes what a pattern matches"),
    "EXC006": (Severity.WARNING, "exclude pattern matches only under another VLM prefix"),
    # tensors (SEMANTICS §1 table)
    "TNS001": (Severity.ERROR, "quantized module lacks a required tensor"),
    "TNS002": (Severity.ERROR, "tensor has the wrong dtype for its scheme"),
    "TNS003": (Severity.ERROR, "tensor has the wrong shape for its scheme"),
    "TNS004": (Severity.ERROR, "scale tensor on an unquantized module"),
    "TNS005": (Severity.ERROR, "stored scheme differs from the configured algorithm"),
    "TNS006": (Severity.ERROR, "MoE experts inconsistent (missing expert or mismatched shapes)"),
    "TNS007": (Severity.ERROR, "static input_scale stored under a dynamic activation scheme"),
    "TNS008": (Severity.ERROR, "embedding stored quantized, which no engine loads"),
    "TNS009": (Severity.ERROR, "MXFP4 experts blocked along the output features, which no engine's MXFP4 GEMM reads"),
    # NVFP4_AWQ (SEMANTICS §15)
    "AWQ001": (Severity.ERROR, "modules that share an input carry different (or partly no) pre_quant_scale"),
    "AWQ002": (Severity.ERROR, "MoE down projections carry pre_quant_scale, which no fused-MoE kernel applies"),
    # vLLM 0.33's reading (validate --engine vllm|all)
    "VLL001": (Severity.WARNING, "vLLM refuses this quantization algorithm (its output serves through mocli's plugin)"),
    "VLL002": (Severity.ERROR, "vLLM refuses this quantization config, and no mocli conversion serves it"),
    "VLL003": (Severity.WARNING, "vLLM quantizes activations the checkpoint declares unquantized (on some GPUs)"),
    # the KV cache (SEMANTICS §16)
    "KVC001": (Severity.ERROR, "affine KV-cache quantization (k_bias / v_bias), which no engine consumes"),
    # SGLang 0.5.23's reading (validate --engine sglang|all; mocli.engines.sglang)
    "SGL001": (Severity.ERROR, "SGLang builds a module quantized that is stored unquantized"),
    "SGL002": (Severity.ERROR, "SGLang builds a module unquantized that is stored quantized"),
    "SGL003": (Severity.ERROR, "SGLang refuses a fused group its exclusion rule splits"),
    "SGL004": (Severity.ERROR, "SGLang does not load this quantization algorithm"),
    "SGL005": (Severity.ERROR, "SGLang builds MIXED_PRECISION layers of this algorithm unquantized"),
    "SGL006": (Severity.WARNING, "SGLang does not apply the NVFP4 KV cache by default"),
    "SGL007": (Severity.WARNING, "exclude entry is a live regular expression in SGLang"),
    "SGL008": (Severity.WARNING, "SGLang does not apply MoE experts' pre_quant_scale"),
    # scale health
    "SCL001": (Severity.ERROR, "scale is NaN or infinite"),
    "SCL002": (Severity.ERROR, "scale is zero or negative"),
    "SCL003": (Severity.ERROR, "MoE expert has no input_scale"),
    "SCL004": (Severity.WARNING, "FP8 fused shards have widely different weight scales"),
    "SCL005": (Severity.WARNING, "NVFP4 fused shards have different weight_scale_2"),
    "SCL006": (Severity.ERROR, "a scale the target computes from finite ones overflows (not finite)"),
    # target constraints (SEMANTICS §4-§7), judged on each rank's shapes
    "TGT001": (Severity.ERROR, "shape violates the target's alignment"),
    "TGT002": (Severity.ERROR, "scheme not supported by the target"),
    "TGT003": (Severity.WARNING, "layer below the target kernel's minimum shape: the engine runs it on another kernel"),
    "TGT004": (Severity.ERROR, "an MXFP4 expert block fits no single block-FP8 scale (--mxfp4-experts fp8-block)"),
    # tensor / expert parallel ranks (SEMANTICS §10; validate --tp/--ep, convert --tp/--ep)
    "PAR001": (Severity.ERROR, "attention heads cannot be divided among the tensor-parallel ranks"),
    "PAR002": (Severity.ERROR, "experts cannot be divided among the expert-parallel ranks"),
    "PAR003": (Severity.ERROR, "a dimension cannot be split evenly across ranks at its block granularity"),
    "PAR004": (Severity.ERROR, "no known tensor-parallel split for this layer"),
    "PAR005": (Severity.ERROR, "config.json lacks or contradicts the head counts needed to split attention"),
    # tensor data (validate --deep; convert and repair read every byte anyway)
    "DAT001": (Severity.ERROR, "weight or scale bytes encode NaN or Inf"),
}


@dataclass(frozen=True, slots=True)
class Finding:
    code: str
    location: str
    message: str
    hint: str = ""

    @property
    def severity(self) -> Severity:
        return CODES[self.code][0]

    def to_dict(self) -> dict:
        return {"code": self.code, "severity": str(self.severity), **asdict(self)}


class Findings(list[Finding]):
    """A list of findings with a convenience adder."""

    def add(self, code: str, location: str, message: str, hint: str = "") -> None:
        assert code in CODES, code
        self.append(Finding(code, location, message, hint))

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self if f.severity is Severity.ERROR]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self if f.severity is Severity.WARNING]


def few(items: list, n: int = 4) -> str:
    """The first ``n`` items of a list for a message, and how many more there are."""
    shown = ", ".join(str(x) for x in items[:n])
    return shown + (f" (+{len(items) - n} more)" if len(items) > n else "")
