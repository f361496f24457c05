"""Every converted module of the checked ranks through its kind's check (``mocli.verify.kinds.CHECKS``):
where they run (numpy, or torch where a check needs it), how many at once, in which order.

NVFP4 checks run in numpy (torch only for FlashInfer's sm_100 kernels), up to ``kinds.WORKERS``
modules at once (in worker processes: as many as there are workers), largest first, results in manifest
order; FP8 checks in torch, one at a time. Where the workers outnumber the large MoE layers at least
twice, an MoE layer's expert bytes and numerics go to them in pieces (``mocli.verify.pieces``). When a
module is done the mapped pages go back (all maps': the modules still running fault theirs back in
from the page cache).
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, as_completed

from mocli import trace
from mocli import workers as wk
from mocli.checkpoint import Checkpoint
from mocli.devices import Kernels, capability, check_device
from mocli.kinds import KINDS, ModuleKind
from mocli.progress import ModuleProgress as Progress
from mocli.verify import pieces
from mocli.verify.expect import heads_of
from mocli.verify.kinds import CHECKS, WORKERS
from mocli.verify.kinds.context import CheckContext
from mocli.verify.results import CrossResult, ModuleResult, VerifyOptions
from mocli.verify.source import SourceTensors


def torch_runtime(kinds: set[ModuleKind], layout, opts: VerifyOptions):
    """The torch runtime (``mocli.verify.common.runtime``) where a module needs torch: a kind whose check
    runs in torch, or NVFP4 where FlashInfer's NVFP4 kernels may run (sm_100+, asked for or installed).
    None where every check runs in numpy: then torch is never imported, and ``--device`` is checked
    without it."""
    if not any(CHECKS[k].torch for k in kinds) and not _fp4_kernels_possible(layout, opts):
        check_device(opts.device)
        return None
    from mocli.verify.common import runtime

    return runtime(opts, layout)


def _fp4_kernels_possible(layout, opts: VerifyOptions) -> bool:
    """Whether FlashInfer's NVFP4 kernels could run: asked for, or a layout they read, FlashInfer
    installed and an sm_100+ device (SEMANTICS §9), all decided without torch (``Runtime.fp4_kernels``
    then decides for certain)."""
    import importlib.util

    kernels = Kernels(opts.kernels)
    if kernels is Kernels.FLASHINFER:
        return True  # the runtime checks that they can, and says why not
    if kernels is not Kernels.AUTO or not layout.fp4_kernels or opts.device == "cpu" \
            or importlib.util.find_spec("flashinfer") is None:
        return False
    cc = capability(opts.device)
    return cc is not None and cc[0] >= 10


def _module_bytes(cks: dict, name: str) -> int:
    """Bytes of the module's tensors on every rank that holds it: its checks' work goes with them (an
    MoE layer's expert bytes are compared and its sampled experts multiplied)."""
    return sum(ck.entry(t).nbytes for ck in cks.values() if ck.holds(name)
               for t in ck.module_entry(name).tensors.values() if t in ck.entries)


def _in_order(futures: dict[str, Future], names: list[str]) -> Iterator:
    """The futures' results in ``names`` order, raising the first error of any of them as soon as it is
    raised (a module that fails stops the run, wherever it comes in the order)."""
    order = iter(names)
    name = next(order, None)
    for f in as_completed(futures.values()):
        f.result()  # an error: raised now
        while name is not None and futures[name].done():
            yield futures[name].result()
            name = next(order, None)


def check_modules(names: list[str], cks: dict, src: Checkpoint, census, layout, rt, opts: VerifyOptions, tp: int,
                  progress: Progress) -> tuple[list[ModuleResult], list[CrossResult]]:
    """Every named module on every rank of ``cks`` that holds it, by its kind's check, in order (a module
    missing on a rank is completeness's finding, not a crash here)."""
    results: list[ModuleResult] = []
    cross: list[CrossResult] = []
    with src.reader() as reader:
        ctx = CheckContext(cks, SourceTensors(src, census, reader, rt.device if rt else None), layout, opts, tp,
                           heads_of(src.config), rt, _fp4(rt))

        def check(name: str) -> tuple[list[ModuleResult], CrossResult | None]:
            trace.mark(f"{name}: started")
            try:
                infos = {r: ck.module_entry(name) for r, ck in cks.items() if ck.holds(name)}
                return CHECKS[next(iter(infos.values())).kind].check(name, infos, ctx)
            finally:  # RSS: the mapped bytes of the modules in flight, not the model's
                trace.mark(f"{name}: done")
                reader.drop_pages()
                for ck in cks.values():
                    ck.drop_pages()

        remote = _RemoteChecks(names, check, ctx, _moe_sizes(cks, names)) if rt is None and wk.enabled() and \
            len(names) > 1 and wk.PROCS // wk.local_world() >= 2 else None
        workers = (remote.procs if remote and remote.pool else WORKERS) if rt is None else 1  # numpy checks at once
        run = remote.run if remote else check
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mocli-verify") if workers > 1 else None
        # the largest modules start first, so a long MoE layer does not start last (results in order)
        done = (_in_order({n: pool.submit(run, n) for n in sorted(names, key=lambda n: -_module_bytes(cks, n))},
                          names) if pool else (check(n) for n in names))
        try:
            for res, cr in done:
                results += res
                cross += [cr] if cr is not None else []
                for _ in res:
                    progress.advance()
        finally:  # an error or Ctrl-C: the modules not started yet are not checked
            if pool:
                pool.shutdown(wait=True, cancel_futures=True)
            if remote:
                remote.close(ctx)
    return results, cross


def _moe_sizes(cks: dict, names: list[str]) -> dict[str, int]:
    """The MoE layers among ``names`` and their bytes on the checked ranks."""
    moe = {n for n in names for ck in cks.values() if ck.holds(n) and KINDS[ck.module_entry(n).kind].moe}
    return {n: _module_bytes(cks, n) for n in names if n in moe}


# The run's modules and their check, as the worker processes inherit them (``_RemoteChecks``)
_NAMES: list[str] = []
_CHECK: Callable | None = None


class _RemoteChecks:
    """Numpy checks in worker processes (``mocli.workers``), where a machine has cores that one process's
    threads cannot keep busy (the byte checks hold the GIL between short numpy passes). Forked once the
    run's context exists, a worker runs a module's check as this process would and sends its results
    back; a check that fails there (an error, the worker gone) runs again here, where its error shows.
    Where the workers outnumber the large MoE layers (at least half the largest's bytes) at least twice,
    each MoE layer is checked here, its heavy parts sent out in pieces (``mocli.verify.pieces``)."""

    def __init__(self, names: list[str], check: Callable, ctx: CheckContext, moe: dict[str, int]) -> None:
        global _NAMES, _CHECK
        _NAMES, _CHECK = list(names), check
        self.index = {n: i for i, n in enumerate(_NAMES)}
        self.procs = wk.PROCS // wk.local_world()
        self.check = check
        self.here = threading.Semaphore(WORKERS)  # checks run here (a worker failed): as many as without workers
        large = sum(1 for b in moe.values() if 2 * b >= max(moe.values(), default=0))
        parts = pieces.parts_for(self.procs, large) if moe else 1
        pieces.inherit(ctx, lambda: _drop(ctx))  # before the fork: the workers run pieces in this context
        # each kind's check imported before the fork, not by every worker (~0.1 s each on the H200 host)
        for kind in {ck.module_entry(n).kind for ck in ctx.cks.values() for n in names if ck.holds(n)}:
            CHECKS[kind].check  # noqa: B018
        self.pool = wk.fresh(self.procs)
        self.split = set(moe) if parts > 1 and self.pool is not None else set()
        ctx.pieces = pieces.Pieces(self.pool, self.procs, parts, self.here) if self.split else None

    def run(self, name: str):
        if name in self.split:  # here, its pieces in the workers
            return self.check(name)
        got: list = []
        task = wk.Task(remote_check, (self.index[name],), 0, 0, None, lambda _, reply: got.append(pickle.loads(reply)))
        if self.pool is not None and self.pool.call(task):
            return got[0]
        with self.here:
            return self.check(name)

    def close(self, ctx: CheckContext) -> None:
        global _NAMES, _CHECK
        if ctx.pieces is not None:
            ctx.pieces.close()
            ctx.pieces = None
        if self.pool is not None:
            self.pool.close()
        _NAMES, _CHECK = [], None
        pieces.inherit(None, None)


def _drop(ctx: CheckContext) -> None:
    """A worker's mapped pages of the source and the outputs given back (a piece done)."""
    ctx.src.reader.drop_pages()
    for ck in ctx.cks.values():
        ck.drop_pages()


def remote_check(src, dst, args: tuple[int, ...]) -> bytes:
    """In a worker: module ``args[0]``'s check, its (results, cross result) pickled."""
    return pickle.dumps(_CHECK(_NAMES[args[0]]))


def _fp4(rt):
    """FlashInfer's NVFP4 kernels where they run here (sm_100+), else None."""
    if rt is None or not rt.fp4_kernels():
        return None
    from mocli.verify.kinds.nvfp4_linear import Fp4Kernels

    return Fp4Kernels(rt)
