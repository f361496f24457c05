"""Findings folded for reading: one row per (code, message, hint) within a layer, then across layers.

A finding repeated for every module of a layer (TGT002 on q/k/v, o, gate/up and down) or for every layer
(the same TGT002 on each MoE layer) is one fact; the human table shows it once with a count (×N).
Within a layer, findings with the same code and the same message and hint once the module's own name
and its layer's number are taken out fold into one row that lists the modules. Across layers, rows that
list the same modules with the same text fold again, the layers written as ``{0-3,7,8}``. ``--json``'s
``findings`` keeps one entry per finding (and ``--output-format concise`` one line each); ``grouped``
holds these rows, each with its ``count`` and every ``locations``.
"""

from __future__ import annotations

import re
from typing import Any

from mocli.findings import few

_LAYER = re.compile(r"^(?P<stem>.*?\.layers)\.(?P<n>\d+)(?:\.(?P<rest>.+))?$")
_MODULE, _LAYER_MARK = "\0module\0", "\0layer\0"


def group_findings(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of ``findings`` (``Finding.to_dict``s) folded as the module docstring says, in the order
    each row's first finding came."""
    per_layer: dict[tuple, dict[str, Any]] = {}
    for f in findings:
        m = _LAYER.match(f["location"])
        if m is None:  # not in a layer (config fields, exclude entries, model-wide tensors): its own row
            key: tuple = ("", f["code"], f["location"], f["message"], f["hint"])
            per_layer.setdefault(key, {"f": f, "stem": None, "layer": None, "rests": [], "found": []})
        else:
            stem, n, rest = m["stem"], int(m["n"]), m["rest"] or ""
            message, hint = (_generic(t, f["location"], f"{stem}.{n}") for t in (f["message"], f["hint"]))
            key = ("layer", f["code"], stem, n, message, hint)
            per_layer.setdefault(key, {"f": f, "stem": stem, "layer": n, "rests": [], "found": [],
                                       "message": message, "hint": hint})
            if rest not in per_layer[key]["rests"]:
                per_layer[key]["rests"].append(rest)
        per_layer[key]["found"].append(f)
    across: dict[tuple, list[dict[str, Any]]] = {}
    for key, row in per_layer.items():
        if row["stem"] is None:
            across[key] = [row]
        else:
            across.setdefault(("layers", key[1], row["stem"], row["message"], row["hint"], tuple(row["rests"])),
                              []).append(row)
    return [_row(rows) for rows in across.values()]


def _generic(text: str, location: str, layer: str) -> str:
    """``text`` with the finding's own module (a whole name: not the start of a longer one, as a layer's
    location is of its experts' names) and its layer's prefix taken out (put back by ``_row``)."""
    text = re.sub(re.escape(location) + r"(?!\w|\.\w)", _MODULE, text)
    return text.replace(layer + ".", _LAYER_MARK + ".")


def _row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    first = rows[0]["f"]
    found = [f for r in rows for f in r["found"]]
    out = {"code": first["code"], "severity": first["severity"], "location": first["location"],
           "message": first["message"], "hint": first["hint"], "count": len(found),
           "locations": list(dict.fromkeys(f["location"] for f in found))}
    if rows[0]["stem"] is None or len(out["locations"]) == 1:
        return out
    layers = f"{rows[0]['stem']}.{_numbers([r['layer'] for r in rows])}"
    rests = rows[0]["rests"]
    if len(rests) == 1:
        out["location"] = f"{layers}.{rests[0]}" if rests[0] else layers
    else:
        out["location"] = f"{layers}: {few(rests)}"
    for k in ("message", "hint"):
        out[k] = rows[0][k].replace(_MODULE, "each").replace(_LAYER_MARK, layers)
    return out


def _numbers(ns: list[int]) -> str:
    """[0, 1, 2, 5, 6] -> ``{0-2,5,6}`` (runs of three or more as ranges); one layer: its number."""
    ns = sorted(set(ns))
    if len(ns) == 1:
        return str(ns[0])
    runs: list[list[int]] = []
    for n in ns:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return "{" + ",".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs) + "}"
