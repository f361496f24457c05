"""``mocli repair``'s output: a ModelOpt export, as engines load it, with its quantization fields
reconciled in both config files (SEMANTICS §11).

The shards keep the source's names, order and metadata; the index keeps the source's own fields.
Both config files get the same ``mocli_repair`` provenance block, with every output shard's digest.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mocli.formats import HF_QUANT_CONFIG, INDEX_NAME, copy_configs, write_json

PROVENANCE_KEY = "mocli_repair"


def quant_fields_editor(fields: dict[str, Any]) -> Callable[[str, dict], None]:
    """Targeted edits of both files: only the quantization fields; everything else as exported."""

    def edit(name: str, data: dict) -> None:
        if name == HF_QUANT_CONFIG:
            q = data.setdefault("quantization", {})
            for key in ("quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules", "quantized_layers"):
                if key in fields:
                    q[key] = fields[key]
        else:
            q = data.get("quantization_config")
            if not isinstance(q, dict):
                return
            if "quant_algo" in fields:
                q["quant_algo"] = fields["quant_algo"]
            q["ignore"] = fields["exclude_modules"]
            if fields.get("kv_cache_quant_algo") == "FP8":
                q.pop("kv_cache_quant_algo", None)
                q["kv_cache_scheme"] = q.get("kv_cache_scheme") if isinstance(q.get("kv_cache_scheme"), dict) else {
                    "dynamic": False, "num_bits": 8, "type": "float"}
            if "quantized_layers" in fields:
                q["quantized_layers"] = fields["quantized_layers"]
            if "group_size" in fields:
                for g in (q.get("config_groups") or {}).values():
                    if isinstance(g, dict) and isinstance(g.get("weights"), dict):
                        g["weights"]["group_size"] = fields["group_size"]

    return edit


def write_modelopt(directory: Path, source_dir: Path, layout, sharded: bool, fields: dict[str, Any],
                   provenance: dict[str, Any]) -> None:
    """Index (a sharded source's, with the new weight map) and both configs of a repair output."""
    from mocli.io.jsonfile import read_json

    if sharded:
        index = read_json(source_dir / INDEX_NAME)
        index = index if isinstance(index, dict) else {}
        meta = index.get("metadata") if isinstance(index.get("metadata"), dict) else {}
        total = sum(t.nbytes for f in layout.files for t in f.tensors)
        write_json(directory / INDEX_NAME, {**index, "metadata": {**meta, "total_size": total},
                                            "weight_map": layout.weight_map()})
    copy_configs(source_dir, directory, provenance, key=PROVENANCE_KEY, edit=quant_fields_editor(fields))


def provenance_of(path: Path) -> dict[str, Any] | None:
    """The ``mocli_repair`` block of a repair output (None: not a directory mocli repair wrote)."""
    from mocli.formats import CONFIG_JSON
    from mocli.io.jsonfile import read_json

    for name in (HF_QUANT_CONFIG, CONFIG_JSON):
        f = Path(path) / name
        if not f.is_file():
            continue
        data = read_json(f)
        block = data.get("quantization_config") if name == CONFIG_JSON and isinstance(data, dict) else data
        if isinstance(block, dict) and isinstance(block.get(PROVENANCE_KEY), dict):
            return block[PROVENANCE_KEY]
    return None
