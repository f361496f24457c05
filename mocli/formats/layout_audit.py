"""What a converted directory's files say about themselves, checked against each other (no tensor data).

``mocli verify`` runs every check here before its own (a failure is a finding, exit 1), and mocli's
vLLM plugin runs them in the engine's first process, before any worker starts (a failure is the one
``mocli:`` line a user sees). So whatever the plugin refuses, verify has failed first. What only the
bytes can prove (a layout relabelled with every record edited to match) is verify's alone.

- ``config_problems``: config.json against the manifest: its recorded digest, and the layout fields
  both files carry;
- ``module_problems``: each module's kind, roles and weight transforms are the ones its target writes
  (``TargetLayout.kinds``, ``roles``, ``row_shuffled_kinds``, ``weight_transforms``), and every tensor a
  module names is described;
- ``tensor_problems``: a rank's shards hold exactly the manifest's tensors, with its dtypes and shapes;
- ``size_problems``: module sizes against config.json's hidden size and expert count.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mocli.formats import CONFIG_JSON
from mocli.formats.layout import file_path, shared_fields
from mocli.formats.manifest import Layout, ModuleEntry
from mocli.io.digests import as_record, digest_or_error
from mocli.kinds import KINDS, ModuleKind
from mocli.targets import layout_of
from mocli.targets.base import ROW_SHUFFLE

# the layout fields config.json's quantization_config repeats from the manifest (layout_version 2)
SHARED_FIELDS = ("layout_version", "target", "parallel")
# Layout 1 kept the source's config.json (quant_method modelopt): vLLM takes such a directory for a
# ModelOpt export and would process its converted bytes a second time (NVFP4 block scales swizzled twice).
V1_REFUSAL = ("layout_version 1: its config.json declares the source's quant_method, so vLLM loads it as a ModelOpt "
              "export and processes the converted bytes a second time; mocli's plugin refuses it. Convert the source "
              "again with this mocli (layout_version 2)")
# the weights whose rows a target may shuffle (their block scales follow them; FP8 scales are per expert)
ROW_ROLES = frozenset({"weight", "w13_weight", "w2_weight"})


def config_problems(root: Path, layout: Layout) -> list[str]:
    """config.json as the manifest recorded it, and saying the same layout fields."""
    from mocli.io.jsonfile import read_json

    if layout.version < 2:
        return [V1_REFUSAL]
    record = as_record((layout.files or {}).get(CONFIG_JSON))
    if record is None:
        return [f"{CONFIG_JSON}: the manifest records no digest of it"]
    path = file_path(root, CONFIG_JSON)
    digest, err = digest_or_error(path, record[0], follow=False)
    if err is not None:
        return [f"{CONFIG_JSON}: cannot read it ({err})"]
    problems = [] if digest == record[1] else [
        f"{CONFIG_JSON} differs from the {record[0]} digest the manifest records: it was edited after conversion"]
    qc = (read_json(path, follow=False) or {}).get("quantization_config")
    qc = qc if isinstance(qc, dict) else {}
    said = shared_fields(layout)
    problems += [f"{CONFIG_JSON} says {key} {qc.get(key)!r} but the manifest says {said[key]!r}"
                 for key in SHARED_FIELDS if qc.get(key) != said[key]]
    return problems


def module_problems(lay: Layout) -> list[str]:
    """Every module of every rank is of a kind its target writes and holds that kind's roles (its
    optional ones aside), its weight transforms are the target's, and each tensor it names is in the
    manifest's tensors."""
    layout = layout_of(lay.target)
    problems: list[str] = []
    for rank in lay.rank_ids:
        described = lay.described(rank)
        where = "" if rank is None else f" (rank {rank})"
        for m in lay.view(rank)[1]:
            kind = ModuleKind(m.kind)
            if kind not in layout.kinds:
                problems.append(f"{m.name}{where}: {layout.target} writes no {kind} module")
                continue
            problems += _role_problems(m, kind, layout, where)
            for role, tname in m.tensors.items():
                if tname not in described:
                    problems.append(f"{m.name}{where}: names tensor {tname} ({role}), which the manifest does not "
                                    "describe")
                elif role in ROW_ROLES:
                    problems += _transform_problems(tname, list(described[tname].transforms), kind, layout, where)
    return problems


def _role_problems(m: ModuleEntry, kind: ModuleKind, layout, where: str) -> list[str]:
    roles = set(m.tensors) - {"bias"}
    want, may = {str(r) for r in layout.roles(kind)}, {str(r) for r in KINDS[kind].optional}
    if want <= roles <= want | may:
        return []
    return [f"{m.name}{where}: a {kind} module of {layout.target} holds {_names(want)}"
            + (f" (and may hold {_names(may)})" if may else "") + f", this one {_names(roles)}"]


def _transform_problems(tname: str, transforms: list, kind: ModuleKind, layout, where: str) -> list[str]:
    shuffled = kind in layout.row_shuffled_kinds
    if (ROW_SHUFFLE in transforms) != shuffled:
        return [f"{tname}{where}: its transforms {transforms} are not those of {layout.target} (rows "
                f"{'' if shuffled else 'not '}shuffled by {ROW_SHUFFLE})"]
    need = layout.weight_transforms.get(kind)
    if need is not None and need not in transforms:
        return [f"{tname}{where}: its transforms {transforms} lack {need}, which every {layout.target} {kind} "
                "weight records"]
    return []


def tensor_problems(layout: Layout, rank: int | None, entries: dict) -> list[str]:
    """One rank's shards (``entries``: ``Layout.entries``, the top level's and the rank's own) against
    the manifest: the same names, and each tensor with the manifest's dtype and shape."""
    listed = layout.described(rank)
    where = "" if rank is None else f" (rank {rank})"
    problems = [f"{n}{where}: in the manifest but in no shard" for n in sorted(set(listed) - set(entries))]
    problems += [f"{n}{where}: in a shard but not in the manifest" for n in sorted(set(entries) - set(listed))]
    for name in sorted(set(entries) & set(listed)):
        e, want = entries[name], listed[name]
        if e.dtype != want.dtype or tuple(e.shape) != want.shape:
            problems.append(f"{name}{where}: {e.dtype} {list(e.shape)} in its shard, {want.dtype} {list(want.shape)} "
                            "in the manifest")
    return problems


# config.json keys of the sizes a module's shapes follow (transformers names; a VLM keeps them in text_config)
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
# dense layers whose input is the hidden state (column-parallel) / whose output is (row-parallel)
_READS_HIDDEN = ("qkv_proj", "q_proj", "k_proj", "v_proj", "gate_up_proj", "gate_proj", "up_proj")
_WRITES_HIDDEN = ("o_proj", "down_proj")


def size_problems(layout: Layout, config: dict[str, Any]) -> list[str]:
    """Module sizes against the model's config.json (hidden size, expert count): a layout converted
    from another model. Only the sizes every architecture names the same way are compared."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    hidden = text.get("hidden_size")
    experts = next((text[k] for k in _EXPERT_COUNT_KEYS if isinstance(text.get(k), int)), None)
    if not isinstance(hidden, int):
        return []
    problems = []
    for rank in layout.rank_ids:
        for m in layout.view(rank)[1]:
            meta, last = m.meta, m.name.rpartition(".")[2]
            full = meta.get("full") or {"n": meta.get("n"), "k": meta.get("k")}
            said = [("hidden", meta.get("hidden"), hidden), ("experts", meta.get("experts_total", meta.get("experts")),
                                                            experts)] if "experts" in meta else [
                ("input features", full.get("k"), hidden if last in _READS_HIDDEN else None),
                ("output features", full.get("n"), hidden if last in _WRITES_HIDDEN else None)]
            problems += [f"{m.name}: {what} {got} in the layout, {want} in config.json (converted from another "
                         "model?)" for what, got, want in said if want is not None and got != want]
        if problems:
            break
    return problems


def _names(roles: set[str]) -> str:
    return "{" + ", ".join(sorted(roles)) + "}"
