"""``mocli verify`` of a checkpoint written by ``mocli repair`` (SEMANTICS §11).

Every repaired tensor against its rule, evaluated here from the source: a unified ``weight_scale_2``
is the group's max and the other shards' block scales are ``fp8(bs · s2ᵢ / S2)`` (verify's own byte
table); an added expert ``input_scale`` is the max over the layer's other experts (w1/w3 and w2
apart); a dropped stray scale is gone. Every other tensor is the source's bytes, every source tensor
is accounted for, the output's shards match the digests repair recorded, and ``validate`` on the
output reports no error.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from mocli.census import Census
from mocli.checkpoint import open_checkpoint
from mocli.formats.modelopt import provenance_of
from mocli.tables import INPUT_SCALE, WEIGHT_SCALE, WEIGHT_SCALE_2
from mocli.verify.common import ModuleResult, Problems, Tally, finish, runtime, single_rank_report
from mocli.verify.expect import apply_table
from mocli.verify.files import Hashes, compare_bytes, open_source


def _groups(census: Census) -> dict[str, list[str]]:
    """module -> the modules whose weight_scale_2 the engine merges with it (fused shards, an expert's w1/w3)."""
    out: dict[str, list[str]] = {}
    for g in census.fused:
        for m in g.shards:
            out[m.name] = [x.name for x in g.shards]
    for layer in census.moe:
        for ex in layer.experts.values():
            pair = [m.name for m in (ex.gate, ex.up) if m is not None]
            for n in pair:
                out[n] = pair
    return out


def _scalar(reader, ckpt, name: str) -> float:
    return float(reader.view(ckpt.tensors[name]).float().reshape(-1)[0])


def verify_repaired(out: Path, opts, progress) -> dict[str, Any]:
    from mocli.validate import validate

    t_all = time.perf_counter()
    prov = provenance_of(out) or {}
    ckpt, src = open_checkpoint(out), open_source(out, prov, opts)
    shards = prov.get("output_shards")
    wanted = dict(shards) if isinstance(shards, dict) else None
    hashes = Hashes(out, wanted, prov.get("source_shards") or {}, src, opts, record_name="config.json")
    rt = runtime(opts, None)
    census = src.census()
    groups = _groups(census)
    repairs = [r for r in prov.get("repairs") or [] if isinstance(r, dict)]
    by_code: dict[str, list[dict]] = {}
    for r in repairs:
        by_code.setdefault(r.get("code", ""), []).append(r)
    dropped = {r["location"] for r in by_code.get("TNS004", [])}
    rescaled = {r["location"]: r for r in by_code.get("SCL005", [])}
    filled = {r["location"]: r for r in by_code.get("SCL003", [])}
    results: list[ModuleResult] = []
    checked: set[str] = set()
    progress.start(len(rescaled) + len(filled))
    with ckpt.reader() as ro, src.reader() as rs:
        for name, r in rescaled.items():
            results.append(_check_rescaled(name, r, groups, ckpt, src, ro, rs))
            checked |= {f"{name}.{WEIGHT_SCALE}", f"{name}.{WEIGHT_SCALE_2}"}
            progress.advance()
        for name, r in filled.items():
            results.append(_check_filled(name, r, census, ckpt, src, ro, rs))
            checked.add(f"{name}.{INPUT_SCALE}")
            progress.advance()
        progress.phase("unchanged tensors")
        same = {n: e for n, e in ckpt.tensors.items() if n not in checked}
        problems = compare_bytes(same, src, ro, rs)
    expected = (set(src.tensors) - dropped) | {f"{n}.{INPUT_SCALE}" for n in filled}
    problems += [{"tensor": n, "problem": "in the source but not in the output (and no repair dropped it)"}
                 for n in sorted(expected - set(ckpt.tensors))]
    problems += [{"tensor": n, "problem": "a repair dropped it, but it is still in the output"}
                 for n in sorted(dropped & set(ckpt.tensors))]
    problems += [{"tensor": f.location, "problem": f"validate: {f.code} {f.message}"}
                 for f in validate(ckpt, None).findings.errors]
    progress.phase(f"hashing {hashes.count} files")
    file_problems = hashes.result()
    tally = Tally(len(wanted or {}), file_problems, len(same), problems, len(ckpt.tensors), [],
                  f"{len(repairs)} repair(s) recorded")
    return single_rank_report(out, src, "modelopt (repaired, SEMANTICS §11)", str(rt.device), opts, results, tally, t_all)


def _result(name: str, kind: str, rule: str, problems: Problems, t0: float) -> ModuleResult:
    res = ModuleResult(name, 0, kind, "", rule, False, {}, 0.0, 1.0, False, 0.0)
    return finish(res, problems, t0)


def _check_rescaled(name, record, groups, ckpt, src, ro, rs) -> ModuleResult:
    """SCL005 (§11.1): weight_scale_2 = the group's max; block scales fp8(bs · s2ᵢ / S2), byte for byte."""
    t0, problems = time.perf_counter(), Problems()
    group = groups.get(name, [name])
    s2_src = _scalar(rs, src, f"{name}.{WEIGHT_SCALE_2}")
    big = max(_scalar(rs, src, f"{m}.{WEIGHT_SCALE_2}") for m in group)
    got = _scalar(ro, ckpt, f"{name}.{WEIGHT_SCALE_2}")
    if got != big or (isinstance(record.get("new"), float) and not math.isclose(record["new"], big, rel_tol=0)):
        problems.append(f"weight_scale_2 is {got:.6g}, the group's max is {big:.6g}")
    want = apply_table("rescale", rs.view(src.tensors[f"{name}.{WEIGHT_SCALE}"]), torch.tensor(s2_src),
                       torch.tensor(big))
    problems.expect_equal("weight_scale (block scales)", ro.view(ckpt.tensors[f"{name}.{WEIGHT_SCALE}"]).view(torch.uint8),
                          want)
    return _result(name, "repair SCL005", "bytes: fp8(bs · s2 / S2), S2 = the group's max", problems, t0)


def _check_filled(name, record, census: Census, ckpt, src, ro, rs) -> ModuleResult:
    """SCL003 (§11.2): the added input_scale is the max over the layer's other experts (w1/w3 or w2)."""
    t0, problems = time.perf_counter(), Problems()
    layer = next((lay for lay in census.moe if name.startswith(lay.name + ".")), None)
    pool = []
    if layer is not None:
        is_down = any(ex.down is not None and ex.down.name == name for ex in layer.experts.values())
        for ex in layer.experts.values():
            for m in ((ex.down,) if is_down else (ex.gate, ex.up)):
                if m is not None and INPUT_SCALE in m.tensors:
                    pool.append(_scalar(rs, src, m.tensors[INPUT_SCALE].name))
    tensor = f"{name}.{INPUT_SCALE}"
    if not pool:
        problems.append("no other expert of the layer has an input_scale to take the max of")
    elif tensor not in ckpt.tensors:
        problems.append("input_scale is missing")
    else:
        got = ro.view(ckpt.tensors[tensor])
        if got.dtype != torch.float32 or tuple(got.shape) != () or float(got) != max(pool):
            problems.append(f"input_scale is {float(got.reshape(-1)[0]):.6g} ({got.dtype}, {list(got.shape)}), the "
                            f"layer's max is {max(pool):.6g}")
    return _result(name, "repair SCL003", "value: max over the layer's other experts", problems, t0)
