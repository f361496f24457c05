"""Work in worker processes (``mocli.workers``): the Marlin repack and its inverse a slot at a time, whole
conversion units (``mocli.stream.remote``) and verify's numpy checks (``mocli.verify.modules``). Off under
8 cores, so these tests turn two workers on; what they hold is that a worker changes no byte, no result and
no error, and that a worker which dies or stops is worked around."""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import types

import numpy as np
import pytest
import torch

from fixtures.generate import make_checkpoint
from mocli import workers
from mocli.io.digests import file_digest
from mocli.ops import marlin
from mocli.targets import marlin_decode
from tests import reference as ref
from tests.conftest import REAL_QWEN, digest_tree, edit_tensor


@pytest.fixture(autouse=True)
def stats(monkeypatch):
    """``workers.STATS`` counted from zero: a test asserts that its work really went to a worker (a worker
    that failed every task would otherwise pass unseen, every task run again in process)."""
    monkeypatch.setattr(workers, "STATS", {"done": 0, "failed": 0})
    yield workers.STATS
    pool = workers._active
    for pid in pool.pids if pool is not None else []:  # stopped ones too: never waited on for ever
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # reaped by the test
            pass
    workers.shutdown()


@pytest.fixture
def two_workers(monkeypatch):
    """Two workers, tasks of 4 KiB (a repack then spans several), every repack and decode sent to them."""
    monkeypatch.setattr(workers, "PROCS", 2)
    monkeypatch.setattr(workers, "MANY_CORES", True)
    monkeypatch.setattr(workers, "TASK", 4096)
    monkeypatch.setattr(workers, "PROC_MIN", 0)


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, k // 2), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


@pytest.mark.parametrize("n,k", [(256, 512), (100, 48), (320, 96), (1024, 4096)])
def test_repack_and_decode_in_workers_are_vllms_reference(two_workers, stats, n, k):
    """Against vLLM's python reference restated (tests/reference.py), not against the in-process path."""
    w = _weight(n, k, n + k)
    np_, kp = marlin.padded_nk(n, k)
    got = marlin.repack(w.numpy(), np_, kp)
    repacked = stats["done"]
    assert repacked >= 1 and np.array_equal(got.view(np.int32), ref.marlin_repack(w, np_, kp).numpy())
    assert np.array_equal(marlin_decode.decode_weight(got, n, k, "w"), w.numpy())
    assert stats["done"] > repacked and stats["failed"] == 0 and not workers._active.broken


def test_a_worker_that_dies_leaves_its_task_to_the_caller(two_workers, stats):
    w = _weight(512, 1024, 1)
    want = ref.marlin_repack(w, 512, 1024).numpy()
    pool = workers.workers()
    os.kill(pool.pids[0], signal.SIGKILL)
    os.waitpid(pool.pids[0], 0)
    assert np.array_equal(marlin.repack(w.numpy(), 512, 1024).view(np.int32), want)
    assert pool.broken == {0}
    done = stats["done"]
    assert np.array_equal(marlin.repack(w.numpy(), 512, 1024).view(np.int32), want)
    assert stats["done"] > done  # the other worker still works


def _failing(src, dst, args):  # a kernel (a worker imports it by name)
    raise ValueError("planted")


def test_a_task_that_fails_leaves_its_worker_in_use(two_workers, stats):
    """An error in a task (bad data, a unit past the slot) is the task's: the worker stays."""
    pool = workers.workers()
    task = workers.Task(_failing, (), 0, 16, None, lambda dst, reply: None)
    assert not pool.call(task) and not pool.call(task)
    assert stats["failed"] == 2 and not pool.broken
    with pytest.raises(ValueError, match="planted"):  # ``run``: again here, where the error shows
        pool.run(task)


def test_an_interrupt_while_a_task_is_out_retires_its_worker(two_workers, monkeypatch):
    """Ctrl-C while a worker computes: that worker's late reply must never be read as another task's."""
    w = _weight(256, 512, 3)
    pool = workers.workers()

    def interrupted(fd, pid):
        raise KeyboardInterrupt

    monkeypatch.setattr(workers, "_alive_until_ready", interrupted)
    with pytest.raises(KeyboardInterrupt):
        marlin.repack(w.numpy(), 256, 512)
    assert pool.broken
    monkeypatch.undo()
    assert np.array_equal(marlin.repack(w.numpy(), 256, 512).view(np.int32), ref.marlin_repack(w, 256, 512).numpy())


def test_a_worker_that_stops_is_given_up(two_workers, monkeypatch):
    """A worker stuck on a lock the fork left taken uses no CPU: after STALL seconds its task runs here."""
    monkeypatch.setattr(workers, "STALL", 1.0)
    w = _weight(256, 512, 2)
    pool = workers.workers()
    for pid in pool.pids:
        os.kill(pid, signal.SIGSTOP)
    assert np.array_equal(marlin.repack(w.numpy(), 256, 512).view(np.int32), ref.marlin_repack(w, 256, 512).numpy())
    assert pool.broken == {0, 1}


def test_no_workers_where_torch_has_brought_up_cuda(monkeypatch):
    monkeypatch.setattr(workers, "PROCS", 2)
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert not workers.enabled() and workers.workers() is None


def test_pools_are_per_process():
    """A forked worker gets thread pools of its own (one thread), never its parent's threadless ones."""
    ex = workers.executor("mocli-test", 3)
    assert workers.executor("mocli-test", 3) is ex and ex._max_workers == 3
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        workers._child = True
        child = workers.executor("mocli-test", 3)
        os.write(w, b"%d %d" % (child is not ex, child._max_workers))
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 16) == b"1 1"


@pytest.mark.parametrize("target,src_kw", [
    ("marlin", None), ("flashinfer-trtllm", None),
    ("flashinfer-cutlass", {"arch": "qwen3_moe", "algo": "FP8", "hidden": 192, "heads": 4, "kv_heads": 2,
                            "head_dim": 48, "moe_intermediate": 96}),
])
def test_units_in_workers_write_the_same_bytes(cli, tmp_path, monkeypatch, target, src_kw):
    """Whole conversions, with and without worker processes, at one rank and at --tp 2: every file."""
    src = REAL_QWEN if src_kw is None else make_checkpoint(tmp_path / "src", **src_kw)
    monkeypatch.setattr(workers, "MANY_CORES", True)  # as from 8 cores
    for tp in ("1", "2"):
        outs = {}
        for procs in (0, 2):
            monkeypatch.setattr(workers, "PROCS", procs)
            outs[procs] = tmp_path / f"{tp}-{procs}"
            r = cli("convert", src, "-o", outs[procs], "--target", target, "--tp", tp)
            assert r.exit_code == 0, r.stderr
        assert digest_tree(outs[0]) == digest_tree(outs[2])
        assert workers._active is None  # the stream's workers are gone with it
        # what the manifest records is what was written: pieces are hashed from the workers' slots
        recorded = json.loads((outs[2] / "mocli-layout.json").read_text())["files"]
        assert {n: file_digest(outs[2] / n) for n in recorded} == {n: f["xxh3_128"] for n, f in recorded.items()}
    assert workers.STATS["done"] > 0 and workers.STATS["failed"] == 0


def test_bad_data_in_a_worker_is_the_same_refusal(cli, tmp_path, monkeypatch):
    """A unit that raises in a worker (NaN codes) runs again here and refuses the run as it always has."""
    src = make_checkpoint(tmp_path / "src", arch="qwen3_moe", algo="FP8", hidden=192, heads=4, kv_heads=2,
                          head_dim=48, moe_intermediate=96)
    monkeypatch.setattr(workers, "MANY_CORES", True)
    edit_tensor(src, "model.layers.0.mlp.experts.1.down_proj.weight",
                lambda t: t.view(torch.uint8).index_fill_(1, torch.tensor([5]), 0x7F).view(t.dtype))
    got = {}
    for procs in (0, 2):
        monkeypatch.setattr(workers, "PROCS", procs)
        r = cli("convert", src, "-o", tmp_path / f"o{procs}", "--target", "flashinfer-cutlass")
        got[procs] = r.exit_code, r.stderr
        assert not (tmp_path / f"o{procs}").exists()
    assert got[0] == got[2] and got[0][0] == 1 and "DAT001" in got[0][1]
    assert workers.STATS["failed"] == 1  # the unit with the NaN, in a worker: then again here


def _verified(cli, out, monkeypatch, procs: int) -> tuple[int, list[dict]]:
    monkeypatch.setattr(workers, "PROCS", procs)
    r = cli("--json", "verify", out)
    return r.exit_code, [{k: v for k, v in m.items() if k != "seconds"} for m in json.loads(r.stdout)["modules"]]


def _same_results(a: list[dict], b: list[dict], least: int = 6) -> None:
    """Every field the same, but the float32 errors: a worker's GEMMs run on one BLAS thread, so their sums
    may round in another order (the 7th digit of an error of 1e-7, as between two machines)."""
    assert len(a) == len(b) >= least
    for x, y in zip(a, b, strict=True):
        fuzzy = ("error", "stages")
        assert {k: v for k, v in x.items() if k not in fuzzy} == {k: v for k, v in y.items() if k not in fuzzy}
        assert x["error"] is y["error"] is None or x["error"] == pytest.approx(y["error"], rel=0.2, abs=1e-6)
        assert x["stages"].keys() == y["stages"].keys()
        assert all(x["stages"][k] == pytest.approx(y["stages"][k], rel=0.2, abs=1e-6) for k in x["stages"])


def test_verify_in_workers_gives_the_same_results(cli, tmp_path, monkeypatch):
    out = tmp_path / "o"
    assert cli("convert", REAL_QWEN, "-o", out, "--target", "marlin").exit_code == 0
    workers.STATS.update(done=0, failed=0)  # the conversion's units may have gone to workers too
    (c0, r0), (c2, r2) = _verified(cli, out, monkeypatch, 0), _verified(cli, out, monkeypatch, 2)
    assert c0 == c2 == 0
    _same_results(r0, r2)
    assert workers.STATS["done"] == len({m["module"] for m in r2}) and workers.STATS["failed"] == 0


def test_verify_in_workers_finds_the_same_fault(cli, tmp_path, monkeypatch):
    """One byte of one stored expert changed: the same module fails, for the same reason, either way."""
    out = tmp_path / "o"
    assert cli("convert", REAL_QWEN, "-o", out, "--target", "marlin").exit_code == 0
    edit_tensor(out, "model.layers.1.mlp.experts.w2_weight", lambda t: t.view(torch.uint8).index_fill_(
        2, torch.tensor([7]), 0x5A).view(t.dtype))
    (c0, r0), (c2, r2) = _verified(cli, out, monkeypatch, 0), _verified(cli, out, monkeypatch, 2)
    assert c0 == c2 == 1
    assert [m["module"] for m in r0 if not m["passed"]] == ["model.layers.1.mlp.experts"]
    _same_results(r0, r2)


def test_a_new_pool_replaces_an_old_one(tmp_path):
    """The lazily forked pool (a repack's), then a stream's: the old one's workers must see their pipes
    close, so no new worker may keep the old ends open (that waited for ever, before). In a process of its
    own, with a deadline."""
    import subprocess

    script = (
        "import numpy as np\n"
        "from mocli import workers\n"
        "from mocli.ops import marlin\n"
        "workers.PROCS, workers.PROC_MIN, workers.MANY_CORES = 2, 0, True\n"
        "w = np.arange(256 * 256, dtype=np.uint32).astype(np.uint8).reshape(256, 256)\n"
        "a = marlin.repack(w, 256, 512)\n"
        "old = workers._active\n"
        "workers.fresh(2)\n"
        "assert old.pids == [] and workers._active is not old\n"
        "assert (marlin.repack(w, 256, 512) == a).all()\n"
        "workers.shutdown()\n"
        "print('done')\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                       cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr


def _stamp(src, dst, args):  # a kernel: its output is args[0] in every byte
    dst[:] = args[0]


def _kept(value: int, leases: list) -> workers.Task:
    return workers.Task(_stamp, (value,), 0, 64, None, lambda dst, reply: leases.append(dst), keep=leases.append)


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_a_kept_slot_is_not_reused_until_its_lease_is_given(two_workers, stats):
    """A unit's pieces are written from its slot (``mocli.stream.remote``): no other task may write there
    until the lease is given back, while the workers go on in their other slots; at most ``spare`` slots
    are leased (the next caller gets None: copy now), and a lease an error dropped gives its slot back."""
    pool = workers.Workers(2, spare=2)  # worker 0: slots 0 and 2; worker 1: slots 1 and 3
    try:
        first: list = []
        assert pool.call(_kept(7, first))
        out, lease = first
        assert isinstance(lease, workers.Lease) and pool.leased == 1
        second: list = []
        assert pool.call(_kept(8, second)) and isinstance(second[1], workers.Lease) and pool.leased == 2
        third: list = []
        assert pool.call(_kept(9, third)) and third[1] is None and pool.leased == 2  # both spares out: copy
        seen: list = []
        for v in range(10, 30):  # both workers go on, each in its slot not leased
            assert pool.call(workers.Task(_stamp, (v,), 0, 64, None, lambda dst, reply: seen.append(_address(dst))))
        assert (out == 7).all() and (second[0] == 8).all()
        assert set(seen) == {_address(pool.slots[2]), _address(pool.slots[3])} and pool.idle.qsize() == 2
        lease.give()
        lease.give()  # once only
        assert pool.leased == 1 and sum(map(len, pool.free)) == 3
        second.clear()  # dropped (an error on the way to the writer): its slot comes back
        assert pool.leased == 0 and sum(map(len, pool.free)) == 4
        assert stats["failed"] == 0
    finally:
        pool.close()


def test_a_worker_whose_slots_are_all_kept_waits_for_a_lease(two_workers, stats):
    """A worker with every slot of its own leased takes no task (another would overwrite a unit's output
    before it is written) until a lease comes back; the other worker takes them meanwhile."""
    pool = workers.Workers(2, spare=2)
    try:
        first: list = []
        assert pool.call(_kept(1, first)) and isinstance(first[1], workers.Lease)  # worker 0, slot 0
        assert pool.call(workers.Task(_stamp, (2,), 0, 64, None, lambda dst, reply: None))  # worker 1
        last: list = []
        assert pool.call(_kept(3, last)) and isinstance(last[1], workers.Lease)  # worker 0, slot 2
        assert pool.parked == {0} and pool.idle.qsize() == 1
        seen: list = []
        for v in range(4, 10):
            assert pool.call(workers.Task(_stamp, (v,), 0, 64, None, lambda dst, reply: seen.append(_address(dst))))
        assert set(seen) == {_address(pool.slots[1])} and (first[0] == 1).all() and (last[0] == 3).all()
        last[1].give()
        assert pool.parked == set() and pool.idle.qsize() == 2
    finally:
        pool.close()


def test_a_worker_given_up_mid_task_never_passes_its_slot_on(two_workers, stats, monkeypatch):
    """A worker killed as stuck may still write to its slots as it dies: they are never handed to
    another worker, and the pool goes on with its other worker."""
    pool = workers.Workers(2, spare=1)  # worker 0: slots 0 and 2; worker 1: slot 1
    try:
        alive = workers._alive_until_ready
        stuck = [True]

        def first_stuck(fd, pid):
            if stuck.pop() if stuck else False:
                return False
            return alive(fd, pid)

        monkeypatch.setattr(workers, "_alive_until_ready", first_stuck)
        assert not pool.call(workers.Task(_stamp, (1,), 0, 64, None, lambda dst, reply: None))
        assert pool.broken == {0}
        taken: list = []
        results = [pool.call(workers.Task(_stamp, (v,), 0, 64, None, lambda dst, reply: taken.append(_address(dst))))
                   for v in range(2, 12)]
        assert results == [True, False] * 5  # the live worker takes every other task
        assert set(taken) == {_address(pool.slots[1])} and stats["done"] == 5
    finally:
        pool.close()


def test_a_unit_in_a_worker_hands_its_arrays_over_in_place(monkeypatch):
    """``run_unit`` (here in process): an array made by ``UnitContext.empty`` stays where the unit wrote
    it in the slot, any other is copied in after it, source ranges travel as they are; the parent's pieces
    are views of the slot with the same bytes."""
    from mocli.stream import remote
    from mocli.stream.units import Piece, SourceRange, Unit

    made = np.arange(1000, dtype=np.uint16).reshape(10, 100)
    own = np.arange(77, dtype=np.uint8)
    rng = SourceRange(None, 3, 5)
    slots: list = []

    def run(ctx):
        slot_made = ctx.empty((10, 100), np.uint16)
        slot_made[:] = made
        slots.append(slot_made)
        return [Piece(("g", "a"), 0, slot_made), Piece(("g", "b"), 0, own), Piece(("g", "c"), 0, rng)]

    monkeypatch.setattr(remote, "_UNITS", [Unit("u", [], [], run, torch_free=True)])
    monkeypatch.setattr(remote, "_ctx", None)
    dst = np.zeros(4096, dtype=np.uint8)
    pieces = remote._pieces(dst, remote.run_unit(np.empty(0, np.uint8), dst, (0,)))
    a, b, c = (p.data for p in pieces)
    assert np.shares_memory(slots[0], dst) and slots[0].ctypes.data == dst.ctypes.data  # made in place, at 0
    assert np.array_equal(a, made) and a.dtype == np.uint16 and np.shares_memory(a, dst)
    assert np.array_equal(b, own) and np.shares_memory(b, dst) and b.ctypes.data - dst.ctypes.data == 2048
    assert c == rng and remote._ctx.arena is None  # the context's arena is the unit's only
    assert not np.shares_memory(remote._ctx.empty((3,)), dst)  # outside a unit: numpy's own


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
@pytest.mark.parametrize("fault", [None, 0, 4, 6, 9])
def test_runs_of_experts_merged_report_as_one_loop(parts, fault):
    """``verify.kinds.merged`` over ``each_expert``'s runs of consecutive experts (as ``verify.pieces`` sends
    them to workers): the findings in expert order, those after a layout fault dropped, what each call
    returned up to it - as the plain loop below reports them - however many runs share them."""
    from mocli.verify import kinds as check_kinds
    from mocli.verify.results import Problems

    experts = [f"e{i}" for i in range(10)]

    def one(local, ex, found):
        if local == fault:
            raise LookupError(f"fault at {ex}")
        if local % 3 == 1:
            found.append(f"{ex} differs")
        return local * local

    want_found, want_got, want_fault = [], [], None
    for local, ex in enumerate(experts):  # the loop each check ran before
        if local == fault:
            want_fault = f"fault at {ex}"
            break
        if local % 3 == 1:
            want_found.append(f"{ex} differs")
        want_got.append(local * local)
    per = -(-len(experts) // parts)
    runs = [check_kinds.each_expert(experts[lo:lo + per], one, (LookupError,), first=lo) for lo in range(0, 10, per)]
    found, err, got = check_kinds.merged(runs)
    assert isinstance(found, Problems) and found == want_found and got == want_got
    assert (None if err is None else str(err)) == want_fault


def _in_pieces(monkeypatch, parts: int) -> list:
    """verify's MoE layers in ``parts`` runs of experts each, and a record of each piece: its function and
    whether it ran in a worker (a piece run again here does not count)."""
    import threading

    from mocli.verify import pieces

    monkeypatch.setattr(pieces, "parts_for", lambda procs, large: parts)
    ran, now = [], threading.local()
    real_take, real_call = pieces.Pieces._take, workers.Workers.call

    def take(self):  # the piece a worker was given (chosen once it is free)
        chosen = real_take(self)
        now.fn = chosen[0].__name__
        return chosen

    def call(self, task):
        done = real_call(self, task)
        if task.kernel is pieces.run_piece:
            ran.append((now.fn, done))
        return done

    monkeypatch.setattr(pieces.Pieces, "_take", take)
    monkeypatch.setattr(workers.Workers, "call", call)
    return ran


@pytest.mark.parametrize("src, target", [(REAL_QWEN, "marlin"), (REAL_QWEN, "flashinfer-trtllm"),
                                         (REAL_QWEN.parent / "qwen3_moe-ct-mxfp4", "marlin"),
                                         (REAL_QWEN.parent / "gpt_oss-mxfp4", "flashinfer-trtllm"),
                                         (REAL_QWEN.parent / "qwen3_moe-mxfp8", "flashinfer-trtllm")])
def test_verify_in_pieces_gives_the_same_results(cli, tmp_path, monkeypatch, src, target):
    """Each MoE layer checked in this process, its expert bytes in three runs and its numerics sent to the
    workers: every result as the check in one process gives it, each piece run in a worker."""
    out = tmp_path / "o"
    assert cli("convert", src, "-o", out, "--target", target).exit_code == 0
    c0, r0 = _verified(cli, out, monkeypatch, 0)
    ran = _in_pieces(monkeypatch, 3)
    c2, r2 = _verified(cli, out, monkeypatch, 2)
    assert c0 == c2 == 0
    _same_results(r0, r2, least=2)
    layers = [m for m in r2 if m["kind"].endswith("moe")]
    runs = sum(-(-e // -(-e // 3)) for e in (m["shape"]["experts"] for m in layers))  # runs of ceil(E / 3)
    want = [("expert_run", True)] * runs + [("numbers_of", True)] * len(layers)
    assert len(layers) >= 2 and sorted(ran) == sorted(want)


def test_verify_in_pieces_finds_the_same_faults(cli, tmp_path, monkeypatch):
    """Two experts changed, in the first and the last of three runs, and a layout fault in the middle
    run of the other layer: the same findings in the same order as the check in one process; the run
    that met the fault failed in its worker and ran again here. (The fault is planted in the decode, so the
    weights' match in C, which would pass that expert's good bytes without decoding them, is off.)"""
    from mocli.targets import decode
    from mocli.verify.kinds import marlin_moe

    out = tmp_path / "o"
    assert cli("convert", REAL_QWEN, "-o", out, "--target", "marlin").exit_code == 0
    edit_tensor(out, "model.layers.1.mlp.experts.w2_weight", lambda t: t.view(torch.uint8).index_fill_(
        0, torch.tensor([1, t.shape[0] - 1]), 0x5A).view(t.dtype))
    real = marlin_moe.lay.decode_weight

    def broken(stored, n, k, what):
        if what == "model.layers.0.mlp.experts.w13_weight[4]":
            raise decode.LayoutError(f"{what}: Marlin padding is not zero")
        return real(stored, n, k, what)

    monkeypatch.setattr(marlin_moe.lay, "decode_weight", broken)  # the workers forked later inherit it
    monkeypatch.setattr(marlin_moe.lay, "weight_matches", lambda *a: False)  # so every weight is decoded
    c0, r0 = _verified(cli, out, monkeypatch, 0)
    ran = _in_pieces(monkeypatch, 3)
    c2, r2 = _verified(cli, out, monkeypatch, 2)
    assert c0 == c2 == 1
    bad = {m["module"]: m for m in r0 if not m["passed"]}
    assert bad["model.layers.1.mlp.experts"]["message"] == \
        "w2_weight (expert 1) differs from the source; w2_weight (expert 7) differs from the source"
    assert bad["model.layers.0.mlp.experts"]["kernel"] == "layout check"
    assert "w13_weight[4]: Marlin padding is not zero" in bad["model.layers.0.mlp.experts"]["message"]
    _same_results([m for m in r2 if not m["passed"]], list(bad.values()), least=2)
    assert ("expert_run", False) in ran and ran.count(("expert_run", True)) == 5


@pytest.mark.parametrize("src", [REAL_QWEN, REAL_QWEN.parent / "qwen3_moe-mxfp4"])
@pytest.mark.parametrize("tp", [1, 2])
def test_in_place_units_make_every_array_in_the_slot(src, tp):
    """``Unit.in_place`` is what lets a machine of few cores send a conversion to workers: every array
    such a unit hands over must lie in the arena it was given (none copied in), with the bytes the same
    unit makes without one."""
    from mocli.checkpoint import open_checkpoint
    from mocli.io.safetensors_file import TensorReader
    from mocli.stream.pool import BufferPool, UnitContext
    from mocli.stream.remote import _Arena
    from tests.test_convert import build_plan_for

    plan = build_plan_for(open_checkpoint(str(src)), "marlin", tp)
    units = [u for u in plan.units if u.in_place]
    assert len(units) >= 4 * 8  # w13, w13s, w2, w2s of every expert
    with TensorReader() as reader:
        ctx = UnitContext(reader, None, BufferPool())
        for unit in units:
            want = [p.data.copy() for p in unit.run(ctx)]
            slot = np.zeros(2 * workers.SLOT, dtype=np.uint8)
            ctx.arena = arena = _Arena(slot)
            got = unit.run(ctx)
            ctx.arena = None
            assert [arena.where(p.data) is not None for p in got] == [True] * len(got), unit.id
            assert all(np.array_equal(p.data, w) for p, w in zip(got, want, strict=True)), unit.id


SLOT_TAIL = 4096  # bytes at each slot's start a test leaves untouched (a kept output's)


def _rss_shmem() -> int:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) << 10 for x in f if x.startswith("RssShmem:"))


def _shmem_below(level: int) -> bool:
    import time

    deadline = time.monotonic() + 5
    while _rss_shmem() > level and time.monotonic() < deadline:
        time.sleep(0.01)
    return _rss_shmem() <= level


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_closing_a_pool_gives_its_slots_pages_back_after_the_last_lease(two_workers, stats):
    """The slots' pages are freed once the workers are gone and every kept output is given back (a unit's
    pieces are still hashed from its slot after the pool closes), not at the process's exit (where the
    kernel freed them on the run's critical path)."""
    import time

    pool = workers.Workers(2, spare=2)
    kept: list = []
    assert pool.call(_kept(7, kept)) and isinstance(kept[1], workers.Lease)
    for slot in pool.slots:
        slot[SLOT_TAIL:] = 1  # every slot's pages touched, the kept output's 64 bytes left as they are
    before, touched = _rss_shmem(), 4 * (2 * workers.SLOT - SLOT_TAIL)
    assert before >= touched
    pool.close()
    time.sleep(0.3)  # time enough for a release to have run
    assert (kept[0] == 7).all() and _rss_shmem() >= before - 4096  # still readable: nothing freed yet
    kept[1].give()
    assert _shmem_below(before - touched)



def test_verify_in_pieces_takes_marlin_scale_factors_from_every_run(cli, tmp_path, monkeypatch):
    """Every expert's block scales 8x smaller (e4m3 code - 24) but the last's: the rank's Marlin scale factors
    (vLLM's, over all its experts) are 1 only because of the last expert, which the pieces check in their
    last run. A clean output passes in pieces as in one process; a scale factor planted as 8 is named by both."""
    import re

    from safetensors.torch import load_file, save_file

    from mocli.numerics.in_torch import FP8
    from tests.test_marlin import _meta

    src = make_checkpoint(tmp_path / "src", arch="qwen3_moe", algo="NVFP4")
    t = load_file(str(src / "model.safetensors"))
    experts = max(int(m.group(1)) for n in t if (m := re.search(r"\.experts\.(\d+)\.", n)))
    for n in [n for n in t if ".experts." in n and n.endswith(".weight_scale") and t[n].dtype == FP8]:
        if f".experts.{experts}." not in n:
            t[n] = (t[n].view(torch.uint8).int() - 24).clamp(min=0).to(torch.uint8).view(FP8)
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "o"
    assert cli("convert", src, "-o", out, "--target", "marlin").exit_code == 0
    c0, r0 = _verified(cli, out, monkeypatch, 0)
    ran = _in_pieces(monkeypatch, 3)
    c2, r2 = _verified(cli, out, monkeypatch, 2)
    assert c0 == c2 == 0 and ("expert_run", True) in ran
    _same_results(r0, r2, least=2)
    _meta(out, "model.layers.0.mlp.experts", "scale_factor_w13", 8.0)
    c0, r0 = _verified(cli, out, monkeypatch, 0)
    c2, r2 = _verified(cli, out, monkeypatch, 2)
    assert c0 == c2 == 1
    bad = [m for m in r0 if not m["passed"]]
    assert [m["module"] for m in bad] == ["model.layers.0.mlp.experts"]
    assert "w13_weight_scale: scale factor 8.0, vLLM computes 1.0 over the rank's experts" in bad[0]["message"]
    _same_results([m for m in r2 if not m["passed"]], bad, least=1)


def test_a_free_worker_takes_the_numerics_before_any_run_of_expert_bytes():
    """Pieces are chosen when a worker is free, not when sent: runs of expert bytes sent first, then a
    layer's numerics, all waiting for a worker; the numerics go first, then the runs in the order sent.
    A piece that fails in its worker runs here; what it raises reaches whoever waits on it."""
    import threading

    from mocli.verify import pieces

    gate, order = threading.Event(), []

    class Pool:  # one worker, busy until ``gate``; it runs what ``fill`` chose in this process
        lock = threading.Lock()

        def call(self, task):
            gate.wait()
            with self.lock:
                slot = np.zeros(workers.SLOT, dtype=np.uint8)
                task.fill(slot)
                fn, args = pickle.loads(slot[8:8 + int(slot[:8].view(np.int64)[0])].tobytes())
                order.append(args[0])
                if args[0] == "fails there":
                    return False
                task.take(None, pickle.dumps(fn(*args)))
                return True

    p = pieces.Pieces(Pool(), 2, 1, threading.Semaphore(1))
    try:
        runs = [p.call(str.upper, (f"run {i}",)) for i in range(4)]
        numbers = p.call(str.upper, ("numbers",), first=True)
        bad = p.call(int, ("fails there",))
        gate.set()
        assert [f.result() for f in runs] == [f"RUN {i}" for i in range(4)] and numbers.result() == "NUMBERS"
        with pytest.raises(ValueError, match="fails there"):
            bad.result()
    finally:
        p.close()
    assert order[:1] == ["numbers"] and [a for a in order if a.startswith("run")] == [f"run {i}" for i in range(4)]
