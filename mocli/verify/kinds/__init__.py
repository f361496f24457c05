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


# Threads one MoE check's expert bytes are shared out to, in a worker process: set before the workers are
# forked (``mocli.verify.modules``) where they outnumber the large modules; one elsewhere. On the H200 host
# 14 workers verified the bench's six MoE layers, each worker's byte thread the long pole (its GEMMs waited
# for it 80% of the time) and eight workers idle.
EXPERT_THREADS = 1


def each_expert(name: str, experts: list, check: Callable[[int, Any, Problems], Any],
                errors: tuple[type[Exception], ...]) -> tuple[Problems, Exception | None, list]:
    """``check(local, expert, found)`` for every expert, as one loop over them would run it: the
    differences in expert order, the first of ``errors`` raised (those before it kept, none after), and
    what each call returned up to it. With ``EXPERT_THREADS`` > 1 the experts go in that many runs of
    consecutive ones to threads of their own (the calling thread takes the first), merged in order."""
    from mocli.verify.results import Problems

    def run(part: list[tuple[int, Any]]) -> tuple[Problems, Exception | None, list]:
        found, got = Problems(), []
        try:
            for local, ex in part:
                got.append(check(local, ex, found))
        except errors as e:
            return found, e, got
        return found, None, got

    items = list(enumerate(experts))
    n = max(1, min(EXPERT_THREADS, len(items)))
    if n == 1:
        return run(items)
    per = -(-len(items) // n)
    parts = [items[i:i + per] for i in range(0, len(items), per)]
    pool = wk.executor(f"{name}-split", n - 1, in_workers=True)
    rest = [pool.submit(run, part) for part in parts[1:]]
    runs = [run(parts[0])] + [f.result() for f in rest]
    found, got = Problems(), []
    for part_found, fault, part_got in runs:
        found += part_found
        got += part_got
        if fault is not None:
            return found, fault, got
    return found, None, got


__all__ = ["CHECKS", "EXPERT_THREADS", "WORKERS", "KindCheck", "byte_checks", "each_expert"]
