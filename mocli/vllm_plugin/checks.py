"""What a converted directory promises, checked against what the engine is about to do, with the one
message a user needs when they differ. No vLLM here: the engine's settings come in as plain values.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mocli.formats.layout import LAYOUT_VERSION, READABLE_VERSIONS
from mocli.targets import Target


class LayoutMismatch(ValueError):
    """The converted directory cannot be served as the engine is configured. One line, starting "mocli:"."""

    def __init__(self, message: str) -> None:
        super().__init__(message if message.startswith("mocli:") else f"mocli: {message}")


@dataclass(frozen=True)
class Parallel:
    """Tensor- and expert-parallel sizes, of a layout or of an engine (dp = 1: ep is tp or 1)."""

    tp: int
    ep: int

    def describe(self) -> str:
        return f"tp {self.tp}" + (f" x ep {self.ep}" if self.ep > 1 else "")

    def vllm_flags(self) -> str:
        return f"--tensor-parallel-size {self.tp}" + (" --enable-expert-parallel" if self.ep > 1 else "")

    def convert_flags(self) -> str:
        return f"--tp {self.tp}" + (f" --ep {self.ep}" if self.ep > 1 else "")


def read_quantization_config(qc: Any) -> tuple[str, Parallel]:
    """(target, parallel) of config.json's ``quantization_config`` of a converted directory, each field
    checked (LayoutMismatch naming the field otherwise)."""
    if not isinstance(qc, dict):
        raise LayoutMismatch("config.json quantization_config is not an object; convert again")
    version = qc.get("layout_version")
    if version not in READABLE_VERSIONS:
        raise LayoutMismatch(f"layout_version {version!r} is not one this mocli reads "
                             f"({', '.join(map(str, sorted(READABLE_VERSIONS)))}); convert again with this mocli "
                             f"(it writes layout_version {LAYOUT_VERSION})")
    target = qc.get("target")
    if target not in {t.value for t in Target}:
        raise LayoutMismatch(f"target {target!r} is not one this mocli knows ({', '.join(t.value for t in Target)}); "
                             "convert again with this mocli")
    par = qc.get("parallel")
    ok = isinstance(par, dict) and all(isinstance(par.get(k), int) and par[k] >= 1 for k in ("tp", "ep"))
    if not ok:
        raise LayoutMismatch("config.json quantization_config.parallel must give tp and ep; convert again")
    return target, Parallel(par["tp"], par["ep"])


def source_of(qc: dict[str, Any]) -> str:
    """The source the directory was converted from, as ``mocli convert`` takes it (provenance)."""
    src = (qc.get("mocli") or {}).get("source") or {}
    if isinstance(src, dict) and src.get("repo_id"):
        rev = src.get("revision")
        return f"{src['repo_id']}@{rev}" if rev else str(src["repo_id"])
    if isinstance(src, dict) and src.get("path"):
        return str(src["path"])
    return "SOURCE"


def convert_command(qc: dict[str, Any], model_dir: str, target: str, want: Parallel) -> str:
    out = f"{str(model_dir).rstrip('/')}-tp{want.tp}" + (f"-ep{want.ep}" if want.ep > 1 else "")
    return f"mocli convert {source_of(qc)} -o {out} --target {target} {want.convert_flags()}"


def engine_parallel(tp: int, enable_expert_parallel: bool) -> Parallel:
    """vLLM's MoE layout at dp = 1: expert parallel over the tp ranks when asked for and tp > 1."""
    return Parallel(tp, tp if enable_expert_parallel and tp > 1 else 1)


def check_engine(qc: dict[str, Any], model_dir: str | Path, *, tp: int, pp: int, dp: int, enable_ep: bool,
                 has_moe: bool) -> None:
    """The engine's parallelism against the layout's (SEMANTICS §10: a rank's tensors are laid out for
    its slice and cannot be cut from another layout)."""
    target, layout = read_quantization_config(qc)
    if pp != 1:
        raise LayoutMismatch(f"pipeline parallelism ({pp} stages) is not supported by mocli's plugin; "
                             f"serve {model_dir} with {layout.vllm_flags()}")
    if dp != 1:
        raise LayoutMismatch(f"data parallelism ({dp}) is not supported by mocli's plugin; serve {model_dir} with "
                             f"{layout.vllm_flags()} and data_parallel_size 1")
    engine = engine_parallel(tp, enable_ep)
    same = engine.tp == layout.tp and (engine.ep == layout.ep or not has_moe)
    if not same:
        raise LayoutMismatch(
            f"{model_dir} was converted for {layout.describe()} ({layout.vllm_flags()}), but this engine runs "
            f"{engine.describe()} ({engine.vllm_flags()}); serve it with {layout.vllm_flags()}, or convert for "
            f"this engine: {convert_command(qc, str(model_dir), target, engine)}")
