"""A checkpoint directory: safetensors headers, the shard index and both config files.

Nothing here reads tensor data; ``Checkpoint.reader()`` does that on demand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mocli.errors import CorruptFileError, InputError
from mocli.findings import Findings
from mocli.formats import CONFIG_JSON, HF_QUANT_CONFIG, INDEX_NAME, SINGLE_NAME
from mocli.formats.layout import is_layout
from mocli.io.bulk import paused_gc
from mocli.io.jsonfile import read_json
from mocli.io.safetensors_file import SafetensorsHeader, TensorEntry, TensorReader, read_header
from mocli.io.source import Source, resolve_source
from mocli.quant_config import QuantConfig, parse_config_json, parse_hf_quant_config, reconcile


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
    def architecture(self) -> str | None:
        archs = self.config.get("architectures")
        return archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None

    def reader(self) -> TensorReader:
        return TensorReader()

    def require_modelopt(self, verb: str) -> None:
        """convert and repair read ModelOpt exports; vLLM's fp8 format (mocli quantize's output) is served as is."""
        if self.quant is not None and self.quant.method != "modelopt":
            raise InputError(f"{self.path}: quant_method {self.quant.method} is not a ModelOpt export; {verb} reads "
                             "ModelOpt checkpoints", hint="run mocli validate on it; a mocli quantize output is served "
                             "as it is (mocli verify checks it)")


def open_checkpoint(spec: str | Path) -> Checkpoint:
    """Resolve ``spec`` and read every header; raise InputError/CorruptFileError when unusable."""
    with paused_gc():
        return _open(spec)


def _open(spec: str | Path) -> Checkpoint:
    source = resolve_source(str(spec))
    root = source.path
    if is_layout(root):
        raise InputError(f"{root}: this is a mocli-converted checkpoint (kernel layout), not a ModelOpt export",
                         hint="inspect/validate/convert its source; check it with mocli verify")
    index_path = root / INDEX_NAME
    if index_path.exists():
        files, tensors = _read_sharded(root, index_path)
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
        config_quant = parse_config_json(raw, findings)
    if (root / HF_QUANT_CONFIG).exists():
        hf_quant = parse_hf_quant_config(read_json(root / HF_QUANT_CONFIG), findings)
    if hf_quant is None and config_quant is None and not findings:
        findings.add("CFG005", str(root), "neither hf_quant_config.json nor config.json quantization_config found",
                     hint="is this a ModelOpt export?")
    quant = reconcile(hf_quant, config_quant, findings)
    return Checkpoint(source, files, tensors, config, hf_quant, config_quant, quant, findings, sharded)


def _read_sharded(root: Path, index_path: Path) -> tuple[list[SafetensorsHeader], dict[str, TensorEntry]]:
    index = read_json(index_path, walk=False)  # fixed structure: weight_map is checked right here
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CorruptFileError(f"{index_path}: no \"weight_map\" object of tensor -> file name",
                               hint="the index is corrupt; download it again or delete it for a single-file checkpoint")
    headers: dict[str, SafetensorsHeader] = {}
    for fname in sorted(set(weight_map.values())):
        # Containment is judged on the names, not on where links point: a Hugging Face cache
        # snapshot is made of symlinks into ../../blobs/, and those are fine.
        parts = Path(fname).parts
        if not fname or Path(fname).is_absolute() or ".." in parts or "\0" in fname:
            raise InputError(f"{index_path}: weight_map entry {fname!r} points outside the model directory",
                             hint="shard names must be plain file names inside the checkpoint directory")
        fpath = root / fname
        if not fpath.is_file():
            why = "is a dangling or looping link" if fpath.is_symlink() else "does not exist"
            raise InputError(f"{index_path}: shard {fname!r} {why}",
                             hint="the download is incomplete; fetch the missing shard again")
        headers[fname] = read_header(fpath)
    # Fast path: per shard, the names the index maps to it equal the names in its header (set
    # comparisons in C); only a disagreement walks name by name to say which tensor is wrong.
    mapped: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        mapped.setdefault(fname, []).append(name)
    tensors: dict[str, TensorEntry] = {}
    for header in headers.values():
        tensors.update(header.tensors)
    if len(tensors) == len(weight_map) == sum(len(h.tensors) for h in headers.values()) and all(
            header.tensors.keys() == set(mapped.get(fname, ())) for fname, header in headers.items()):
        return list(headers.values()), tensors
    _explain_index_mismatch(root, index_path, headers, weight_map)
    raise AssertionError("unreachable: the index and the shards disagree")


def _explain_index_mismatch(root: Path, index_path: Path, headers: dict[str, SafetensorsHeader],
                            weight_map: dict[str, str]) -> None:
    owner: dict[str, str] = {}
    for fname, header in headers.items():
        for name in header.tensors:
            if name in owner:
                raise InputError(f"{root}: tensor '{name}' is stored in both {owner[name]} and {fname}",
                                 hint="the shards overlap; re-export the checkpoint")
            owner[name] = fname
    for name, fname in weight_map.items():
        if owner.get(name) != fname:
            where = f"is in {owner[name]}" if name in owner else "is in no shard"
            raise InputError(f"{index_path}: tensor '{name}' is mapped to {fname} but {where}",
                             hint="the index and the shards disagree")
    unmapped = set(owner) - set(weight_map)
    name = min(unmapped)
    raise InputError(f"{index_path}: tensor '{name}' in {owner[name]} is missing from the weight_map"
                     + (f" (and {len(unmapped) - 1} more)" if len(unmapped) > 1 else ""),
                     hint="the index and the shards disagree")
