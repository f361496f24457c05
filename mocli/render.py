"""Human renderings of the core's result dicts (the same dicts --json prints)."""

from __future__ import annotations

import re
import shlex
from typing import Any

from rich.markup import escape
from rich.table import Table

from mocli.io import human_bytes
from mocli.output import Output


def _algo_row(info: dict[str, Any]) -> str:
    method = info.get("quant_method")
    how = {"fp8": f" (quant_method fp8, {info['activation_scheme']} activations)",
           "compressed-tensors": " (quant_method compressed-tensors)"}.get(method, "")
    stored = f" (stored: {', '.join(info['stored_schemes'])})" if info["stored_schemes"] else ""
    return f"{info['quant_algo'] or 'none'}{how}{stored}"


def render_inspect(info: dict[str, Any], out: Output) -> None:
    c = out.stdout
    c.print(_inspect_head(info))
    c.print(_inspect_kinds(info))
    if info["moe_layers"]:
        c.print(_inspect_moe(info))
    c.print(_inspect_exclusions(info))
    for f in info["config_findings"]:
        out.warn(f"{f['code']} {f['location']}: {f['message']}")


def _inspect_head(info: dict[str, Any]) -> Table:
    producer = info.get("producer") or {}
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    rows = [
        ("checkpoint", info["source"]),
        ("architecture", f"{info['architecture'] or '?'} ({info['model_type'] or '?'}), {info['num_layers']} layers"),
        ("producer", f"{producer.get('name', '?')} {producer.get('version', '')}".strip()),
        ("quant_algo", _algo_row(info)),
        ("kv cache", f"{info['kv_cache_quant_algo'] or 'none'} ({info['kv_cache_scales']} scale tensors)"),
        ("group_size", str(info["group_size"]) if info["group_size"] else "-"),
        ("config files", ", ".join(info["config_files"]) or "none"),
        ("weights", f"{len(info['shards'])} file(s), {info['num_tensors']} tensors, "
                    f"{human_bytes(info['total_bytes'])}"),
        ("dtypes", ", ".join(f"{d} {v['tensors']} ({human_bytes(v['bytes'])})" for d, v in info["dtypes"].items())),
    ]
    if info["fused_groups"]:
        rows.append(("fused groups", ", ".join(f"{k} x{v}" for k, v in info["fused_groups"].items())))
    for k, v in rows:
        head.add_row(k, escape(str(v)))
    return head


def _inspect_kinds(info: dict[str, Any]) -> Table:
    kinds = Table(title="modules", title_justify="left")
    cols = ["kind", "modules"] + sorted({k for r in info["modules"] for k in r} - {"kind", "modules"})
    for col in cols:
        kinds.add_column(col, justify="left" if col == "kind" else "right")
    for r in info["modules"]:
        kinds.add_row(*(str(r.get(col, 0)) for col in cols))
    return kinds


def _inspect_moe(info: dict[str, Any]) -> Table:
    moe = Table(title="MoE layers", title_justify="left")
    for col in ("layer", "naming", "experts", "I", "H", "schemes"):
        moe.add_column(col)
    rows = [(m["name"], (m["naming"], str(m["experts"]), str(m["intermediate"]), str(m["hidden"]),
                         ", ".join(m["schemes"]))) for m in info["moe_layers"]]
    for name, cells in by_layer_runs(rows, "layers"):
        moe.add_row(escape(name), *cells)
    return moe


_LAYER_INDEX = re.compile(r"(?<=layers\.)\d+(?=\.|$)")
SELF = "(itself)"  # an exclusions row's matches: each pattern of the row matches exactly its own name


def by_layer_runs(rows: list[tuple[str, tuple[str, ...]]], unit: str) -> list[tuple[str, tuple[str, ...]]]:
    """Consecutive rows alike in all but their name's layer index as one: ``model.layers.{0..60}.mlp.experts
    (61 layers)``. A 61-row table of one line repeated hid what differs; --json keeps every row."""
    runs: list[list] = []  # [the name around its index, indices, cells, name]
    for name, cells in rows:
        hit = _LAYER_INDEX.search(name)
        around = (name[:hit.start()], name[hit.end():]) if hit else None
        if hit and runs and runs[-1][0] == around and runs[-1][2] == cells:
            runs[-1][1].append(int(hit.group()))
        else:
            runs.append([around, [int(hit.group())] if hit else [], cells, name])
    return [(f"{around[0]}{{{_spans(indices)}}}{around[1]} ({len(indices)} {unit})" if len(indices) > 1 else name,
             cells) for around, indices, cells, name in runs]


def _spans(indices: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0..2,5,7..8'."""
    spans: list[list[int]] = []
    for i in indices:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ",".join(str(a) if a == b else f"{a}..{b}" for a, b in spans)


def _inspect_exclusions(info: dict[str, Any]) -> Table:
    excl = Table(title="exclusions (engine semantics)", title_justify="left")
    excl.add_column("pattern")
    excl.add_column("matches")
    excl.add_column("notes")
    rows = []
    for r in info["exclusions"]:
        notes = []
        if r["partial_fused"]:
            notes.append("partly excludes " + ", ".join(r["partial_fused"][:3]))
        if r["matches_with_vlm_prefix"]:
            notes.append(f"would match as {r['matches_with_vlm_prefix']}")
        if r["matches_checkpoint_names_only"]:
            notes.append("matches checkpoint names only")
        if r["lost_after_engine_rewrite"]:
            notes.append(f"engine rewrite loses {len(r['lost_after_engine_rewrite'])}")
        matches = r["matches"]
        shown = ", ".join(matches[:3]) + (f" (+{len(matches) - 3})" if len(matches) > 3 else "")
        rows.append((r["pattern"], (SELF if matches == [r["pattern"]] else shown or "[nothing]", "; ".join(notes))))
    for pattern, (shown, notes) in by_layer_runs(rows, "patterns"):
        excl.add_row(escape(pattern), escape(shown), escape(notes))
    if not info["exclusions"]:
        excl.add_row("(none)", "", "")
    return excl


_SEV_STYLE = {"error": "bold red", "warning": "yellow"}


def render_validation(report: dict[str, Any], out: Output) -> None:
    """The findings folded per layer (``mocli.validate.grouping``: one row per fact, ``(×N)`` where it
    repeats), then the verdict naming what was judged."""
    c = out.stdout
    if report["findings"]:
        t = Table(show_lines=False)
        for col in ("code", "severity", "location", "message", "hint"):
            t.add_column(col, overflow="fold")
        for f in report.get("grouped") or report["findings"]:
            times = f" (×{f['count']})" if f.get("count", 1) > 1 else ""
            t.add_row(f["code"], f"[{_SEV_STYLE[f['severity']]}]{f['severity']}[/]", escape(f["location"]),
                      escape(f["message"]) + times, escape(f["hint"]))
        c.print(t)
    _validation_verdict(report, out)


def render_validation_concise(report: dict[str, Any], out: Output) -> None:
    """One line per finding (ruff's --output-format concise), unfolded: grep- and CI-log-friendly."""
    for f in report["findings"]:
        out.stdout.print(f"{escape(f['location'])}: {f['code']} [{_SEV_STYLE[f['severity']]}]{f['severity']}[/]: "
                         f"{escape(f['message'])}" + (f" [dim](hint: {escape(f['hint'])})[/]" if f["hint"] else ""),
                         soft_wrap=True)
    _validation_verdict(report, out)


_VERDICT = {"ok": "[bold green]OK[/]", "failed": "[bold red]FAILED[/]", "not judged": "[bold yellow]NOT JUDGED[/]"}


def validation_scope(judged: dict[str, Any]) -> str:
    """What a validate run judged, as its verdict line says it: ``for vLLM 0.32-0.33 (target
    flashinfer-cutlass, tp 1, ep 1)``."""
    engines = " and ".join(judged["labels"][e] for e in judged["engines"])
    where = [f"target {judged['target']}" if judged["target"] else "no target", f"tp {judged['tp']}",
             f"ep {judged['ep']}"] + (["every byte scanned"] if judged.get("deep") else [])
    return (f"for {engines} " if engines else "") + f"({', '.join(where)})"


def _validation_verdict(report: dict[str, Any], out: Output) -> None:
    verdict = report.get("verdict") or ("ok" if report["ok"] else "failed")
    ignored = f", {report['ignored']} ignored" if report.get("ignored") else ""
    scope = f" {validation_scope(report['judged'])}" if report.get("judged") else ""
    counts = f"{report['errors']} error(s), {report['warnings']} warning(s){ignored}"
    if verdict == "not judged":
        counts = f"no engine's reading judged; {counts} in the other checks"
    out.stdout.print(f"{_VERDICT[verdict]}{escape(scope)}: {counts}", soft_wrap=True)
    for n in report.get("not_judged", []):
        out.stdout.print(f"not judged: {escape(n['label'])}: {escape(n['why'])}", soft_wrap=True)


def render_convert(summary: dict[str, Any], out: Output) -> None:
    r = summary["unified_scales"]
    out.stdout.print(
        f"[bold green]converted[/] {summary['tensors']} tensors ({human_bytes(summary['bytes'])}, "
        f"{summary['shards']} shard(s)) for {summary['target']} on {summary['device']} in "
        f"{summary['seconds']:.2f} s -> {escape(summary['output'])}")
    if summary.get("device_requested"):
        out.stdout.print(f"ran on {summary['device']}, not {summary['device_requested']}: a conversion only moves "
                         "bytes (copied, shuffled, FP8 requantized and NVFP4 block scales rescaled through 256-entry "
                         "tables), nothing a GPU would speed up; the bytes are the same")
    if summary["resumed_units"]:
        out.stdout.print(f"resumed: {summary['resumed_units']} of {summary['units']} units were already done")
    repairs = []
    if r["fp8_requantized_shards"]:
        repairs.append(f"{r['fp8_requantized_shards']} FP8 shard(s) requantized to a shared max scale")
    if r["nvfp4_rescaled_shards"] or r["nvfp4_rescaled_experts"]:
        repairs.append(f"NVFP4 weight_scale_2 unified: {r['nvfp4_rescaled_shards']} linear shard(s), "
                       f"{r['nvfp4_rescaled_experts']} expert w1/w3 pair(s), worst ratio "
                       f"{r['nvfp4_worst_scale_2_ratio']:.3g}x")
    for line in repairs:
        out.stdout.print(f"  repaired: {line}")
    for w in summary["warnings"]:
        out.warn(f"{w['code']} {w['location']}: {w['message']}")
    out.stdout.print(f"next: mocli verify {escape(shlex.quote(summary['output']))}", soft_wrap=True)


def render_repair(summary: dict[str, Any], out: Output) -> None:
    c = out.stdout
    if summary["repairs"]:
        t = Table(title="repairs" + (" (dry run: nothing written)" if summary.get("output") is None else ""),
                  title_justify="left")
        for col in ("finding", "location", "repair", "old", "new"):
            t.add_column(col, overflow="fold")
        for r in summary["repairs"]:
            t.add_row(r["code"], escape(str(r["location"])), escape(r["action"]),
                      "" if r["old"] is None else escape(_brief(r["old"])), "" if r["new"] is None else escape(_brief(r["new"])))
        c.print(t)
    if summary["refused"]:
        t = Table(title="not repairable", title_justify="left")
        for col in ("code", "location", "message", "hint"):
            t.add_column(col, overflow="fold")
        for f in summary["refused"]:
            t.add_row(f["code"], escape(f["location"]), escape(f["message"]), escape(f["hint"]))
        c.print(t)
        return
    if summary["nothing_to_do"]:
        c.print("[bold green]nothing to do[/]: validate finds nothing to repair")
    if summary.get("output"):
        what = (f"[bold green]repaired[/] {len(summary['repairs'])} finding(s);" if summary["repairs"]
                else "[bold green]copied[/]")
        c.print(f"{what} {summary['tensors']} tensors ({human_bytes(summary['bytes'])}) in {summary['seconds']:.2f} s "
                f"-> {escape(summary['output'])}")
        if summary["resumed_units"]:
            c.print(f"resumed: {summary['resumed_units']} of {summary['units']} units were already done")


def _brief(v: Any) -> str:
    s = f"{v:.6g}" if isinstance(v, float) else str(v)
    return s if len(s) <= 60 else s[:57] + "..."


def render_quantize(summary: dict[str, Any], out: Output) -> None:
    c = out.stdout
    c.print(f"[bold green]quantized[/] {summary['quantized_modules']} linear(s) in {summary['groups']} scale group(s) "
            f"to {summary['scheme']} on {summary['device']}: {summary['tensors']} tensors "
            f"({human_bytes(summary['bytes'])}, {summary['shards']} shard(s)) in {summary['seconds']:.2f} s "
            f"-> {escape(summary['output'])}")
    if summary["resumed_units"]:
        c.print(f"resumed: {summary['resumed_units']} of {summary['units']} units were already done")
    kept = summary["ignored_layers"]
    c.print(f"kept unquantized ({len(kept)}): " + escape(", ".join(kept[:6]) + (f" (+{len(kept) - 6})" if len(kept) > 6 else "")))
    for note in summary["notes"]:
        out.warn(note)
    dev = summary.get("deviations_from_online") or []
    if dev:
        c.print(f"note: {len(dev)} router(s) kept in BF16 (SEMANTICS §12) where {dev[0]['engine_online']}: served "
                "outputs differ from the online path in the routers only")
    c.print("serve it as it is: the config says quant_method fp8, so no --quantization flag is needed")


def render_verify(report: dict[str, Any], out: Output) -> None:
    multi = len(report["ranks"]) > 1 or report["parallel"].get("ranks", 1) > 1
    par = report["parallel"]
    # the heading is a line of its own: as a table title it would wrap at the table's width
    out.stdout.print(f"verify {escape(report['output'])} ({report['target']}"
                     + (f", tp {par['tp']} ep {par['ep']}" if multi else "")
                     + f", {report['device']}, {report['tokens']} tokens, seed {report['seed']})", soft_wrap=True)
    if report.get("device_requested"):
        out.stdout.print(f"ran on {report['device']}, not {report['device_requested']}: NVFP4 checks decode bytes and "
                         "emulate the GEMMs exactly in numpy (no NVFP4 kernel runs here), so torch is never loaded",
                         soft_wrap=True)
    t = Table()
    cols = ["module"] + (["rank"] if multi else []) + ["kernel", "rel. error", "threshold", "result"]
    for col in cols:
        t.add_column(col, overflow="fold")
    for m in _byte_checks_per_layer(report["modules"]) if report["modules"] else []:
        result = "[green]pass[/]" if m["passed"] else f"[bold red]FAIL[/] {escape(m['message'])}"
        err = "-" if m["error"] is None else f"{m['error']:.3g}"
        thr = "-" if m["threshold"] is None else f"{m['threshold']:g}"
        row = [escape(m["module"])] + ([str(m["rank"])] if multi else []) + [escape(m["kernel"]), err, thr, result]
        t.add_row(*row)
    if report["modules"]:
        out.stdout.print(t)
    emulated = sorted({m["kernel"] for m in report["modules"] if m.get("emulated")})
    if emulated:
        out.stdout.print("emulated: no tensor-core kernel for these formats here; mocli decodes the kernel-ready layout "
                         "and runs exact BF16/float32 GEMMs (README \"emulated\")", soft_wrap=True)
    for c in report["cross_rank"]:
        mark = "[green]pass[/]" if c["passed"] else f"[bold red]FAIL[/] {escape(c['message'])}"
        out.stdout.print(f"cross-rank {escape(c['module'])}: {escape(c['check'])}: {mark}")
    for p in report["files"]["problems"]:
        out.stdout.print(f"[bold red]FAIL[/] file {escape(p['file'])}: {escape(p['problem'])}")
    for p in report["passthrough"]["problems"]:
        out.stdout.print(f"[bold red]FAIL[/] pass-through {escape(p['tensor'])}: {escape(p['problem'])}")
    for p in report.get("layout", {}).get("problems", []):
        out.stdout.print(f"[bold red]FAIL[/] layout: {escape(p)}")
    for p in report.get("completeness", {}).get("problems", []):
        out.stdout.print(f"[bold red]FAIL[/] {escape(p['module'])}: {escape(p['problem'])}")
    for n in report["coverage"]["unchecked"]:
        out.stdout.print(f"[bold red]FAIL[/] {escape(n)}: in the output but checked by nothing")
    verdict = "[bold green]OK[/]" if report["ok"] else "[bold red]FAILED[/]"
    out.stdout.print(f"{verdict}: {report['passed']} module check(s) passed, {report['failed']} failed; "
                     f"{report['files']['checked']} files hashed, {report['passthrough']['checked']} pass-through "
                     f"tensors and {report['coverage']['tensors']} tensors in all covered, in {report['seconds']:.2f} s")


def _byte_checks_per_layer(modules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Checks that only compare bytes and scales (a quantize output's experts: one per expert and
    projection, ~12,000 on a large MoE) folded into one row per layer; --json keeps every one."""
    rows: list[dict[str, Any]] = []
    folded: dict[tuple[str, int], dict[str, Any]] = {}
    for m in modules:
        if m["kernel"] != "bytes and scale only":
            rows.append(m)
            continue
        layer = m["module"].split(".experts.")[0] + ".experts" if ".experts." in m["module"] else m["module"]
        key = (layer, m["rank"])
        if key not in folded:
            folded[key] = {**m, "module": layer, "error": None, "threshold": None, "count": 0, "failed": []}
            rows.append(folded[key])
        row = folded[key]
        row["count"] += 1
        if not m["passed"]:
            row["failed"].append(m)
    for row in folded.values():
        row["kernel"] = f"bytes and scales of {row['count']} expert groups"
        row["passed"] = not row["failed"]
        row["message"] = "; ".join(f"{f['module']}: {f['message']}" for f in row["failed"][:3]) + (
            f" (+{len(row['failed']) - 3} more)" if len(row["failed"]) > 3 else "")
    return rows
