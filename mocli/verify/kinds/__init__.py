"""verify's module checks, one module per converted module kind, in one registry.

``CHECKS[kind]`` names the module whose ``check(name, infos, ctx)`` verifies a module of that kind on
every given rank, and whether it needs torch, as the kind's card (``mocli.kinds``) says (FP8: its kernels; NVFP4 runs in numpy, torch only for
FlashInfer's sm_100 kernels). Modules load on first use, so an NVFP4 verify never imports torch.
What the dense kinds share is ``dense.check_dense``, what the MoE kinds share ``moe.check_moe``.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mocli import workers as wk
from mocli.kinds import CARDS, ModuleKind

if TYPE_CHECKING:
    from mocli.verify.results import Problems


@dataclass(frozen=True)
class KindCheck:
    module: str  # under mocli.verify.kinds
    torch: bool  # whether the check needs torch (else numpy alone)

    @property
    def check(self) -> Callable:
        return importlib.import_module(f"mocli.verify.kinds.{self.module}").check


# From the cards (``mocli.kinds``), without importing any check: a check module loads on first use
CHECKS: dict[ModuleKind, KindCheck] = {
    c.kind: KindCheck(c.check.module.removeprefix(f"{__name__}."), torch=c.check_torch) for c in CARDS}

# Modules checked at once where every check runs in numpy (numpy drops the GIL in its loops, copies and
# GEMMs): one on the 2-core build machine, whose second core hashes and checks bytes; up to four on
# larger machines (torch checks: one at a time). Each NVFP4 MoE check's expert bytes go to a thread of
# their own beside its GEMMs, up to as many.
WORKERS = max(1, min(4, (os.cpu_count() or 1) // 4))


def byte_checks(name: str, threads: int = WORKERS) -> ThreadPoolExecutor:
    """The threads an MoE check's expert bytes go to (this process's own: ``mocli.workers.executor``)."""
    return wk.executor(name, threads)


def each_expert(experts: list, check: Callable[[int, Any, Problems], Any], errors: tuple[type[Exception], ...],
                first: int = 0) -> tuple[Problems, Exception | None, list]:
    """``check(local, expert, found)`` for every expert (``local`` counted from ``first``): the differences in
    expert order, the first of ``errors`` raised (those before it kept, none after), and what each call
    returned up to it."""
    from mocli.verify.results import Problems

    found, got = Problems(), []
    try:
        for local, ex in enumerate(experts, first):
            got.append(check(local, ex, found))
    except errors as e:
        return found, e, got
    return found, None, got


def merged(runs: list[tuple[Problems, Exception | None, list]]) -> tuple[Problems, Exception | None, list]:
    """Runs of consecutive experts (``each_expert``'s answers, in expert order) as one loop over all of them
    would have answered: a run's fault ends it, the runs after it dropped."""
    from mocli.verify.results import Problems

    found, got = Problems(), []
    for part_found, fault, part_got in runs:
        found += part_found
        got += part_got
        if fault is not None:
            return found, fault, got
    return found, None, got


__all__ = ["CHECKS", "WORKERS", "KindCheck", "byte_checks", "each_expert", "merged"]
