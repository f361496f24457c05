"""JUnit XML for CI systems: one testcase per verified module and rank, plus file, cross-rank,
pass-through, coverage, completeness and layout problems as failing cases."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def write_junit(report: dict[str, Any], path: Path) -> None:
    mods = report["modules"]
    extra = ([("file", p["file"], p["problem"]) for p in report["files"]["problems"]]
             + [("cross_rank", c["module"], c["message"] or c["check"]) for c in report["cross_rank"] if not c["passed"]]
             + [("passthrough", p["tensor"], p["problem"]) for p in report["passthrough"]["problems"]]
             + [("coverage", n, "in the output but checked by nothing") for n in report["coverage"]["unchecked"]]
             + [("completeness", p["module"], p["problem"]) for p in report.get("completeness", {}).get("problems", [])]
             + [("layout", p.split(":", 1)[0], p) for p in report.get("layout", {}).get("problems", [])])
    suite = ET.Element("testsuite", name="mocli verify", tests=str(len(mods) + len(extra)),
                       failures=str(report["failed"]), errors="0", time=f"{report['seconds']:.3f}")
    props = ET.SubElement(suite, "properties")
    for key in ("output", "source", "target", "device", "tokens", "seed"):
        ET.SubElement(props, "property", name=key, value=str(report[key]))
    multi = len(report["ranks"]) > 1 or report["parallel"].get("ranks", 1) > 1
    for m in mods:
        name = f"{m['module']}[rank {m['rank']}]" if multi else m["module"]
        case = ET.SubElement(suite, "testcase", classname=f"mocli.verify.{m['kind']}", name=name,
                             time=f"{m['seconds']:.4f}")
        err = "n/a" if m["error"] is None else f"{m['error']:.4g}"
        detail = (f"kernel={m['kernel']}{' (emulated)' if m['emulated'] else ''} error={err} "
                  f"threshold={m['threshold']:g} checks={m['checks']}")
        if m["passed"]:
            ET.SubElement(case, "system-out").text = detail
        else:
            ET.SubElement(case, "failure", message=m["message"] or "failed").text = detail
    for kind, name, problem in extra:
        case = ET.SubElement(suite, "testcase", classname=f"mocli.verify.{kind}", name=name)
        ET.SubElement(case, "failure", message=problem)
    ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)
