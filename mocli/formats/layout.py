"""``mocli convert``'s kernel-ready layout: the one place that writes and reads it (LAYOUT.md).

Files: the shards of every output group (the top level, ``rank-R/`` per rank of a --tp/--ep output),
an index per group, and the manifest ``mocli-layout.json`` (modules and tensors per rank, the
files' digests, provenance). ``rank_entries`` is "the tensors of rank R": the loader, verify and
the vLLM plugin all read a rank through it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mocli.errors import CorruptFileError, InputError
from mocli.formats import INDEX_NAME, write_index, write_json
from mocli.io.digests import as_record
from mocli.io.paths import entry_path

MANIFEST_NAME = "mocli-layout.json"
FORMAT = "mocli-layout"
# Any change to names, dtypes, shapes or byte order bumps it. 2: config.json declares quant_method
# "mocli" (an engine without mocli's plugin refuses the directory instead of mis-loading it), no
# hf_quant_config.json, and ``files`` covers every file but the manifest itself.
LAYOUT_VERSION = 2
READABLE_VERSIONS = frozenset({1, 2})
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


def manifest_body(plan, target: str, parallel, kv_cache_algo: str | None = None) -> dict[str, Any]:
    """The manifest without ``files`` and ``provenance``: modules and tensors per rank, shared ones once,
    and the engine rules it was written for (``serving``)."""

    def tensors(group: str) -> dict[str, Any]:
        return {t.name: t.to_dict() for t in plan.tensors.values() if t.group == group}

    def modules(group: str) -> list[dict[str, Any]]:
        return [m.to_dict() for m in plan.modules if m.group == group]

    body: dict[str, Any] = {"format": FORMAT, "layout_version": LAYOUT_VERSION, "target": str(target),
                            "parallel": parallel.to_dict(), "serving": serving_rules(kv_cache_algo),
                            "modules": modules(""), "tensors": tensors("")}
    if not parallel.single:
        body["ranks"] = [{"rank": r, "tp_rank": parallel.tp_rank(r), "dir": rank_dir(parallel, r),
                          "modules": modules(rank_dir(parallel, r)), "tensors": tensors(rank_dir(parallel, r))}
                         for r in range(parallel.ranks)]
    return body


def quantization_config(body: dict[str, Any], source_config: Any, source_hf_quant: Any,
                        provenance: dict[str, Any]) -> dict[str, Any]:
    """config.json's ``quantization_config`` of a converted directory: the method engines dispatch on
    (``mocli``: only mocli's plugin loads it), what the layout is, and the source's ModelOpt settings."""
    return {"quant_method": QUANT_METHOD, "layout": MANIFEST_NAME, "layout_version": body["layout_version"],
            "target": body["target"], "parallel": body["parallel"],
            "source_quantization_config": source_config, "source_hf_quant_config": source_hf_quant,
            "mocli": provenance}


def write_layout(directory: Path, source_dir: Path, body: dict[str, Any], layouts: dict, digests: dict[str, str],
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
    write_json(directory / MANIFEST_NAME, {**body, "files": files, "provenance": provenance})


# --- reading ---------------------------------------------------------------------------------------
# A converted directory may have been downloaded or edited: every field is checked for its type
# before anything uses it, every name read from it resolves inside OUT (io.paths), and a rank's
# tensors are exactly what its index names (no file outside the index, no tensor twice).

def is_layout(path: Path) -> bool:
    return (Path(path) / MANIFEST_NAME).exists()


@dataclass
class Layout:
    """A converted directory with its manifest read and checked once (``read_layout``), handed to whatever
    reads its ranks; the tensors every rank shares (the top-level shards' headers) are read once too."""

    path: Path
    manifest: dict[str, Any]
    _shared: dict | None = field(default=None, repr=False)

    @property
    def ranks(self) -> list[int | None]:
        """The ranks to read: 0..R-1, or [None] for a one-rank output (the top level)."""
        return list(range(len(self.manifest["ranks"]))) if self.manifest.get("ranks") else [None]

    def view(self, rank: int | None) -> tuple[str, list[dict], dict[str, Any]]:
        return rank_view(self.manifest, rank)

    def entries(self, rank: int | None) -> dict:
        """``rank_entries``, with the shared top-level headers read once for every rank."""
        if self._shared is None:
            index = self.path / INDEX_NAME
            self._shared = group_entries(self.path, "") if index.exists() or index.is_symlink() else {}
        return _with_own(self.path, dict(self._shared), self.view(rank)[0])


def read_layout(path: Path) -> Layout:
    return Layout(Path(path), read_manifest(path))


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of a converted directory, its structure checked (CorruptFileError naming the field)."""
    from mocli.io.jsonfile import read_json

    mpath = Path(path) / MANIFEST_NAME
    if not mpath.exists() and not mpath.is_symlink():
        raise InputError(f"{path}: no {MANIFEST_NAME}; not a mocli-converted checkpoint",
                         hint="run mocli convert first")
    manifest = read_json(mpath, follow=False)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CorruptFileError(f"{mpath}: not a mocli layout manifest", hint="the file is damaged; convert again")
    if manifest.get("layout_version") not in READABLE_VERSIONS:
        raise InputError(f"{mpath}: layout_version {manifest.get('layout_version')!r} is not supported "
                         f"(this mocli reads {', '.join(map(str, sorted(READABLE_VERSIONS)))})",
                         hint="convert again with this mocli version")
    _check_manifest(manifest, mpath)
    return manifest


def _bad(where: str, what: str) -> CorruptFileError:
    return CorruptFileError(f"{where}: {what}", hint="the manifest is damaged or hostile; convert again")


def _is_int(v: Any, low: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _expect(value: Any, kind: type | tuple, where: str, what: str) -> Any:
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise _bad(where, f"{what} must be {getattr(kind, '__name__', kind)}, not {type(value).__name__}")
    return value


def _str_list(value: Any, where: str, what: str) -> None:
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise _bad(where, f"{what} must be a list of strings")


# meta keys the loader and verify read, with their types
_META_INTS = {"experts", "intermediate", "hidden", "n", "k", "padded_n", "padded_k", "expert_offset", "tp_rank",
              "experts_total", "intermediate_total", "padded_intermediate", "padded_hidden"}
_META_POWERS_OF_TWO = {"scale_factor", "scale_factor_w13", "scale_factor_w2"}  # the marlin target's
_META_INT_LISTS = {"shard_rows", "intermediate_slice", "block"}


def _check_module(m: Any, where: str) -> None:
    from mocli.kinds import ModuleKind

    _expect(m, dict, where, "a module")
    name = _expect(m.get("name"), str, where, "name")
    at = f"{where} ({name})"
    if m.get("kind") not in {k.value for k in ModuleKind}:
        raise _bad(at, f"kind {m.get('kind')!r} is not one this mocli knows")
    _expect(m.get("scheme"), str, at, "scheme")
    tensors = _expect(m.get("tensors"), dict, at, "tensors")
    if not all(isinstance(v, str) for v in tensors.values()):
        raise _bad(at, "tensors must map roles to tensor names")
    _str_list(m.get("sources"), at, "sources")
    meta = _expect(m.get("meta"), dict, at, "meta")
    for key, v in meta.items():
        if key in _META_INTS and not _is_int(v):
            raise _bad(at, f"meta.{key} must be a non-negative integer")
        if key in _META_INT_LISTS and not (isinstance(v, list) and all(_is_int(x) for x in v)):
            raise _bad(at, f"meta.{key} must be a list of non-negative integers")
        if key == "slices" and not (isinstance(v, list) and all(
                isinstance(x, list) and len(x) == 4 and all(_is_int(y) for y in x) for x in v)):
            raise _bad(at, "meta.slices must be [row0, row1, col0, col1] per shard")
        if key == "full" and not (isinstance(v, dict) and all(_is_int(v.get(d)) for d in ("n", "k"))):
            raise _bad(at, "meta.full must be {n, k}")
        if key in _META_POWERS_OF_TWO and not (isinstance(v, float) and 1 <= v <= 2.0**127 and math.frexp(v)[0] == 0.5):
            raise _bad(at, f"meta.{key} must be a power of two >= 1")
        if key == "act_dtype" and v not in ("bfloat16", "float16"):
            raise _bad(at, "meta.act_dtype must be bfloat16 or float16")
        if key in ("naming", "split") and not isinstance(v, str):
            raise _bad(at, f"meta.{key} must be a string")


def _check_tensors(tensors: Any, where: str) -> None:
    from mocli.io.safetensors_file import DTYPE_SIZES

    _expect(tensors, dict, where, "tensors")
    for name, t in tensors.items():
        at = f"{where}.{name}"
        _expect(t, dict, at, "a tensor entry")
        if t.get("dtype") not in DTYPE_SIZES:
            raise _bad(at, f"dtype {t.get('dtype')!r} is not a safetensors dtype")
        if not isinstance(t.get("shape"), list) or not all(_is_int(d) for d in t["shape"]):
            raise _bad(at, "shape must be a list of non-negative integers")
        _expect(t.get("role"), str, at, "role")
        _str_list(t.get("sources"), at, "sources")
        _str_list(t.get("transforms"), at, "transforms")


def _check_manifest(m: dict[str, Any], where: Path) -> None:
    from mocli.targets import Target

    at = str(where)
    _expect(m.get("target"), str, at, "target")
    if m["target"] not in {t.value for t in Target}:
        raise InputError(f"{at}: target {m['target']!r} is not one this mocli knows "
                         f"({', '.join(t.value for t in Target)})", hint="convert again with this mocli")
    par = _expect(m.get("parallel"), dict, at, "parallel")
    for key in ("tp", "ep", "ranks"):
        if not _is_int(par.get(key), 1):
            raise _bad(at, f"parallel.{key} must be a positive integer")
    ranks = m.get("ranks")
    if par["ranks"] == 1:
        if ranks is not None:
            raise _bad(at, "ranks[] is only written when parallel.ranks > 1")
        sections = [(m, f"{at}: ")]
    else:
        if not isinstance(ranks, list) or len(ranks) != par["ranks"]:
            raise _bad(at, f"parallel.ranks is {par['ranks']} but ranks[] lists "
                           f"{len(ranks) if isinstance(ranks, list) else 'none'}")
        for r, entry in enumerate(ranks):
            _expect(entry, dict, f"{at}: ranks[{r}]", "a rank entry")
            if entry.get("rank") != r or not _is_int(entry.get("tp_rank")) or entry.get("dir") != f"rank-{r}":
                raise _bad(f"{at}: ranks[{r}]", f"must be rank {r} in directory rank-{r} "
                                                f"(found rank {entry.get('rank')!r}, dir {entry.get('dir')!r})")
        sections = [(m, f"{at}: ")] + [(e, f"{at}: ranks[{r}].") for r, e in enumerate(ranks)]
    for section, prefix in sections:
        modules = section.get("modules", [])
        _expect(modules, list, prefix + "modules", "modules")
        for i, mod in enumerate(modules):
            _check_module(mod, f"{prefix}modules[{i}]")
        _check_tensors(section.get("tensors", {}), prefix + "tensors")
    files = m.get("files")
    if files is not None:
        _expect(files, dict, at, "files")
        for name, info in files.items():
            ok = isinstance(info, dict) and _is_int(info.get("size")) and as_record(info) is not None
            if not ok:
                raise _bad(f"{at}: files[{name!r}]", "must be {size, blake3} (or {size, sha256})")
    if not isinstance(m.get("provenance", {}), dict):
        raise _bad(at, "provenance must be an object")
    if not isinstance(m.get("serving", {}), dict):
        raise _bad(at, "serving must be an object")


def rank_view(manifest: dict[str, Any], rank: int | None) -> tuple[str, list[dict], dict[str, Any]]:
    """(directory, modules, tensors) of one rank; the top level for a one-rank output."""
    ranks = manifest.get("ranks")
    if not ranks:
        if rank not in (None, 0):
            raise InputError(f"rank {rank}: this output has one rank", hint="omit rank / --rank")
        return "", manifest["modules"], manifest["tensors"]
    if rank is None:
        raise InputError(f"this output has {len(ranks)} ranks (tp {manifest['parallel']['tp']}, "
                         f"ep {manifest['parallel']['ep']})", hint="pick one with rank=R (--rank R)")
    if not 0 <= rank < len(ranks):
        raise InputError(f"rank {rank}: this output has ranks 0..{len(ranks) - 1}", hint="pick an existing rank")
    r = ranks[rank]
    return r["dir"], r["modules"], r["tensors"]


def group_entries(root: Path, group: str) -> dict:
    """name -> TensorEntry of one output group (the top level "" or "rank-R"), exactly as its index says:
    every shard the index names (inside the group's directory, no link), each tensor in the one shard
    the index maps it to, and nothing else in those shards."""
    from mocli.formats.index import read_index

    directory = entry_path(root, group, MANIFEST_NAME) if group else Path(root)
    _, tensors = read_index(directory, follow=False)
    return tensors


def rank_entries(path: Path, manifest: dict[str, Any], rank: int | None) -> dict:
    """The tensors of one rank: the shared top-level ones plus the rank directory's, by name. A name
    in both is refused: a rank never redefines a shared tensor."""
    group, _, _ = rank_view(manifest, rank)
    path = Path(path)
    entries = group_entries(path, "") if (path / INDEX_NAME).exists() or (path / INDEX_NAME).is_symlink() else {}
    return _with_own(path, entries, group)


def _with_own(path: Path, entries: dict, group: str) -> dict:
    """The shared ``entries`` plus the rank directory ``group``'s own (none for ""); a name in both is
    refused."""
    if group:
        own = group_entries(path, group)
        twice = sorted(set(own) & set(entries))
        if twice:
            raise CorruptFileError(f"{path / group}: tensor '{twice[0]}' is also in the top-level shards",
                                   hint="the output is damaged; convert again")
        entries |= own
    return entries


def file_path(root: Path, name: str) -> Path:
    """An entry of the manifest's ``files`` as a path inside ``root`` (InputError otherwise)."""
    return entry_path(root, name, f"{Path(root) / MANIFEST_NAME}: files")
