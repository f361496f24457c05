"""The two ModelOpt config styles parsed into one typed model (SEMANTICS §1).

Third-party input, so parsing is lenient: every problem becomes a finding, never an exception.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from mocli.findings import Findings
from mocli.io.hf_names import CONFIG_JSON, HF_QUANT_CONFIG

# vLLM registers ModelOpt checkpoints under these quant_method names.
MODELOPT_METHODS = {"modelopt", "modelopt_fp4", "modelopt_mixed"}


class Algo(StrEnum):
    FP8 = "FP8"
    FP8_PER_CHANNEL_PER_TOKEN = "FP8_PER_CHANNEL_PER_TOKEN"
    FP8_PB_WO = "FP8_PB_WO"
    NVFP4 = "NVFP4"
    W4A16_NVFP4 = "W4A16_NVFP4"
    NVFP4_AWQ = "NVFP4_AWQ"
    MXFP8 = "MXFP8"
    MXFP4 = "MXFP4"  # ModelOpt 0.47 writes "mxfp4"; compressed-tensors, Quark and gpt-oss name it otherwise (SEMANTICS §19)
    MIXED_PRECISION = "MIXED_PRECISION"

    @classmethod
    def parse(cls, value: str) -> Algo | None:
        # ModelOpt writes fp8_pb_wo in lower case; engines match case-insensitively.
        try:
            return cls(value.upper())
        except ValueError:
            return None


NVFP4_GROUP_SIZE = 16
MXFP8_GROUP_SIZE = 32
MXFP4_GROUP_SIZE = 32
# the block size each block-scaled algorithm's group_size must name (its scheme's, mocli.schemes)
GROUP_SIZES = {Algo.NVFP4: NVFP4_GROUP_SIZE, Algo.W4A16_NVFP4: NVFP4_GROUP_SIZE, Algo.NVFP4_AWQ: NVFP4_GROUP_SIZE,
               Algo.MXFP8: MXFP8_GROUP_SIZE, Algo.MXFP4: MXFP4_GROUP_SIZE}


@dataclass(frozen=True)
class LayerQuant:
    algo: Algo
    group_size: int | None = None
    raw_algo: str = field(default="", compare=False)  # as the file spells it (SGLang matches case-sensitively)


@dataclass
class QuantConfig:
    """One file's view of the quantization settings."""

    origin: str
    algo: Algo | None = None
    kv_cache_algo: str | None = None
    group_size: int | None = None
    exclude_modules: list[str] = field(default_factory=list)
    quantized_layers: dict[str, LayerQuant] = field(default_factory=dict)
    producer: dict[str, Any] | None = None
    # "modelopt", or "fp8": vLLM/SGLang's serialized FP8 format (what mocli quantize writes), whose
    # ignored_layers are matched by the exact, fused-aware rule only (vllm quant_utils.is_layer_skipped)
    method: str = "modelopt"
    dynamic_activations: bool = False  # fp8 with activation_scheme "dynamic": no input scales
    weight_only: bool = False  # compressed-tensors: no config group quantizes input activations (MXFP4A16, NVFP4A16)
    raw_algo: str | None = None  # quant_algo as the file spells it (SGLang matches case-sensitively)
    # another format's own matching rule (compressed-tensors: ``mocli.compressed_tensors.Resolver``)
    resolver: Callable[[str], Algo | None] | None = field(default=None, compare=False, repr=False)

    def algo_for(self, module: str) -> Algo | None:
        """The configured algorithm of one checkpoint module (None: unquantized under MIXED_PRECISION)."""
        if self.resolver is not None:
            return self.resolver(module)
        if self.algo is Algo.MIXED_PRECISION:
            lq = self.quantized_layers.get(module) or self.quantized_layers.get(_experts_container(module))
            return lq.algo if lq else None
        return self.algo

    def to_dict(self) -> dict[str, Any]:
        return {
            "origin": self.origin,
            "quant_algo": str(self.algo) if self.algo else None,
            "kv_cache_quant_algo": self.kv_cache_algo,
            "group_size": self.group_size,
            "exclude_modules": list(self.exclude_modules),
            "quantized_layers": {k: {"quant_algo": str(v.algo), "group_size": v.group_size}
                                 for k, v in self.quantized_layers.items()},
            "producer": self.producer,
            "quant_method": self.method,
            "activation_scheme": ("dynamic" if self.dynamic_activations else "static") if self.method == "fp8" else None,
        }


def _experts_container(module: str) -> str:
    """``<layer>.experts`` of an expert's projection ``<layer>.experts.<e>.<proj>``: the name ModelOpt 0.47
    lists MoE experts under in MIXED_PRECISION (the FusedMoE prefix vLLM asks about), else ""."""
    parts = module.rsplit(".", 2)
    return parts[0] if len(parts) == 3 and parts[1].isdigit() and parts[0].endswith(".experts") else ""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_algo(value: Any, where: str, key: str, findings: Findings) -> Algo | None:
    if not isinstance(value, str):
        findings.add("CFG002", where, f"{key} must be a string, got {type(value).__name__}")
        return None
    algo = Algo.parse(value)
    if algo is None:
        findings.add("CFG003", where, f"unknown {key} {value!r}",
                     hint="expected one of " + ", ".join(a.value for a in Algo))
    return algo


def _parse_group_size(value: Any, where: str, findings: Findings, algo: Algo | None = None) -> int | None:
    """A group_size, which must be the block size of ``algo`` (NVFP4's where ``algo`` is not block-scaled).
    Not judged under an algorithm mocli does not know (CFG003 says so): its block size is not known either."""
    if value is None:
        return None
    if not _is_int(value):
        findings.add("CFG002", where, f"group_size must be an integer, got {value!r}")
        return None
    want = GROUP_SIZES.get(algo, NVFP4_GROUP_SIZE)
    if algo is not None and value != want:
        findings.add("CFG002", where, f"group_size {value} is not supported",
                     hint=f"{algo if algo in GROUP_SIZES else 'NVFP4'} uses blocks of {want}")
    return value


def _parse_exclude(value: Any, where: str, key: str, findings: Findings) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        findings.add("CFG002", where, f"{key} must be a list of strings")
        return [x for x in value if isinstance(x, str)] if isinstance(value, list) else []
    return list(value)


def _parse_layers(value: Any, where: str, findings: Findings) -> dict[str, LayerQuant]:
    if not isinstance(value, dict):
        findings.add("CFG002", where, "quantized_layers must be an object {module: {quant_algo, …}}")
        return {}
    layers: dict[str, LayerQuant] = {}
    for module, spec in value.items():
        loc = f"{where}: quantized_layers.{module}"
        if not isinstance(spec, dict):
            findings.add("CFG002", loc, "layer entry must be an object")
            continue
        if "quant_algo" not in spec:
            findings.add("CFG001", loc, "layer entry has no quant_algo")
            continue
        algo = _parse_algo(spec["quant_algo"], loc, "quant_algo", findings)
        if algo is None:
            continue
        if algo is Algo.MIXED_PRECISION:
            findings.add("CFG003", loc, "a layer cannot itself be MIXED_PRECISION")
            continue
        gs = _parse_group_size(spec.get("group_size"), loc, findings, algo)
        if algo in GROUP_SIZES and gs is None:
            findings.add("CFG001", loc, f"{algo} layer entry has no group_size",
                         hint=f"add \"group_size\": {GROUP_SIZES[algo]}")
        layers[module] = LayerQuant(algo, gs, spec["quant_algo"])
    return layers


def _producer(block: dict) -> dict[str, Any] | None:
    return block.get("producer") if isinstance(block.get("producer"), dict) else None


def _with_algo(cfg: QuantConfig, q: dict, where: str, key: str, findings: Findings) -> QuantConfig:
    """``cfg`` with quant_algo parsed from ``q`` (CFG001 when missing: ``key`` is how the file spells it)."""
    if "quant_algo" not in q:
        findings.add("CFG001", where, f"{key} is missing")
    else:
        cfg.algo = _parse_algo(q["quant_algo"], where, "quant_algo", findings)
        cfg.raw_algo = q["quant_algo"] if isinstance(q["quant_algo"], str) else None
    return cfg


def parse_hf_quant_config(raw: Any, findings: Findings) -> QuantConfig | None:
    """``hf_quant_config.json``: {"producer", "quantization": {quant_algo, kv_cache_quant_algo, …}}."""
    where = HF_QUANT_CONFIG
    if not isinstance(raw, dict):
        findings.add("CFG002", where, "top level must be a JSON object")
        return None
    q = raw.get("quantization")
    if q is None:
        findings.add("CFG001", where, "no \"quantization\" object")
        return None
    if not isinstance(q, dict):
        findings.add("CFG002", where, "\"quantization\" must be an object")
        return None
    cfg = _with_algo(QuantConfig(origin=where, producer=_producer(raw)), q, where, "quantization.quant_algo", findings)
    kv = q.get("kv_cache_quant_algo")
    if kv is not None and not isinstance(kv, str):
        findings.add("CFG002", where, "kv_cache_quant_algo must be a string or null")
    else:
        cfg.kv_cache_algo = kv.upper() if kv else None
    cfg.group_size = _parse_group_size(q.get("group_size"), where, findings, cfg.algo)
    cfg.exclude_modules = _parse_exclude(q.get("exclude_modules"), where, "exclude_modules", findings)
    if cfg.algo in (Algo.NVFP4, Algo.W4A16_NVFP4):
        # vLLM's ModelOptNvFp4Config.from_config refuses the checkpoint without these keys.
        for key in ("group_size", "kv_cache_quant_algo", "exclude_modules"):
            if key not in q:
                findings.add("CFG001", where, f"NVFP4 requires quantization.{key}",
                             hint="the engine refuses NVFP4 checkpoints without it")
    if cfg.algo is Algo.MIXED_PRECISION:
        if "quantized_layers" not in q:
            findings.add("CFG001", where, "MIXED_PRECISION requires quantization.quantized_layers")
        else:
            cfg.quantized_layers = _parse_layers(q["quantized_layers"], where, findings)
    return cfg


KV_ALGOS = ("FP8", "NVFP4", "NVFP4_AFFINE")  # the KV-cache algorithms ModelOpt 0.47 writes


def _kv_from_scheme(scheme: Any, where: str, findings: Findings) -> str | None:
    """config.json's ``kv_cache_scheme``: an object ({num_bits 8 | 4, type float}, SEMANTICS §16.1) or, as
    ModelOpt 0.47 writes NVFP4 KV, the algorithm's name as a bare string."""
    if scheme is None:
        return None
    if isinstance(scheme, str) and scheme.upper() in KV_ALGOS:
        return scheme.upper()
    if isinstance(scheme, dict) and scheme.get("type") == "float" and scheme.get("num_bits") in (8, 4):
        return "FP8" if scheme["num_bits"] == 8 else "NVFP4"
    findings.add("CFG003", where, f"unknown kv_cache_scheme {_show(scheme)}",
                 hint='ModelOpt writes {"num_bits": 8, "type": "float"} (FP8) or "NVFP4"')
    return None


ConfigParser = Callable[[dict, str, Findings], QuantConfig]


def parse_config_json(raw: Any, findings: Findings, formats: dict[str, ConfigParser] | None = None) -> QuantConfig | None:
    """``config.json["quantization_config"]``: quant_method "modelopt" (or vLLM's "fp8"), else the parser
    ``formats`` registers for it (``mocli.checkpoint.FORMATS``: compressed-tensors); None if absent."""
    if not isinstance(raw, dict):
        findings.add("CFG002", CONFIG_JSON, "top level must be a JSON object")
        return None
    q = raw.get("quantization_config")
    if q is None:
        return None
    where = f"{CONFIG_JSON}: quantization_config"
    if not isinstance(q, dict):
        findings.add("CFG002", where, "must be an object")
        return None
    method = q.get("quant_method")
    if method == "fp8":
        return _parse_fp8(q, where, findings)
    if formats and method in formats:
        return formats[method](q, where, findings)
    if not isinstance(method, str) or method not in MODELOPT_METHODS:
        findings.add("CFG005", where, f"quant_method is {method!r}, not a ModelOpt checkpoint",
                     hint="mocli handles checkpoints exported by NVIDIA ModelOpt")
        return None
    cfg = _with_algo(QuantConfig(origin=CONFIG_JSON, producer=_producer(q)), q, where, "quant_algo", findings)
    if "kv_cache_quant_algo" in q:
        kv = q["kv_cache_quant_algo"]
        cfg.kv_cache_algo = kv.upper() if isinstance(kv, str) else None
    else:
        cfg.kv_cache_algo = _kv_from_scheme(q.get("kv_cache_scheme"), where, findings)
    # vLLM 0.33 reads ``ignore``, else ``exclude_modules``: ModelOpt exports use either key across versions
    key = "ignore" if "ignore" in q or "exclude_modules" not in q else "exclude_modules"
    cfg.exclude_modules = _parse_exclude(q.get(key), where, key, findings)
    if cfg.algo in (Algo.NVFP4, Algo.W4A16_NVFP4):
        cfg.group_size = _config_groups_group_size(q.get("config_groups"), where, findings)
    if cfg.algo is Algo.NVFP4 and _weight_only(q.get("config_groups")):
        # vLLM 0.33 ModelOptNvFp4Config._from_config: NVFP4 whose every group quantizes no input
        # activations is served weight-only (SEMANTICS §13.1)
        cfg.algo = Algo.W4A16_NVFP4
    if cfg.algo is Algo.MIXED_PRECISION and "quantized_layers" in q:
        cfg.quantized_layers = _parse_layers(q["quantized_layers"], where, findings)
    return cfg


def _parse_fp8(q: dict, where: str, findings: Findings) -> QuantConfig:
    """vLLM's serialized FP8 format (vllm Fp8Config.from_config: quant_method, activation_scheme,
    ignored_layers, else modules_to_not_convert, weight_block_size): per-tensor FP8 weights with static or
    dynamic activations (what mocli quantize writes), or 128x128 blocks (``weight_scale_inv``, dynamic
    per-token-group activations: DeepSeek-V3's and Qwen3's FP8 releases, SEMANTICS §18.4)."""
    cfg = QuantConfig(origin=CONFIG_JSON, algo=Algo.FP8, method="fp8")
    scheme = q.get("activation_scheme")
    if scheme is None:
        findings.add("CFG001", where, "fp8 quantization_config has no activation_scheme",
                     hint='the engine refuses it; add "activation_scheme": "dynamic" (or "static")')
    elif scheme not in ("dynamic", "static"):
        findings.add("CFG002", where, f"activation_scheme {_show(scheme)} is neither dynamic nor static")
    cfg.dynamic_activations = scheme == "dynamic"
    block = q.get("weight_block_size")
    if block is not None:
        if block != [128, 128]:
            findings.add("CFG003", where, f"weight_block_size {_show(block)} is not a block size mocli reads",
                         hint="mocli reads 128x128 blocks, what the engines' block FP8 kernels take")
        elif scheme == "static":
            findings.add("CFG002", where, "weight_block_size with a static activation_scheme",
                         hint='vLLM refuses it: block FP8 quantizes activations per token group ("dynamic")')
        cfg.algo = Algo.FP8_PB_WO
    key = "ignored_layers" if q.get("ignored_layers") or "modules_to_not_convert" not in q else "modules_to_not_convert"
    cfg.exclude_modules = _parse_exclude(q.get(key), where, key, findings)
    prov = q.get("mocli")
    cfg.producer = {"name": "mocli quantize", "version": prov.get("version")} if isinstance(prov, dict) else None
    return cfg


def _weight_only(groups: Any) -> bool:
    """config_groups present, and not one of them quantizes input activations."""
    if not isinstance(groups, dict) or not groups:
        return False
    return all(isinstance(g, dict) and g.get("input_activations") is None for g in groups.values())


def _config_groups_group_size(groups: Any, where: str, findings: Findings) -> int:
    # config.json has no top-level group_size: it is in config_groups.*.weights, default 16.
    sizes = set()
    if isinstance(groups, dict):
        for g in groups.values():
            w = g.get("weights") if isinstance(g, dict) else None
            if isinstance(w, dict) and "group_size" in w:
                if not _is_int(w["group_size"]):
                    findings.add("CFG002", where, f"config_groups group_size must be an integer, got "
                                 f"{_show(w['group_size'])}", hint=f"NVFP4 uses blocks of {NVFP4_GROUP_SIZE}")
                    continue
                sizes.add(w["group_size"])
    if len(sizes) > 1:
        findings.add("CFG002", where, f"config_groups use several group sizes {sorted(sizes)}")
    return _parse_group_size(sizes.pop(), where, findings) if sizes else NVFP4_GROUP_SIZE


def reconcile(hf: QuantConfig | None, cj: QuantConfig | None, findings: Findings) -> QuantConfig | None:
    """The effective config (hf_quant_config.json wins, as in vLLM) and CFG004 for disagreements; a
    compressed-tensors config.json wins over a ModelOpt hf_quant_config.json left beside it (CFG007)."""
    if hf is not None and cj is not None and cj.method not in MODELOPT_METHODS | {"fp8"}:
        findings.add("CFG007", HF_QUANT_CONFIG, f"ignored: config.json's quant_method is {cj.method}, which engines "
                     f"read instead (a ModelOpt file the {cj.method} conversion left behind)",
                     hint=f"delete {HF_QUANT_CONFIG} so no tool reads the stale ModelOpt settings")
        return cj
    if hf is not None and cj is not None:
        pairs = [
            ("quant_algo", hf.algo, cj.algo),
            ("kv cache algorithm", hf.kv_cache_algo, cj.kv_cache_algo),
            # Engines test membership, so order and repeated entries do not change what is excluded.
            ("exclude_modules / ignore", sorted(set(hf.exclude_modules)), sorted(set(cj.exclude_modules))),
        ]
        if hf.algo in (Algo.NVFP4, Algo.W4A16_NVFP4) and hf.group_size is not None:
            pairs.append(("group_size", hf.group_size, cj.group_size))
        if hf.algo is Algo.MIXED_PRECISION and cj.quantized_layers:
            pairs.append(("quantized_layers", hf.quantized_layers, cj.quantized_layers))
        for what, a, b in pairs:
            if a != b:
                findings.add("CFG004", f"{HF_QUANT_CONFIG} vs {CONFIG_JSON}",
                             f"{what} differs: {_show(a)} vs {_show(b)}",
                             hint="engines read hf_quant_config.json first; make both files agree")
    return hf if hf is not None else cj


def _show(v: Any) -> str:
    s = str(v) if not isinstance(v, StrEnum) else v.value
    return s if len(s) <= 120 else s[:117] + "..."
