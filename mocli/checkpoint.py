"""A checkpoint directory: safetensors headers, the shard index and both config files.

Nothing here reads tensor data; ``Checkpoint.reader()`` does that on demand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mocli import compressed_tensors, gpt_oss, quark
from mocli.errors import InputError
from mocli.findings import Findings
from mocli.formats import CONFIG_JSON, HF_QUANT_CONFIG, INDEX_NAME, SINGLE_NAME, DirKind, detect
from mocli.formats.index import read_index
from mocli.io.bulk import paused_gc
from mocli.io.jsonfile import read_json
from mocli.io.safetensors_file import SafetensorsHeader, TensorEntry, TensorReader, read_header
from mocli.io.source import Source, resolve_source
from mocli.quant_config import (
    Algo,
    ConfigParser,
    QuantConfig,
    parse_config_json,
    parse_hf_quant_config,
    reconcile,
)
from mocli.schemes.gpt_oss import GPT_OSS
from mocli.schemes.spelling import COMPRESSED_TENSORS, MODELOPT, QUARK, VLLM_FP8, Spelling


@dataclass(frozen=True)
class InputFormat:
    """A config.json quant_method read beside ModelOpt's own: how its tensors are named and, unless
    ``mocli.quant_config`` reads its config itself (vLLM's fp8), its config parser."""

    spelling: Spelling
    parse: ConfigParser | None = None


# The one registry of input formats: quant_method -> its format (anything else: ModelOpt's names)
INPUT_FORMATS: dict[str, InputFormat] = {
    compressed_tensors.METHOD: InputFormat(COMPRESSED_TENSORS, compressed_tensors.parse),
    VLLM_FP8.name: InputFormat(VLLM_FP8),
    quark.METHOD: InputFormat(QUARK, quark.parse),
    gpt_oss.METHOD: InputFormat(GPT_OSS, gpt_oss.parse),
}
# derived: the config parsers ``parse_config_json`` takes
FORMATS: dict[str, ConfigParser] = {m: f.parse for m, f in INPUT_FORMATS.items() if f.parse is not None}


def spelling_of(method: str | None) -> Spelling:
    """The tensors' names of a checkpoint whose quant_method is ``method``."""
    fmt = INPUT_FORMATS.get(method or "")
    return fmt.spelling if fmt is not None else MODELOPT


@dataclass
class Checkpoint:
    source: Source
    files: list[SafetensorsHeader]
    tensors: dict[str, TensorEntry]
    config: dict[str, Any]
    hf_quant_config: QuantConfig | None
    config_quant: QuantConfig | None
    quant: QuantConfig | None  # the effective one (hf_quant_config.json wins)
    config_findings: Findings = field(default_factory=Findings)
    sharded: bool = False

    @property
    def path(self) -> Path:
        return self.source.path

    @property
    def total_bytes(self) -> int:
        return sum(h.size for h in self.files)

    @property
    def has_fp8_weights(self) -> bool:
        """Whether any weight is stored as FP8 (its conversion checks and requantizes every byte)."""
        return any(e.dtype == "F8_E4M3" and n.endswith(".weight") for n, e in self.tensors.items())

    @property
    def architecture(self) -> str | None:
        archs = self.config.get("architectures")
        return archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None

    def reader(self) -> TensorReader:
        return TensorReader()

    def census(self):
        """The census of this checkpoint's tensors, each module bound to its scheme with the config's
        help where the tensors alone do not tell (``mocli.schemes.bind``)."""
        from mocli.census import build_census

        quant = self.quant
        return build_census(self.tensors, spelling_of(quant.method if quant else None),
                            configured=quant.algo_for if quant is not None else None)

    def require_quant_method(self, verb: str, also: tuple[str, ...] = ()) -> None:
        """The checkpoint's quant_method is ModelOpt's or one of ``also`` (unquantized passes): repair reads
        ModelOpt exports, convert also compressed-tensors and vLLM's block fp8 (``require_convertible``);
        vLLM's per-tensor fp8 format (mocli quantize's output) is served as is."""
        if self.quant is not None and self.quant.method not in ("modelopt", *also):
            hint = ("a per-tensor fp8 checkpoint (mocli quantize's output) is served as it is; mocli verify checks it"
                    if self.quant.method == "fp8" else f"mocli validate checks it; mocli convert reads {self.quant.method} too"
                    if verb != "convert" else "mocli validate says what it holds")
            raise InputError(f"{self.path}: quant_method {self.quant.method} is not a ModelOpt export; {verb} reads "
                             "ModelOpt checkpoints" + (f" and {', '.join(also)}" if also else ""), hint=hint)

    def require_convertible(self) -> None:
        """convert reads ModelOpt, compressed-tensors, Quark and gpt-oss MXFP4, and vLLM's block fp8 (a
        per-tensor fp8 one, mocli quantize's output, serves as it is)."""
        block_fp8 = self.quant is not None and self.quant.algo is Algo.FP8_PB_WO
        # Quark and gpt-oss's native format: MXFP4 (the only scheme mocli reads in them; validate refuses the rest)
        self.require_quant_method("convert", also=(compressed_tensors.METHOD, quark.METHOD, gpt_oss.METHOD,
                                                   *(("fp8",) if block_fp8 else ())))


def open_checkpoint(spec: str | Path) -> Checkpoint:
    """Resolve ``spec`` and read every header; raise InputError/CorruptFileError when unusable."""
    with paused_gc():
        return _open(spec)


def _open(spec: str | Path) -> Checkpoint:
    source = resolve_source(str(spec))
    root = source.path
    if detect(root) is DirKind.LAYOUT:
        raise InputError(f"{root}: this is a mocli-converted checkpoint (kernel layout), not a ModelOpt export",
                         hint="inspect/validate/convert its source; check it with mocli verify")
    if (root / INDEX_NAME).exists():
        files, tensors = read_index(root)
        sharded = True
    else:
        single = root / SINGLE_NAME
        candidates = [single] if single.exists() else sorted(root.glob("*.safetensors"))
        if len(candidates) != 1:
            if not candidates:
                raise InputError(f"{root}: no safetensors weights found",
                                 hint=f"expected {SINGLE_NAME} or {INDEX_NAME}")
            raise InputError(f"{root}: {len(candidates)} safetensors files but no {INDEX_NAME}",
                             hint="a sharded checkpoint needs its index")
        header = read_header(candidates[0])
        files, tensors = [header], dict(header.tensors)
        sharded = False

    findings = Findings()
    config: dict[str, Any] = {}
    config_quant = hf_quant = None
    if (root / CONFIG_JSON).exists():
        raw = read_json(root / CONFIG_JSON)
        config = raw if isinstance(raw, dict) else {}
        config_quant = parse_config_json(raw, findings, FORMATS)
    if (root / HF_QUANT_CONFIG).exists():
        hf_quant = parse_hf_quant_config(read_json(root / HF_QUANT_CONFIG), findings)
    if hf_quant is None and config_quant is None and not findings:
        findings.add("CFG005", str(root), "neither hf_quant_config.json nor config.json quantization_config found",
                     hint="is this a ModelOpt export?")
    quant = reconcile(hf_quant, config_quant, findings)
    if quant is not None and quant.resolver is not None:  # every module's pattern match once, timeouts named now
        quant.resolver.prime({n.rpartition(".")[0] for n in tensors}, findings)
    return Checkpoint(source, files, tensors, config, hf_quant, config_quant, quant, findings, sharded)
