"""Output formats: what mocli writes, and reads back, beside the tensors.

A checkpoint directory in the Hugging Face layout (this module: file names, the index, both config
files, provenance), and one sibling module per format that mocli writes into it:

- ``layout``: ``mocli convert``'s kernel-ready layout (``mocli-layout.json``, per-rank directories);
- ``modelopt``: ``mocli repair``'s output, a ModelOpt export with its quantization fields reconciled;
- ``fp8``: ``mocli quantize``'s output, the engines' serialized FP8 format.

A new output format is a new sibling. Nothing here imports torch: inspect and validate read the
file names too.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Any

from mocli.io.hf_names import CONFIG_JSON, HF_QUANT_CONFIG, INDEX_NAME, SINGLE_NAME  # noqa: F401 - re-exported


class DirKind(StrEnum):
    """What a directory is, to mocli (``detect``)."""

    LAYOUT = "mocli convert output"  # ``layout``: a manifest
    QUANTIZED = "mocli quantize output"  # ``fp8``: config.json's quantization_config carries mocli's provenance
    REPAIRED = "mocli repair output"  # ``modelopt``: a ``mocli_repair`` provenance block
    CHECKPOINT = "checkpoint"  # anything else: a source to read


def detect(path: Path) -> DirKind:
    """The one answer to "what is this directory?", from its small files only."""
    from mocli.formats import fp8, layout, modelopt

    if layout.is_layout(path):
        return DirKind.LAYOUT
    if fp8.provenance_of(path) is not None:
        return DirKind.QUANTIZED
    if modelopt.provenance_of(path) is not None:
        return DirKind.REPAIRED
    return DirKind.CHECKPOINT


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def write_index(directory: Path, weight_map: dict[str, str], total_size: int, **metadata: Any) -> None:
    """``model.safetensors.index.json``: tensor -> shard file, and the total size of the tensors."""
    write_json(directory / INDEX_NAME, {"metadata": {"total_size": total_size, **metadata}, "weight_map": weight_map})


def provenance_block(source, digests: dict[str, str], **extra: Any) -> dict[str, Any]:
    """What every output records about how it was made: mocli's version, the source (a path, or a Hub
    repo id and revision), each source shard's digest, and the command's own fields."""
    from mocli import __version__

    return {"version": __version__, **extra,
            "source": ({"repo_id": source.repo_id, "revision": source.revision} if source.repo_id
                       else {"path": str(source.path)}),
            "source_shards": digests}


def source_spec(provenance: dict[str, Any], override: str | None = None) -> str | None:
    """The MODEL argument that reopens an output's source: ``override`` (``--source``), else what the
    provenance recorded (None when it recorded nothing usable)."""
    if override:
        return override
    recorded = provenance.get("source") if isinstance(provenance, dict) else None
    if not isinstance(recorded, dict):
        return None
    if isinstance(recorded.get("path"), str):
        return recorded["path"]
    if isinstance(recorded.get("repo_id"), str) and isinstance(recorded.get("revision"), str):
        return f"{recorded['repo_id']}@{recorded['revision']}"
    return None


def copy_configs(src: Path, dest: Path, provenance: dict[str, Any], key: str = "mocli",
                 edit: Callable[[str, dict], None] | None = None, only_config_json: bool = False) -> None:
    """Both config files with the provenance block under ``key`` (and ``edit`` applied; with
    ``only_config_json`` hf_quant_config.json is left out), other small files (tokenizer, generation
    config) as they are."""
    from mocli.io.jsonfile import read_json

    if (src / HF_QUANT_CONFIG).exists() and not only_config_json:
        hq = read_json(src / HF_QUANT_CONFIG)
        if isinstance(hq, dict):
            if edit is not None:
                edit(HF_QUANT_CONFIG, hq)
            hq[key] = provenance
        write_json(dest / HF_QUANT_CONFIG, hq)
    if (src / CONFIG_JSON).exists():
        cfg = read_json(src / CONFIG_JSON)
        if isinstance(cfg, dict):
            if edit is not None:
                edit(CONFIG_JSON, cfg)
            if isinstance(cfg.get("quantization_config"), dict):  # this run's, also over an earlier run's
                cfg["quantization_config"][key] = provenance
        write_json(dest / CONFIG_JSON, cfg)
    skip = {INDEX_NAME, HF_QUANT_CONFIG, CONFIG_JSON}
    for p in sorted(src.iterdir()):
        if p.is_file() and p.suffix != ".safetensors" and p.name not in skip and not p.name.startswith(".mocli"):
            shutil.copyfile(p, dest / p.name)
