"""What the plugin checks of a converted directory in the engine's first process, before vLLM parses
its quantization config and before any worker starts, so that a refusal is the last line a user sees
(raised there, it is not wrapped in vLLM's config validation or buried in worker tracebacks).

Everything here reads files only (config.json, the manifest, the shards' headers): the records
against each other (``mocli.formats.layout_audit``, which ``mocli verify`` runs too), each module's
tensors against the shapes its kernel takes, and a directory that holds a layout manifest but would
reach vLLM through another quantization method (a layout_version 1 output). No vLLM import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mocli import formats
from mocli.errors import MocliError
from mocli.formats import CONFIG_JSON
from mocli.formats.layout import MANIFEST_NAME, QUANT_METHOD, rank_entries, read_layout
from mocli.formats.layout_audit import (
    V1_REFUSAL,
    config_problems,
    module_problems,
    size_problems,
    tensor_problems,
)
from mocli.formats.manifest import Layout
from mocli.io.jsonfile import read_json
from mocli.vllm_plugin.checks import LayoutMismatch, read_quantization_config


def local_directory(model: str, revision: str | None = None) -> Path | None:
    """``model`` as a local directory: itself, or a Hub repo's snapshot already in the Hugging Face cache
    when it holds a layout manifest (None: neither; the engine downloads it, and the checks run in
    the workers)."""
    if Path(model).is_dir():
        return Path(model)
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, MANIFEST_NAME, revision=revision)
    except Exception:  # noqa: BLE001 - not a repo id, or no cache: nothing to check here
        return None
    return Path(found).parent if isinstance(found, str) else None


# directory -> (the manifest file's identity, the Layout precheck read): ``MocliConfig.maybe_update_config``
# takes it (``layout_read``) in the same process rather than reading the manifest a second time
_READ: dict[str, tuple[tuple[int, int, int], Layout]] = {}


def _identity(directory: Path) -> tuple[int, int, int] | None:
    try:
        st = (Path(directory) / MANIFEST_NAME).stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def layout_read(directory: Path) -> Layout | None:
    """The Layout ``precheck`` read of ``directory``, once (None: none, or the manifest changed since)."""
    key = str(Path(directory).resolve())
    found = _READ.pop(key, None)
    return found[1] if found is not None and found[0] == _identity(directory) else None


def precheck(directory: Path) -> None:
    """LayoutMismatch ("mocli: ...") for the first thing wrong with ``directory``; nothing for a
    directory without a layout manifest (not mocli's)."""
    if formats.detect(directory) is not formats.DirKind.LAYOUT:
        return
    config = _config(directory)
    qc = config.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != QUANT_METHOD:
        raise LayoutMismatch(f"{directory}: {V1_REFUSAL.replace('its config.json', f'config.json ({method!r})', 1)}")
    read_quantization_config(qc)
    try:
        identity, layout = _identity(directory), read_layout(directory)
        problems = config_problems(directory, layout) + module_problems(layout) + size_problems(layout, config)
        for r in layout.rank_ids:
            problems += tensor_problems(layout, r, rank_entries(directory, layout, r))
    except MocliError as e:
        raise LayoutMismatch(f"{e.message}" + (f" ({e.hint})" if e.hint else "")) from None
    problems = problems or _kernel_problems(layout)  # the records agree: do their shapes fit the kernels?
    if problems:
        more = f" (and {len(problems) - 1} more: mocli verify lists them)" if len(problems) > 1 else ""
        raise LayoutMismatch(f"{directory}: {problems[0]}{more}; the directory is damaged, convert again")
    if identity is not None:
        _READ[str(Path(directory).resolve())] = (identity, layout)


def _config(directory: Path) -> dict[str, Any]:
    try:
        data = read_json(directory / CONFIG_JSON, follow=False)
    except MocliError as e:
        raise LayoutMismatch(e.message) from None
    return data if isinstance(data, dict) else {}


def _kernel_problems(lay: Layout) -> list[str]:
    """Each module's tensors against the dtypes and shapes its serving kernel takes (LAYOUT.md)."""
    from mocli import serve
    from mocli.io.safetensors_file import torch_dtypes
    from mocli.kinds import ModuleKind
    from mocli.targets import layout_of

    dtypes, layout = torch_dtypes(), layout_of(lay.target)
    for rank in lay.rank_ids:
        described = lay.described(rank)
        for m in lay.view(rank)[1]:
            shapes = {role: (dtypes[described[t].dtype], described[t].shape)
                      for role, t in m.tensors.items() if role != "bias"}
            try:
                serve.KERNELS[ModuleKind(m.kind)].check(shapes, m.meta, layout, m.name)
            except serve.ServeError as e:
                return [str(e)]
    return []
