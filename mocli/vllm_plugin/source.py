"""A source checkpoint served with the plugin installed: one ``mocli:`` line, before vLLM reads the directory
(so before any worker starts), saying that vLLM serves it with its own path, the plugin taking no part, and
how to convert it for mocli's.

A source here is a local directory without a layout manifest whose quantization is ModelOpt's
(``hf_quant_config.json``, or config.json ``quantization_config.quant_method`` modelopt*) or
compressed-tensors'. Files only, no vLLM import; nothing is raised (a file that cannot be read is vLLM's
to report, or ``mocli validate``'s).
"""

from __future__ import annotations

from pathlib import Path

from mocli.formats.layout import MANIFEST_NAME


def source_notice(directory: Path) -> str | None:
    """The line for ``directory``, or None when it is not such a source."""
    if (directory / MANIFEST_NAME).exists():
        return None
    described = _describe(directory)
    if described is None:
        return None
    from mocli.targets import Target

    targets = "|".join(t.value for t in Target)
    return (f"mocli: {directory} is a {described} checkpoint, not a mocli convert output (no {MANIFEST_NAME}): vLLM "
            f"serves it on its own path and mocli's plugin takes no part; to serve it on mocli's instead: mocli "
            f"convert {directory} -o OUT --target {targets}, then serve OUT")


def _describe(directory: Path) -> str | None:
    """"ModelOpt NVFP4", "compressed-tensors FP8_PB_WO", ...: the format and its algorithm, as mocli reads them."""
    from mocli.checkpoint import FORMATS
    from mocli.errors import MocliError
    from mocli.findings import Findings
    from mocli.formats import CONFIG_JSON, HF_QUANT_CONFIG
    from mocli.io.jsonfile import read_json
    from mocli.quant_config import MODELOPT_METHODS, parse_config_json, parse_hf_quant_config

    try:
        config = read_json(directory / CONFIG_JSON, follow=False) if (directory / CONFIG_JSON).is_file() else {}
        hf = read_json(directory / HF_QUANT_CONFIG, follow=False) if (directory / HF_QUANT_CONFIG).is_file() else None
    except (MocliError, OSError):
        return None
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method == "compressed-tensors":
        fmt = "compressed-tensors"
    elif method in MODELOPT_METHODS or hf is not None:
        fmt = "ModelOpt"
    else:
        return None
    parsed = parse_config_json(config, Findings(), FORMATS) if method else None
    if parsed is None and hf is not None:
        parsed = parse_hf_quant_config(hf, Findings())
    algo = getattr(parsed, "algo", None)
    return f"{fmt} {algo}" if algo else fmt
