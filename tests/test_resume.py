"""Interrupted conversions (Ctrl-C, kill -9) resume from the last completed unit, byte-identically."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest
import torch
import xxhash

from fixtures.generate import make_checkpoint
from mocli import stream
from tests.conftest import PYTHONPATH, digest_tree, interrupt_after, run_killed


@pytest.fixture
def moe_src(tmp_path):
    return make_checkpoint(tmp_path / "src", arch="qwen3_moe", algo="NVFP4", experts=8, shards=2)


def test_ctrl_c_then_resume(cli, tmp_path, moe_src, monkeypatch):
    out = tmp_path / "o"
    interrupt_after(monkeypatch, 30)
    r = cli("convert", moe_src, "-o", out, "--target", "flashinfer-trtllm")
    assert r.exit_code == 130 and "interrupted" in r.stderr
    assert not out.exists() and (tmp_path / ".o.mocli-partial").is_dir()
    monkeypatch.undo()
    r = cli("--json", "convert", moe_src, "-o", out, "--target", "flashinfer-trtllm")
    assert r.exit_code == 0, r.stderr
    assert 0 < r.json["resumed_units"] < r.json["units"]
    assert not (tmp_path / ".o.mocli-partial").exists()
    r = cli("convert", moe_src, "-o", tmp_path / "clean", "--target", "flashinfer-trtllm")
    assert r.exit_code == 0
    assert digest_tree(out) == digest_tree(tmp_path / "clean")


def test_partial_from_other_arguments_is_discarded(cli, tmp_path, moe_src, monkeypatch):
    out = tmp_path / "o"
    interrupt_after(monkeypatch, 10)
    assert cli("convert", moe_src, "-o", out, "--target", "flashinfer-trtllm").exit_code == 130
    monkeypatch.undo()
    r = cli("--json", "convert", moe_src, "-o", out, "--target", "flashinfer-cutlass")
    assert r.exit_code == 0 and r.json["resumed_units"] == 0
    assert cli("convert", moe_src, "-o", tmp_path / "clean", "--target", "flashinfer-cutlass").exit_code == 0
    assert digest_tree(out) == digest_tree(tmp_path / "clean")


def test_partial_with_a_damaged_shard_starts_over(cli, tmp_path, moe_src, monkeypatch):
    out = tmp_path / "o"
    interrupt_after(monkeypatch, 30)
    assert cli("convert", moe_src, "-o", out, "--target", "flashinfer-cutlass").exit_code == 130
    monkeypatch.undo()
    shard = next((tmp_path / ".o.mocli-partial").glob("model-*.safetensors"))
    with open(shard, "r+b") as f:  # the journal still lists finished units, their bytes are gone
        f.truncate(shard.stat().st_size // 2)
    r = cli("--json", "convert", moe_src, "-o", out, "--target", "flashinfer-cutlass")
    assert r.exit_code == 0 and r.json["resumed_units"] == 0
    assert cli("convert", moe_src, "-o", tmp_path / "clean", "--target", "flashinfer-cutlass").exit_code == 0
    assert digest_tree(out) == digest_tree(tmp_path / "clean")


@pytest.mark.slow
def test_kill_9_then_resume(tmp_path, moe_src):
    out = tmp_path / "o"
    args = ["-q", "convert", str(moe_src), "-o", str(out), "--target", "flashinfer-cutlass"]
    p = run_killed(args, after=25)
    assert p.returncode == -9
    assert not out.exists() and (tmp_path / ".o.mocli-partial").is_dir()
    p = subprocess.run([sys.executable, "-m", "mocli", "--json", *args[1:]], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": PYTHONPATH})
    assert p.returncode == 0, p.stderr
    import json
    assert json.loads(p.stdout)["resumed_units"] > 0
    p = subprocess.run([sys.executable, "-m", "mocli", "-q", "convert", str(moe_src), "-o", str(tmp_path / "clean"),
                        "--target", "flashinfer-cutlass"], env={**os.environ, "PYTHONPATH": PYTHONPATH})
    assert p.returncode == 0
    assert digest_tree(out) == digest_tree(tmp_path / "clean")


@pytest.mark.gpu
@pytest.mark.parametrize("target", ["flashinfer-cutlass", "flashinfer-trtllm"])
@pytest.mark.parametrize("arch,algo", [("qwen3_moe", "NVFP4"), ("mixtral", "FP8"), ("llama", "FP8"),
                                       ("llama", "FP8_PB_WO"), ("llama", "NVFP4")])
def test_cpu_and_cuda_outputs_are_identical(cli, tmp_path, target, arch, algo):
    assert torch.cuda.is_available()
    src = make_checkpoint(tmp_path / "src", arch=arch, algo=algo, unify_scale_2=False)
    for dev in ("cpu", "cuda"):
        r = cli("--json", "convert", src, "-o", tmp_path / dev, "--target", target, "--device", dev)
        assert r.exit_code == 0, r.stderr
        # a conversion only moves bytes: it runs on the CPU (numpy, no torch) whatever was asked (test_convert says why)
        assert r.json["device"] == "cpu"
    a, b = digest_tree(tmp_path / "cpu"), digest_tree(tmp_path / "cuda")
    assert a == b


@pytest.mark.parametrize("par", [[], ["--tp", "2"]])
def test_parallel_writer_lanes_give_the_same_bytes_and_resume(cli, tmp_path, moe_src, monkeypatch, par):
    """On a many-core machine files are written and hashed by several threads (one lane per file);
    the bytes, the recorded SHA-256s and an interrupted-then-resumed run must not change."""
    import json

    args = ["--target", "flashinfer-cutlass", "--max-shard-size", "150KB", *par]
    assert cli("convert", moe_src, "-o", tmp_path / "one", *args).exit_code == 0  # 2 cores: one lane
    files = [p for p in (tmp_path / "one").rglob("*.safetensors")]
    assert len(files) >= 4
    monkeypatch.setattr(os, "cpu_count", lambda: 16)  # four writer lanes, four hashing threads
    lanes = []
    real_init = stream.writer.Writer.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        lanes.append(len(self.threads))

    monkeypatch.setattr(stream.writer.Writer, "__init__", init)
    assert cli("convert", moe_src, "-o", tmp_path / "many", *args).exit_code == 0
    assert lanes == [4]
    tree = lambda d: {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
                      for p in sorted(d.rglob("*")) if p.is_file()}
    assert tree(tmp_path / "many") == tree(tmp_path / "one")
    manifest = json.loads((tmp_path / "many" / "mocli-layout.json").read_text())
    assert {k: v["xxh3_128"] for k, v in manifest["files"].items()} == \
        {str(p.relative_to(tmp_path / "many")): xxhash.xxh3_128(p.read_bytes()).hexdigest()
         for p in (tmp_path / "many").rglob("*") if p.is_file() and p.name != "mocli-layout.json"}
    restore = interrupt_after(monkeypatch, 40)  # of 68 (tp 1) or 172 (tp 2) writes
    assert cli("convert", moe_src, "-o", tmp_path / "resumed", *args).exit_code == 130
    restore()
    r = cli("--json", "convert", moe_src, "-o", tmp_path / "resumed", *args)
    assert r.exit_code == 0, r.stderr
    assert 0 < r.json["resumed_units"] < r.json["units"]
    assert tree(tmp_path / "resumed") == tree(tmp_path / "one")



def test_units_of_different_files_are_interleaved_in_proportion():
    """Two files' units alternate by their share of each file's bytes (so both lanes work at once),
    and each file's own units keep their order (files are written front to back)."""
    from types import SimpleNamespace

    a = [SimpleNamespace(id=f"a{i}", outputs=[("", "A")], input_bytes=10) for i in range(4)]
    b = [SimpleNamespace(id=f"b{i}", outputs=[("", "B")], input_bytes=20) for i in range(2)]
    where = {("", "A"): (0, 8), ("", "B"): (1, 8)}
    order = [u.id for u in stream.job._interleave(a + b, where)]
    assert order == ["a0", "b0", "a1", "a2", "b1", "a3"]
    assert [u.id for u in stream.job._interleave(a, where)] == ["a0", "a1", "a2", "a3"]


def test_units_go_in_the_order_of_their_files_bytes():
    """Planned expert by expert ([w13, w2] per expert) while the file holds every expert's w13 first:
    the stream takes them in file order (so the output's hash follows the writes), each tensor's
    units in plan order; a unit with several outputs goes by the first of them in its file."""
    from types import SimpleNamespace

    u = lambda id_, *outs: SimpleNamespace(id=id_, outputs=[("", o) for o in outs], input_bytes=1)  # noqa: E731
    units = [u("w13:0", "w13"), u("w2:0", "w2"), u("w13:1", "w13"), u("w2:1", "w2"), u("vec", "s2", "s1"),
             u("w13:2", "w13"), u("w2:2", "w2")]
    where = {("", "w13"): (0, 100), ("", "w2"): (0, 400), ("", "s1"): (0, 40), ("", "s2"): (0, 900)}
    assert [x.id for x in stream.job._interleave(units, where)] == \
        ["vec", "w13:0", "w13:1", "w13:2", "w2:0", "w2:1", "w2:2"]


def test_buffer_pool_keeps_loans_under_its_limit_but_never_blocks_a_unit_on_itself():
    import threading

    from mocli.stream import BufferPool

    pool = BufferPool(limit=100)
    a = pool.take(60)
    big = pool.take(300, own=60)  # one unit larger than the limit: it runs (its own loans don't count)
    pool.give([a, big])
    first = pool.take(80)
    got: list = []
    t = threading.Thread(target=lambda: got.append(pool.take(50)))  # another unit: 80 + 50 > 100
    t.start()
    t.join(0.3)
    assert t.is_alive() and not got  # waits for the first unit's buffer
    pool.give([first])
    t.join(5)
    assert not t.is_alive() and got[0].numel() == 50
    assert pool.out == 50
    assert pool.kept <= 100  # the free list is bounded too: the 300-byte buffer was not kept


def test_a_units_consumed_inputs_go_back_to_the_pool_before_its_pieces_are_written():
    from mocli.stream import BufferPool, Piece, UnitContext

    pool = BufferPool()
    ctx = UnitContext(None, torch.device("cpu"), pool)
    consumed = ctx.buffer((1000,), torch.uint8)  # an input the transform has read
    passed_on = ctx.buffer((300,), torch.uint8)  # an input written out as it is (a view of it)
    out = ctx.buffer((500,), torch.uint8)  # the transform's output
    pieces = [Piece(("", "a"), 0, out), Piece(("", "b"), 0, passed_on[100:])]
    held = ctx.release(pieces)
    assert {b.data_ptr() for b in held} == {out.data_ptr(), passed_on.data_ptr()}
    assert pool.out == 800  # only what the writer still needs is on loan
    assert pool.take(1000).data_ptr() == consumed.data_ptr()  # and the consumed input is reused at once


def test_a_units_numpy_pieces_are_lent_after_its_consumed_inputs_go_back_and_never_wait_on_its_own():
    """``release`` lends a unit's numpy arrays against the limit once the unit's consumed buffers are
    back, and does not count the buffers its pieces still hold as someone else's: a unit with both
    (kept 60 bytes, 60 bytes of arrays, limit 100) goes on at once; another unit's arrays wait."""
    import threading

    import numpy as np

    from mocli.stream import BufferPool, Piece, UnitContext
    from mocli.stream.pool import Loan

    pool = BufferPool(limit=100)
    ctx = UnitContext(None, torch.device("cpu"), pool)
    ctx.buffer((40,), torch.uint8)  # consumed: back before the arrays are lent
    kept = ctx.buffer((60,), torch.uint8)
    done: list = []
    t = threading.Thread(target=lambda: done.append(ctx.release(
        [Piece(("", "a"), 0, kept), Piece(("", "b"), 0, np.zeros(60, np.uint8))])))
    t.start()
    t.join(5)
    assert not t.is_alive(), "a unit waited for its own buffers"
    loans = [b for b in done[0] if isinstance(b, Loan)]
    assert [b.nbytes for b in loans] == [60] and pool.out == 120
    other: list = []
    t = threading.Thread(target=lambda: other.append(
        UnitContext(None, torch.device("cpu"), pool).release([Piece(("", "c"), 0, np.zeros(30, np.uint8))])))
    t.start()
    t.join(0.3)
    assert t.is_alive() and not other  # 120 out: the next unit's arrays wait
    pool.give(done[0])
    t.join(5)
    assert not t.is_alive() and pool.out == 30


@pytest.mark.parametrize("algo,target,par", [("FP8", "flashinfer-trtllm", []), ("FP8", "flashinfer-cutlass", ["--tp", "2"]),
                                             ("NVFP4", "flashinfer-cutlass", ["--tp", "2", "--ep", "2"]), ("NVFP4", "flashinfer-trtllm", [])])
def test_units_side_by_side_give_the_same_bytes_and_stop_at_bad_data(cli, tmp_path, monkeypatch, algo, target, par):
    """On a many-core machine several units run at once (``job.UNIT_WORKERS``, one per 4 cores: 1 on the
    build machine, so forced here): the same bytes as one at a time, and a NaN code in a weight still
    refuses the run, naming the tensor, with nothing published."""
    from safetensors.torch import load_file, save_file

    import mocli.stream.job as job_mod

    src = make_checkpoint(tmp_path / "src", arch="qwen3_moe", algo=algo)
    args = ["--target", target, *par]
    monkeypatch.setattr(job_mod, "UNIT_WORKERS", 1)
    assert cli("convert", src, "-o", tmp_path / "one", *args).exit_code == 0
    monkeypatch.setattr(job_mod, "UNIT_WORKERS", 3)
    assert cli("convert", src, "-o", tmp_path / "three", *args).exit_code == 0
    tree = lambda d: {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
                      for p in sorted(d.rglob("*")) if p.is_file()}
    assert tree(tmp_path / "three") == tree(tmp_path / "one")
    if algo != "FP8":
        return
    shard, t, name = next((f, t, n) for f in sorted(src.glob("*.safetensors")) for t in [load_file(str(f))]
                          for n in sorted(t) if n.endswith("experts.3.down_proj.weight"))
    w = t[name].clone()
    w.view(torch.uint8).view(-1)[5] = 0x7F
    t[name] = w
    save_file(t, str(shard), metadata={"format": "pt"})
    r = cli("convert", src, "-o", tmp_path / "nan", *args)
    assert r.exit_code == 1 and name in r.stderr and "NaN" in r.stderr, r.stderr
    assert not (tmp_path / "nan").exists()


def test_a_lane_s_part_of_a_unit_is_hashed_without_waiting_for_the_other_lane(tmp_path):
    """A unit written by two lanes (a tensor in each of two files): the fast lane's part goes to the hasher
    at once, so the units after it in that file are hashed from memory, not read back; the unit is
    journalled, and its buffers go back, only once both parts are written and hashed."""
    import io
    import threading
    from types import SimpleNamespace

    import numpy as np

    from mocli.io.shard_writer import ShardFile, ShardWriter, TensorSpec
    from mocli.stream.hashing import OrderedHasher
    from mocli.stream.pool import BufferPool
    from mocli.stream.units import Piece
    from mocli.stream.writer import Writer

    files = []
    for n in "ab":
        f = ShardFile(n, [TensorSpec(f"{n}.{t}", "U8", (64,), 64) for t in ("t0", "t1")], header=b"H" * 8, size=136,
                      offsets={f"{n}.t0": (8, 64), f"{n}.t1": (72, 64)})
        (tmp_path / n).write_bytes(b"H" * 8)
        files.append((n, tmp_path / n, f))
    keys = {("", f"{n}.{t}"): i for i, n in enumerate("ab") for t in ("t0", "t1")}
    shards = [(p, f) for _, p, f in files]
    writer = ShardWriter(shards, keys)
    release_b, real_write = threading.Event(), writer.write

    def write(key, offset, data):
        if key == ("", "b.t0"):
            assert release_b.wait(10)
        return real_write(key, offset, data)

    writer.write = write
    hasher = OrderedHasher(files, set(), threads=2)
    fed, real_feed = [], hasher.feed
    hasher.feed = lambda items, release: (fed.append(sorted({i for i, *_ in items})), real_feed(items, release))
    given, pool = [], BufferPool()
    pool.give = given.extend
    journal = io.StringIO()
    data = [np.full(64, i, dtype=np.uint8) for i in range(4)]
    unit = lambda id_: SimpleNamespace(id=id_)  # noqa: E731
    with Writer(writer, journal, pool, hasher, {}, {0: "a", 1: "b"}, lanes=2) as w:
        w.put(unit("both"), [Piece(("", "a.t0"), 0, data[0]), Piece(("", "b.t0"), 0, data[1])], ["buf"])
        w.put(unit("a-next"), [Piece(("", "a.t1"), 0, data[2])], [])
        for _ in range(1000):
            if fed == [[0], [0]]:
                break
            threading.Event().wait(0.01)
        assert fed == [[0], [0]]  # file a's part of "both", then "a-next", while b's lane still waits
        assert "both" not in journal.getvalue() and given == []
        release_b.set()
        w.put(unit("b-next"), [Piece(("", "b.t1"), 0, data[3])], [])
    digests = hasher.digests()
    assert journal.getvalue().splitlines()[:2] in (["a-next\ta=136", "both\ta=72\tb=72"],)
    assert given == ["buf"]
    for i, n in enumerate("ab"):
        assert digests[i]["xxh3_128"] == xxhash.xxh3_128((tmp_path / n).read_bytes()).hexdigest()
