"""A compressed-tensors config group's scheme, read field by field as vLLM 0.33 reads it (issue 43 item 4).

vLLM validates each group's ``weights`` / ``input_activations`` with compressed-tensors 0.17.0's
``QuantizationArgs`` (its defaults: ``type int``, ``num_bits 8``, ``symmetric true``, ``dynamic false``, the
strategy inferred from ``group_size``) and picks the scheme in ``compressed_tensors.py ::
_get_scheme_from_parts`` (linear) and ``compressed_tensors_moe.py :: get_moe_method`` (MoE), with the group's
``format`` or else the top-level one. Each rule below names the predicate it restates. What vLLM refuses, or
would serve as another scheme than the fields say (a weight-only W8A16 where mocli would quantize
activations), is an error naming the group; a ``format`` that contradicts the weights (``float-quantized`` over
NVFP4, whose tensors only ``nvfp4-pack-quantized`` writes) too, since every other reader decompresses by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mocli.findings import Findings
from mocli.quant_config import MXFP4_GROUP_SIZE, NVFP4_GROUP_SIZE, Algo

# compressed-tensors 0.17.0 config/base.py :: CompressionFormat
FORMATS = frozenset({"dense", "sparse-bitmask", "sparse-24-bitmask", "int-quantized", "float-quantized",
                     "naive-quantized", "pack-quantized", "marlin-24", "mixed-precision", "nvfp4-pack-quantized",
                     "mxfp4-pack-quantized", "mxfp8-quantized"})
# vllm 0.33.0 compressed_tensors/utils.py :: is_activation_quantization_format: an FP8 linear needs one of these
ACTIVATION_FORMATS = frozenset({"naive-quantized", "int-quantized", "float-quantized", "nvfp4-pack-quantized"})
# the formats whose compressor writes each stored scheme's tensors (compressed-tensors' compressors/)
STORED_BY = {"NVFP4": frozenset({"nvfp4-pack-quantized"}), "FP8": frozenset({"float-quantized", "naive-quantized"}),
             "MXFP4": frozenset({"mxfp4-pack-quantized"})}
TYPES = ("int", "float")  # quant_args.py :: QuantizationType
STRATEGIES = ("tensor", "channel", "group", "block", "token", "tensor_group", "attn_head")  # :: QuantizationStrategy
KV_STRATEGIES = ("tensor", "attn_head")  # CompressedTensorsKVCacheMethod.validate_kv_cache_scheme
_HINT = "re-export the checkpoint with llm-compressor's preset for the scheme"


@dataclass(frozen=True)
class Args:
    """One ``QuantizationArgs``, with compressed-tensors' defaults filled in."""

    type: str
    num_bits: int
    strategy: str
    symmetric: bool
    dynamic: bool | str
    group_size: int | None
    block: list | None

    def __str__(self) -> str:
        size = f" {self.group_size}" if self.group_size else f" {self.block}" if self.block else ""  # "group 32"
        sym = "" if self.symmetric else " asymmetric"
        dyn = {True: " dynamic", False: " static"}.get(self.dynamic, f" dynamic {self.dynamic}")
        return f"{self.type} {self.num_bits}-bit {self.strategy}{size}{sym}{dyn}"


def read_args(d: Any, where: str, findings: Findings) -> Args | None:
    """``QuantizationArgs.model_validate`` restated: a field of the wrong type or an unknown value is CFG002."""
    if not isinstance(d, dict):
        findings.add("CFG002", where, "must be an object of quantization arguments")
        return None
    if d.get("actorder") in ("group", "dynamic"):  # _quantization_scheme_map_from_config raises on these
        findings.add("CFG002", where, f"actorder {d['actorder']!r}: vLLM no longer loads group or dynamic "
                     "activation ordering", hint="re-export with actorder static or none")
        return None
    fields = {"type": d.get("type", "int"), "num_bits": d.get("num_bits", 8), "symmetric": d.get("symmetric", True),
              "dynamic": d.get("dynamic", False), "group_size": d.get("group_size"),
              "block": d.get("block_structure"), "strategy": d.get("strategy")}
    bad = _bad_field(fields)
    if bad:
        findings.add("CFG002", where, bad, hint=_HINT)
        return None
    if isinstance(fields["dynamic"], str):
        fields["dynamic"] = fields["dynamic"].lower()
    if fields["strategy"] is None:  # quant_args.py :: validate_model_after infers it
        gs = fields["group_size"]
        fields["strategy"] = "tensor" if gs is None else "channel" if gs == -1 else "group"
    return Args(**fields)


def _bad_field(f: dict) -> str:
    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if f["type"] not in TYPES:
        return f"type {f['type']!r} is not a quantization type (int, float)"
    if not is_int(f["num_bits"]) or f["num_bits"] <= 0:
        return f"num_bits {f['num_bits']!r} is not a positive integer"
    if f["strategy"] is not None and f["strategy"] not in STRATEGIES:
        return f"strategy {f['strategy']!r} is not one of {', '.join(STRATEGIES)}"
    if not isinstance(f["symmetric"], bool):
        return f"symmetric {f['symmetric']!r} is not true or false"
    if not (isinstance(f["dynamic"], bool) or (isinstance(f["dynamic"], str) and f["dynamic"].lower() == "local")):
        return f"dynamic {f['dynamic']!r} is not true, false or \"local\""
    if f["group_size"] is not None and not is_int(f["group_size"]):
        return f"group_size {f['group_size']!r} is not an integer"
    if f["block"] is not None and not (isinstance(f["block"], list) and all(map(is_int, f["block"]))):
        return f"block_structure {f['block']!r} is not a list of integers"
    return ""


def _is_nvfp4(a: Args | None) -> bool:
    """compressed_tensors.py :: _is_nvfp4_format (symmetric included)."""
    return (a is not None and a.type == "float" and a.num_bits == 4 and a.strategy == "tensor_group"
            and a.group_size == NVFP4_GROUP_SIZE and a.symmetric)


def _is_mxfp4(a: Args | None) -> bool:
    """compressed_tensors.py :: _is_mxfp4: float 4-bit, strategy group, group_size 32, symmetric."""
    return (a is not None and a.type == "float" and a.num_bits == 4 and a.strategy == "group"
            and a.group_size == MXFP4_GROUP_SIZE and a.symmetric)


def _mxfp4(a: Args | None, fmt: str | None, where: str, findings: Findings) -> Algo | None:
    """_get_scheme_from_parts / get_moe_method: MXFP4 weights are CompressedTensorsW4A4Mxfp4 (MoE:
    ...W4A4Mxfp4MoEMethod) whatever the inputs, unless float 8-bit dynamic per-token/group inputs make them
    W4A8 (``_is_mxfp4_w4a8_fp8``), which mocli does not read. Presets MXFP4 (fp4 group-32 dynamic inputs) and
    MXFP4A16 (none) store the same tensors (SEMANTICS §19.2); vLLM 0.33 quantizes the activations of both on
    the kernels that can (§19.4)."""
    if a is not None and a.type == "float" and a.num_bits == 8 and a.dynamic and a.strategy in ("token", "group"):
        findings.add("CFG003", where, f"MXFP4 weights with {a} inputs: vLLM serves them W4A8 (_is_mxfp4_w4a8_fp8), "
                     "which mocli does not read", hint=_HINT)
        return None
    if a is not None and not _is_mxfp4(a):
        findings.add("CFG002", f"{where}.input_activations", f"{a} inputs beside MXFP4 weights: vLLM ignores them "
                     "and quantizes activations as MXFP4 (CompressedTensorsW4A4Mxfp4)", hint=_HINT)
        return None
    if not _format_stores(fmt, "MXFP4", where, findings):
        return None
    return Algo.MXFP4


@dataclass(frozen=True)
class Fp8Scheme:
    """An FP8 weight strategy mocli reads and the input activations vLLM pairs with it for that scheme."""

    algo: Algo
    dynamic: bool
    input_strategy: str
    input_group: int | None = None
    block: tuple[int, int] | None = None


# weight strategy -> scheme: the inputs are what vLLM's W8A8 FP8 path reads (_is_fp8_w8a8: static inputs must be
# symmetric per tensor; dynamic ones are quantized per token, or per 1x128 group beside 128x128 blocks, §8)
FP8_SCHEMES = {
    "tensor": Fp8Scheme(Algo.FP8, dynamic=False, input_strategy="tensor"),
    "channel": Fp8Scheme(Algo.FP8_PER_CHANNEL_PER_TOKEN, dynamic=True, input_strategy="token"),
    "block": Fp8Scheme(Algo.FP8_PB_WO, dynamic=True, input_strategy="group", input_group=128, block=(128, 128)),
}


def group_targets(group: Any, where: str, findings: Findings) -> list[str] | None:
    """A group's ``targets``: a list of strings (vLLM iterates it; a bare string would be its characters)."""
    targets = group.get("targets") if isinstance(group, dict) else None
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        findings.add("CFG002", where, f"targets must be a list of strings, not {targets!r}"[:200], hint=_HINT)
        return None
    return targets


def attention_only(targets: list[str]) -> bool:
    """compressed_tensors.py :: from_config skips a group whose one target is an attention class
    (``LlamaAttention``): attention quantization is coupled with the KV cache there, not a layer scheme."""
    return len(targets) == 1 and targets[0].endswith("Attention")


def group_algo(group: Any, top_format: Any, where: str, findings: Findings) -> Algo | None:
    """The stored scheme a config group names (SEMANTICS §17.1, §17.2), or None with a finding."""
    if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
        findings.add("CFG002", where, "a config group needs a weights object")
        return None
    fmt = group.get("format") if group.get("format") is not None else top_format
    if fmt is not None and fmt not in FORMATS:
        findings.add("CFG002", where, f"format {fmt!r} is not a compressed-tensors format",
                     hint="compressed-tensors 0.17 formats: " + ", ".join(sorted(FORMATS)))
        return None
    w = read_args(group["weights"], f"{where}.weights", findings)
    acts = group.get("input_activations")
    a = read_args(acts, f"{where}.input_activations", findings) if acts is not None else None
    if w is None or (acts is not None and a is None):
        return None
    if w.type == "float" and w.num_bits == 4 and w.strategy == "tensor_group":
        return _nvfp4(w, a, fmt, where, findings)
    if w.type == "float" and w.num_bits == 8 and w.strategy in FP8_SCHEMES:
        return _fp8(w, a, fmt, where, findings)
    if _is_mxfp4(w):
        return _mxfp4(a, fmt, where, findings)
    findings.add("CFG003", where, f"a {fmt or 'compressed-tensors'} scheme mocli does not read (weights {w})",
                 hint="mocli reads NVFP4, NVFP4A16, MXFP4, MXFP4A16 and FP8 (tensor with static input, channel, "
                      "128x128 block)")
    return None


def _nvfp4(w: Args, a: Args | None, fmt: str | None, where: str, findings: Findings) -> Algo | None:
    """_get_scheme_from_parts / get_moe_method: NVFP4 weights take NVFP4 inputs or none (NVFP4A16), any
    format; anything else is a ValueError at load ("input quantization must also be NVFP4")."""
    if not _is_nvfp4(w):
        why = "asymmetric (symmetric: false)" if not w.symmetric else f"group_size {w.group_size}, not 16"
        findings.add("CFG002", f"{where}.weights", f"float 4-bit tensor_group weights that are {why}: vLLM has "
                     "no such NVFP4 scheme and refuses the layer (_is_nvfp4_format)", hint=_HINT)
        return None
    if a is not None and not _is_nvfp4(a):
        findings.add("CFG002", f"{where}.input_activations", f"{a} inputs beside NVFP4 weights: vLLM raises "
                     "\"input quantization must also be NVFP4 format, None for NVFP4A16\"", hint=_HINT)
        return None
    if not _format_stores(fmt, "NVFP4", where, findings):
        return None
    return Algo.NVFP4 if a is not None else Algo.W4A16_NVFP4


def _fp8(w: Args, a: Args | None, fmt: str | None, where: str, findings: Findings) -> Algo | None:
    """_is_fp8_w8a8 / _is_fp8_w8a16: symmetric static weights only; a linear layer needs an activation
    quantization format. Inputs other than the scheme's make vLLM serve W8A16 or another W8A8 variant."""
    if not w.symmetric or w.dynamic is not False:
        what = "asymmetric (symmetric: false)" if not w.symmetric else f"dynamic ({w.dynamic})"
        findings.add("CFG002", f"{where}.weights", f"FP8 weights that are {what}: vLLM has no such scheme and "
                     "refuses the layer (_is_fp8_w8a8, _is_fp8_w8a16 need symmetric static weights)", hint=_HINT)
        return None
    scheme = FP8_SCHEMES[w.strategy]
    if scheme.block and tuple(w.block or ()) != scheme.block:
        findings.add("CFG003", where, f"FP8 {w.block} blocks: mocli reads 128x128 blocks only", hint=_HINT)
        return None
    if fmt is None or fmt not in ACTIVATION_FORMATS:
        under = f"format {fmt!r}" if fmt is not None else "no format (neither the group's nor the top level's)"
        findings.add("CFG002", where, f"FP8 weights under {under}: vLLM builds no FP8 linear layer for a format "
                     "that is not an activation-quantization one (is_activation_quantization_format)",
                     hint="FP8 groups are written with format float-quantized")
        return None
    if not _format_stores(fmt, "FP8", where, findings):
        return None
    if a is None:
        findings.add("CFG003", where, f"FP8 {w.strategy} weights without input_activations: vLLM serves them "
                     "weight-only (W8A16), which mocli does not read", hint=_HINT)
        return None
    if a.type != "float" or a.num_bits != 8 or (not a.dynamic and not a.symmetric):
        findings.add("CFG002", f"{where}.input_activations", f"{a} inputs beside FP8 weights: vLLM's FP8 "
                     "scheme reads float 8-bit symmetric inputs (_is_fp8_w8a8) and serves these otherwise",
                     hint=_HINT)
        return None
    want_dynamic = scheme.dynamic
    if bool(a.dynamic) != want_dynamic or a.strategy != scheme.input_strategy or (
            scheme.input_group is not None and a.group_size != scheme.input_group):
        findings.add("CFG003", where, f"FP8 {w.strategy} weights with {a} inputs: a scheme mocli does not read "
                     f"(it reads {scheme.input_strategy} {'dynamic' if want_dynamic else 'static'} inputs beside "
                     f"{w.strategy} weights)", hint=_HINT)
        return None
    return scheme.algo


def _format_stores(fmt: str | None, stored: str, where: str, findings: Findings) -> bool:
    if fmt is None or fmt in STORED_BY[stored]:
        return True
    findings.add("CFG002", where, f"format {fmt!r} contradicts its {stored} weights, whose tensors "
                 f"{' or '.join(sorted(STORED_BY[stored]))} writes", hint="a reader that decompresses by format "
                 "(compressed-tensors, transformers) would misread the tensors; set the format the exporter wrote")
    return False


def kv_algo(scheme: Any, where: str, findings: Findings) -> str | None:
    """``CompressedTensorsKVCacheMethod.validate_kv_cache_scheme`` (vllm 0.33.0 compressed_tensors.py), which
    reads the raw dict without defaults: float 8-bit, strategy tensor or attn_head, symmetric (SEMANTICS §17.5)."""
    if scheme is None:
        return None
    where = f"{where}: kv_cache_scheme"
    if not isinstance(scheme, dict) or scheme.get("type") != "float" or scheme.get("num_bits") != 8:
        findings.add("CFG003", where, f"KV-cache scheme {scheme} is not one vLLM's compressed-tensors path loads "
                     "(FP8 only)", hint="re-export with an FP8 KV cache, or none")
        return None
    if scheme.get("strategy") not in KV_STRATEGIES:
        findings.add("CFG002", where, f"strategy {scheme.get('strategy')!r}: vLLM loads an FP8 KV cache per "
                     "tensor or per attention head only, and refuses the checkpoint", hint=_HINT)
        return None
    if scheme.get("symmetric") is not True:
        findings.add("CFG002", where, f"symmetric {scheme.get('symmetric')!r}: vLLM loads a symmetric FP8 KV "
                     "cache only (\"Only support symmetric scaling factor\") and refuses the checkpoint", hint=_HINT)
        return None
    return "FP8"
