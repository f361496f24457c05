"""``mocli quantize``'s output: vLLM/SGLang's serialized FP8 format (SEMANTICS §12).

``config.json`` gets ``quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic",
"ignored_layers": [...]}`` and the ``mocli`` provenance block (with every output shard's digest);
the shards keep the Hugging Face index layout. Engines load it with no flag.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mocli.formats import CONFIG_JSON, copy_configs, write_index

QUANT_METHOD = "fp8"


def quantization_config(ignored_layers: list[str]) -> dict[str, Any]:
    return {"quant_method": QUANT_METHOD, "activation_scheme": "dynamic", "ignored_layers": list(ignored_layers)}


def write_fp8(directory: Path, source_dir: Path, layout, ignored_layers: list[str],
              provenance: dict[str, Any]) -> None:
    """Index and configs of a quantize output (``layout``: its one ShardLayout)."""
    write_index(directory, layout.weight_map(), sum(t.nbytes for f in layout.files for t in f.tensors))

    def edit(name: str, data: dict) -> None:
        data["quantization_config"] = quantization_config(ignored_layers)

    copy_configs(source_dir, directory, provenance, edit=edit)


def provenance_of(path: Path) -> dict[str, Any] | None:
    """The ``mocli`` block of a quantize output's config.json (None: not a directory quantize wrote)."""
    from mocli.io.jsonfile import read_json

    cfg = Path(path) / CONFIG_JSON
    if not cfg.is_file():
        return None
    data = read_json(cfg)
    q = data.get("quantization_config") if isinstance(data, dict) else None
    if isinstance(q, dict) and q.get("quant_method") == QUANT_METHOD and isinstance(q.get("mocli"), dict):
        return q["mocli"]
    return None
