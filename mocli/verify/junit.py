"""JUnit XML for CI systems: one testcase per verified module."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def write_junit(report: dict[str, Any], path: Path) -> None:
    mods = report["modules"]
    suite = ET.Element("testsuite", name="mocli verify", tests=str(len(mods)), failures=str(report["failed"]),
                       errors="0", time=f"{report['seconds']:.3f}")
    props = ET.SubElement(suite, "properties")
    for key in ("output", "source", "target", "device", "tokens", "seed"):
        ET.SubElement(props, "property", name=key, value=str(report[key]))
    for m in mods:
        case = ET.SubElement(suite, "testcase", classname=f"mocli.verify.{m['kind']}", name=m["module"],
                             time=f"{m['seconds']:.4f}")
        err = "n/a" if m["error"] is None else f"{m['error']:.4g}"
        detail = (f"kernel={m['kernel']}{' (emulated)' if m['emulated'] else ''} error={err} "
                  f"threshold={m['threshold']:g}")
        if m["passed"]:
            ET.SubElement(case, "system-out").text = detail
        else:
            ET.SubElement(case, "failure", message=m["message"] or "failed").text = detail
    ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)
