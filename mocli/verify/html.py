"""``verify --report PATH.html``: one self-contained page (inline CSS, no scripts or network) with
error / threshold per module and rank as a heat map, the kernel used and what was emulated."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any


def _colour(ratio: float | None, passed: bool) -> str:
    if ratio is None or not passed:
        return "#d73027"
    # green (0) -> yellow (0.5) -> orange (1.0): how much of the threshold the error uses
    r = max(0.0, min(ratio, 1.0))
    if r < 0.5:
        a, b, t = (26, 152, 80), (254, 224, 139), r / 0.5
    else:
        a, b, t = (254, 224, 139), (244, 109, 67), (r - 0.5) / 0.5
    return "#" + "".join(f"{round(x + (y - x) * t):02x}" for x, y in zip(a, b, strict=True))


EMULATED = (' Kernels named "emulated" run where no tensor-core kernel for the format exists on this device: the '
            "layout is decoded and an exact GEMM runs instead.")


def _short(message: str, n: int = 60) -> str:
    return message if len(message) <= n else message[: n - 1] + "…"


def write_html(report: dict[str, Any], path: Path) -> None:
    ranks = report["ranks"]
    cells: dict[str, dict[int, dict]] = {}
    for m in report["modules"]:
        cells.setdefault(m["module"], {})[m["rank"]] = m
    e = html.escape
    rows = []
    for name, by_rank in cells.items():
        tds = []
        for r in ranks:
            m = by_rank.get(r)
            if m is None:
                tds.append("<td></td>")
                continue
            ratio = None if m["error"] is None or not m["threshold"] else m["error"] / m["threshold"]
            # a failed cell says why where a person looks, not only in a tooltip
            label = (f"FAIL: {e(_short(m['message']))}" if not m["passed"] else "—" if ratio is None else f"{ratio:.2f}")
            tip = (f"{m['kind']} · {m['kernel']}{' (emulated)' if m['emulated'] else ''} · error "
                   f"{'n/a' if m['error'] is None else format(m['error'], '.3g')} / {m['threshold']:g}"
                   + (f" · {m['message']}" if m["message"] else ""))
            tds.append(f'<td style="background:{_colour(ratio, m["passed"])}" title="{e(tip)}">{label}</td>')
        first = next(iter(by_rank.values()))
        rows.append(f"<tr><th>{e(name)}</th><td class=k>{e(first['kind'])}</td>"
                    f"<td class=k>{e(first['kernel'])}</td>"
                    + "".join(tds) + "</tr>")
    problems = ([f"{m['module']} (rank {m['rank']}): {m['message']}" for m in report["modules"] if not m["passed"]]
                + [f"file {p['file']}: {p['problem']}" for p in report["files"]["problems"]]
                + [f"{p['module']}: {p['problem']}" for p in report.get("completeness", {}).get("problems", [])]
                + [f"layout: {p}" for p in report.get("layout", {}).get("problems", [])]
                + [f"{c['module']}: {c['check']}: {c['message']}" for c in report["cross_rank"] if not c["passed"]]
                + [f"{p['tensor']}: {p['problem']}" for p in report["passthrough"]["problems"]]
                + [f"{n}: in the output but checked by nothing" for n in report["coverage"]["unchecked"]])
    cross = "".join(f"<li>{'✔' if c['passed'] else '✘'} {e(c['module'])}: {e(c['check'])}"
                    f" ({'n/a' if c['error'] is None else format(c['error'], '.3g')})</li>" for c in report["cross_rank"])
    verdict = "OK" if report["ok"] else "FAILED"
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>mocli verify: {e(report['output'])}</title>
<style>body{{font:13px system-ui,sans-serif;margin:24px;color:#222}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ddd;padding:3px 6px;text-align:center}}th{{text-align:left;font-weight:normal}}
td.k{{text-align:left;color:#555}}.ok{{color:#1a9850}}.bad{{color:#d73027}}</style></head><body>
<h1>mocli verify <span class="{'ok' if report['ok'] else 'bad'}">{verdict}</span></h1>
<p>{e(report['output'])} ← {e(report['source'])} · {e(report['target'])} · tp {report['parallel'].get('tp', 1)},
ep {report['parallel'].get('ep', 1)} · {e(report['device'])} · {report['tokens']} tokens, seed {report['seed']} ·
{report['files']['checked']} files hashed · {report['passthrough']['checked']} pass-through tensors ·
{report['coverage']['tensors']} tensors covered · {report['seconds']:.1f} s</p>
<p>Cells: relative error ÷ threshold (green 0, orange 1); a failed check is red and says why (all reasons
are listed under "problems"). Hover for the kernel and the check.{EMULATED if any(m["emulated"] for m in
report["modules"]) else ""}</p>
<table><tr><th>module</th><th>kind</th><th>kernel</th>{''.join(f'<th>rank {r}</th>' for r in ranks)}</tr>
{''.join(rows)}</table>
{'<h2>cross-rank</h2><ul>' + cross + '</ul>' if cross else ''}
{'<h2>problems</h2><ul>' + ''.join(f'<li class=bad>{e(p)}</li>' for p in problems) + '</ul>' if problems else ''}
</body></html>"""
    path.write_text(page, encoding="utf-8")
