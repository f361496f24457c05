"""``model.safetensors.index.json`` and the shards it names, read strictly (sources and outputs alike)."""

from __future__ import annotations

from pathlib import Path

from mocli.errors import CorruptFileError, InputError
from mocli.formats import INDEX_NAME
from mocli.io.jsonfile import read_json, two_level_keys
from mocli.io.paths import entry_path
from mocli.io.safetensors_file import SafetensorsHeader, TensorEntry, read_headers


def read_index(root: Path, follow: bool = True) -> tuple[list[SafetensorsHeader], dict[str, TensorEntry]]:
    """Every shard ``model.safetensors.index.json`` names, and every tensor by name, where the index and
    the shards' headers agree exactly (a tensor in no shard, in two, or in a shard the index does not
    map it to is an error naming it). ``follow``: a source may be a Hugging Face cache snapshot of
    links into ``../../blobs``; mocli's own outputs (``follow=False``) hold no link at all."""
    index_path = root / INDEX_NAME
    # fixed structure: weight_map is checked here
    index = read_json(index_path, walk=False, follow=follow, keys=two_level_keys)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or set(map(type, weight_map.values())) - {str}:
        raise CorruptFileError(f"{index_path}: no \"weight_map\" object of tensor -> file name",
                               hint="the index is corrupt; download it again or delete it for a single-file checkpoint")
    paths: dict[str, Path] = {}
    for fname in sorted(set(weight_map.values())):
        # Containment is judged on the names, not on where links point: a Hugging Face cache
        # snapshot is made of symlinks into ../../blobs/, and those are fine.
        parts = Path(fname).parts
        if not fname or Path(fname).is_absolute() or ".." in parts or "\0" in fname:
            raise InputError(f"{index_path}: weight_map entry {fname!r} points outside the model directory",
                             hint="shard names must be plain file names inside the checkpoint directory")
        fpath = root / fname if follow else entry_path(root, fname, str(index_path))
        if not fpath.exists():  # (a FIFO, a directory or, for outputs, a link: read_header says so)
            why = "is a dangling or looping link" if fpath.is_symlink() else "does not exist"
            raise InputError(f"{index_path}: shard {fname!r} {why}",
                             hint="the download is incomplete; fetch the missing shard again")
        paths[fname] = fpath
    headers = dict(zip(paths, read_headers(list(paths.values()), follow), strict=True))
    # Fast path: the shards' own name -> file map equals the index's (built and compared in C, no loop
    # over the 94,858 names of a large checkpoint); only a disagreement walks name by name to say which
    # tensor is wrong.
    tensors: dict[str, TensorEntry] = {}
    owners: dict[str, str] = {}
    for fname, header in headers.items():
        tensors.update(header.tensors)
        owners.update(dict.fromkeys(header.tensors, fname))
    if len(tensors) == sum(len(h.tensors) for h in headers.values()) and owners == weight_map:
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
