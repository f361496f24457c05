"""``mocli convert``'s kernel-ready layout: the one place that writes and reads it (LAYOUT.md).

Files: the shards of every output group (the top level, ``rank-R/`` per rank of a --tp/--ep output),
an index per group, and the manifest ``mocli-layout.json`` (modules and tensors per rank, the
files' digests, provenance). ``rank_entries`` is "the tensors of rank R": the loader, verify and
the vLLM plugin all read a rank through it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from mocli.errors import InputError
from mocli.formats import write_index, write_json
from mocli.formats.manifest import (  # noqa: F401 - re-exported: the layout's names, in one place
    FORMAT,
    MANIFEST_NAME,
    READABLE_VERSIONS,
    Layout,
    group_entries,
    manifest_json,
    shared_entries,
    with_own,
)
from mocli.io.paths import entry_path

# Any change to names, dtypes, shapes or byte order bumps it. 2: config.json declares quant_method
# "mocli" (an engine without mocli's plugin refuses the directory instead of mis-loading it), no
# hf_quant_config.json, and ``files`` covers every file but the manifest itself.
LAYOUT_VERSION = 2
QUANT_METHOD = "mocli"  # config.json quantization_config.quant_method of a converted directory


def rank_dir(parallel, rank: int) -> str:
    """Directory of a rank's files, relative to OUT ("" when there is one rank: the tp = 1 layout)."""
    return "" if parallel.single else f"rank-{rank}"


# --- writing ---------------------------------------------------------------------------------------

# What the vLLM plugin does where vLLM's behaviour depends on its release, per release series it is tested
# with: the KV-cache dtype ``--kv-cache-dtype auto`` gives a source's ModelOpt KV-cache algorithm (vLLM's
# MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP, the same in 0.32 and 0.33), and who runs MoE layers (mocli's own
# kernels: vLLM's MoE backends, and --moe-backend, do not touch a converted layer).
VLLM_RELEASES = ("0.32", "0.33")
VLLM_KV_CACHE_DTYPES = {"FP8": "fp8_e4m3", "NVFP4": "nvfp4"}


def serving_rules(kv_cache_algo: str | None) -> dict[str, Any]:
    """The manifest's ``serving`` block: which engine rules the output was written for (LAYOUT.md)."""
    return {"vllm": {"releases": list(VLLM_RELEASES),
                     "kv_cache_dtype": VLLM_KV_CACHE_DTYPES.get((kv_cache_algo or "").upper(), "auto"),
                     "moe": "mocli kernels (vLLM's MoE backends and --moe-backend are not used)"}}


def manifest_body(plan, target: str, parallel, kv_cache_algo: str | None = None) -> Layout:
    """The manifest without ``files`` and ``provenance``, as the ``Layout`` it will read back as: modules
    and tensors per rank, shared ones once, and the engine rules it was written for (``serving``).
    Built through the reader's own checks, so what is written is what reads."""
    from mocli.formats.manifest import ModuleEntry, Parallelism, RankEntry, TensorInfo, VllmRules
    from mocli.targets import Target

    def tensors(group: str) -> dict[str, TensorInfo]:
        return TensorInfo.table({t.name: t.to_dict() for t in plan.tensors.values() if t.group == group},
                                f"{group or 'top level'} tensors")

    def modules(group: str) -> tuple[ModuleEntry, ...]:
        return tuple(ModuleEntry.from_json(m.to_dict(), f"module {m.name}") for m in plan.modules if m.group == group)

    vllm = serving_rules(kv_cache_algo)["vllm"]
    par = parallel.to_dict()
    ranks = () if parallel.single else tuple(
        RankEntry(r, parallel.tp_rank(r), rank_dir(parallel, r), modules(rank_dir(parallel, r)),
                  tensors(rank_dir(parallel, r))) for r in range(parallel.ranks))
    return Layout(LAYOUT_VERSION, Target(str(target)), Parallelism(par["tp"], par["ep"], par["ranks"], par["moe"]),
                  VllmRules(tuple(vllm["releases"]), vllm["kv_cache_dtype"], vllm["moe"]), modules(""), tensors(""),
                  ranks)


def quantization_config(body: Layout, source_config: Any, source_hf_quant: Any,
                        provenance: dict[str, Any]) -> dict[str, Any]:
    """config.json's ``quantization_config`` of a converted directory: the method engines dispatch on
    (``mocli``: only mocli's plugin loads it), what the layout is, and the source's ModelOpt settings."""
    return {"quant_method": QUANT_METHOD, "layout": MANIFEST_NAME, **shared_fields(body),
            "source_quantization_config": source_config, "source_hf_quant_config": source_hf_quant,
            "mocli": provenance}


def shared_fields(layout: Layout) -> dict[str, Any]:
    """The layout fields config.json's quantization_config repeats from the manifest (layout_version 2),
    as both write them."""
    return {"layout_version": layout.version, "target": str(layout.target), "parallel": layout.parallel.to_json()}


def write_layout(directory: Path, source_dir: Path, body: Layout, layouts: dict, digests: dict[str, str],
                 provenance: dict[str, Any]) -> None:
    """Everything around the shards: every group's index, config.json marked as a mocli layout, the
    source's other small files (tokenizer, generation config), then the manifest with the size and
    digest record of every file in the directory but itself (shards: ``digests``, taken as they were
    written)."""
    from mocli.formats import CONFIG_JSON, HF_QUANT_CONFIG, copy_configs
    from mocli.io.digests import DIGEST, file_digest
    from mocli.io.jsonfile import read_json

    for group, lay in layouts.items():
        d = directory / group if group else directory
        write_index(d, lay.weight_map(), sum(t.nbytes for f in lay.files for t in f.tensors),
                    mocli_layout=MANIFEST_NAME)
    hq = read_json(source_dir / HF_QUANT_CONFIG) if (source_dir / HF_QUANT_CONFIG).exists() else None

    def mark(name: str, data: dict) -> None:
        if name == CONFIG_JSON:
            data["quantization_config"] = quantization_config(body, data.get("quantization_config"), hq, provenance)

    copy_configs(source_dir, directory, provenance, edit=mark, only_config_json=True)
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and not p.name.startswith(".")):
        rel = str(path.relative_to(directory))
        if rel == MANIFEST_NAME:  # an earlier finish of a resumed run wrote one: it is rewritten below
            continue
        files[rel] = {"size": path.stat().st_size, **(digests.get(rel) or {DIGEST: file_digest(path, follow=False)})}
    write_json(directory / MANIFEST_NAME, manifest_json(replace(body, files=files, provenance=provenance)))


# --- reading ---------------------------------------------------------------------------------------
# A converted directory may have been downloaded or edited: every field is checked for its type
# before anything uses it, every name read from it resolves inside OUT (io.paths), and a rank's
# tensors are exactly what its index names (no file outside the index, no tensor twice).

def is_layout(path: Path) -> bool:
    return (Path(path) / MANIFEST_NAME).exists()


def read_layout(path: Path) -> Layout:
    """The manifest of a converted directory as a ``Layout``, every field checked (exit 2 naming the
    field); InputError where there is none."""
    from mocli.io.jsonfile import read_json

    mpath = Path(path) / MANIFEST_NAME
    if not mpath.exists() and not mpath.is_symlink():
        raise InputError(f"{path}: no {MANIFEST_NAME}; not a mocli-converted checkpoint",
                         hint="run mocli convert first")
    return Layout.parse(read_json(mpath, follow=False), mpath, Path(path))


def rank_entries(path: Path, layout: Layout, rank: int | None) -> dict:
    """The tensors of one rank in the directory ``path``: the shared top-level ones plus the rank
    directory's, by name. A name in both is refused: a rank never redefines a shared tensor."""
    return with_own(Path(path), shared_entries(path), layout.view(rank)[0])


def file_path(root: Path, name: str) -> Path:
    """An entry of the manifest's ``files`` as a path inside ``root`` (InputError otherwise)."""
    return entry_path(root, name, f"{Path(root) / MANIFEST_NAME}: files")
