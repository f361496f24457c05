"""Data safety: nothing this run did not create is removed or replaced; concurrent runs are refused;
failed runs say where their resumable partial output is; full and read-only disks are exit 2."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time

import pytest

from fixtures.generate import make_checkpoint
from mocli.io.shard_writer import ShardWriter
from mocli.io.splice import SplicePipes
from tests.conftest import PYTHONPATH, digest_tree

TARGET = "flashinfer-cutlass"


@pytest.fixture
def src(tmp_path):
    return make_checkpoint(tmp_path / "src", arch="mixtral", algo="FP8", experts=8, shards=2)


def _after_writes(monkeypatch, n: int, action) -> None:
    real = ShardWriter.write
    count = {"n": 0}

    def write(self, *a, **k):
        count["n"] += 1
        if count["n"] == n:
            action()
        return real(self, *a, **k)

    monkeypatch.setattr(ShardWriter, "write", write)


def test_directory_that_appears_at_out_during_the_run_is_never_replaced(cli, tmp_path, src, monkeypatch):
    out = tmp_path / "o"

    def someone_else():
        out.mkdir()
        (out / "theirs.txt").write_text("keep me")

    _after_writes(monkeypatch, 5, someone_else)
    r = cli("convert", src, "-o", out, "--target", TARGET)
    monkeypatch.undo()
    assert r.exit_code == 2 and "appeared while mocli ran" in r.stderr, r.stderr
    assert (out / "theirs.txt").read_text() == "keep me" and sorted(p.name for p in out.iterdir()) == ["theirs.txt"]
    partial = tmp_path / ".o.mocli-partial"
    assert partial.is_dir() and str(partial) in r.stderr and "resume" in r.stderr
    # the user decides: --overwrite finishes from the partial (nothing recomputed) and replaces OUT
    r = cli("--json", "convert", src, "-o", out, "--target", TARGET, "--overwrite")
    assert r.exit_code == 0 and r.json["resumed_units"] == r.json["units"]
    assert cli("convert", src, "-o", tmp_path / "clean", "--target", TARGET).exit_code == 0
    assert digest_tree(out) == digest_tree(tmp_path / "clean")


def test_an_empty_directory_at_out_is_fine(cli, tmp_path, src):
    (tmp_path / "o").mkdir()
    assert cli("convert", src, "-o", tmp_path / "o", "--target", TARGET).exit_code == 0


def test_a_foreign_partial_directory_is_left_alone(cli, tmp_path, src):
    foreign = tmp_path / ".o.mocli-partial"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    r = cli("convert", src, "-o", tmp_path / "o", "--target", TARGET)
    assert r.exit_code == 2 and "not a mocli partial" in r.stderr
    assert (foreign / "notes.txt").read_text() == "mine"


def test_interrupted_run_says_where_the_partial_is_and_how_big(cli, tmp_path, src, monkeypatch):
    def interrupt():
        raise KeyboardInterrupt

    _after_writes(monkeypatch, 6, interrupt)
    r = cli("convert", src, "-o", tmp_path / "o", "--target", TARGET)
    assert r.exit_code == 130
    line = r.stderr.strip()
    assert str(tmp_path / ".o.mocli-partial") in line and "iB)" in line and "run the same command again" in line


def _enospc_after(monkeypatch, n: int) -> dict:
    import mocli.io.shard_writer as sw

    real, count = os.pwrite, {"n": 0}

    def pwrite(fd, data, offset):
        count["n"] += 1
        if count["n"] > n:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    def spliced(*a, **k):  # every write in the tests goes through vmsplice and splice (conftest)
        count["n"] += 1
        count["spliced"] = count.get("spliced", 0) + 1
        if count["n"] > n:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_splice(*a, **k)

    real_splice = getattr(os, "splice", None)
    monkeypatch.setattr(sw.os, "pwrite", pwrite)
    monkeypatch.setattr(sw.os, "splice", spliced, raising=False)
    return count


def test_full_disk_is_exit_2_with_a_hint_and_a_resumable_partial(cli, tmp_path, src, monkeypatch):
    count = _enospc_after(monkeypatch, 8)
    r = cli("convert", src, "-o", tmp_path / "o", "--target", TARGET)
    monkeypatch.undo()
    assert count.get("spliced") or not SplicePipes().ok  # the disk filled under the path tensors are written by
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and "Traceback" not in r.stderr
    assert "No space left on device" in lines[0] and "disk is full" in lines[0] and "resume" in lines[0]
    r = cli("--json", "convert", src, "-o", tmp_path / "o", "--target", TARGET)
    assert r.exit_code == 0 and r.json["resumed_units"] > 0
    assert cli("convert", src, "-o", tmp_path / "clean", "--target", TARGET).exit_code == 0
    assert digest_tree(tmp_path / "o") == digest_tree(tmp_path / "clean")


def test_real_small_tmpfs_fills_up(cli, tmp_path, src):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        r = cli("convert", src, "-o", mnt / "o", "--target", TARGET)
        assert r.exit_code == 2 and "No space left on device" in r.stderr and "Traceback" not in r.stderr
        assert not (mnt / "o").exists()
    finally:
        subprocess.run(["umount", str(mnt)])


def test_read_only_output_location_is_exit_2(cli, tmp_path, src, monkeypatch):

    real = os.open

    def readonly(path, flags, *a, **k):
        if str(path).startswith(str(tmp_path / "ro")) and flags & (os.O_CREAT | os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, flags, *a, **k)

    (tmp_path / "ro").mkdir()
    monkeypatch.setattr(os, "open", readonly)
    r = cli("convert", src, "-o", tmp_path / "ro" / "o", "--target", TARGET)
    assert r.exit_code == 2 and "read-only" in r.stderr and "Traceback" not in r.stderr
    assert list((tmp_path / "ro").iterdir()) == []


SLOW = """
import os, sys, time
from mocli.io.shard_writer import ShardWriter
real = ShardWriter.write
def write(self, *a, **k):
    time.sleep(float(os.environ["DELAY"]))
    return real(self, *a, **k)
ShardWriter.write = write
from mocli.cli import main
main(sys.argv[1:])
"""


def _mocli(*args: str, delay: float = 0.0) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "DELAY": str(delay)}
    return subprocess.Popen([sys.executable, "-c", SLOW, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


HELD = """
import os, sys, time
from pathlib import Path
from mocli.io.shard_writer import ShardWriter
real, held = ShardWriter.write, Path(os.environ["HELD"])
def write(self, *a, **k):
    # the first write waits, holding the lock, until the test releases it: no race with the clock
    if not held.exists():
        held.write_text("holding")
        release = held.with_name("release")
        while not release.exists():
            time.sleep(0.01)
    return real(self, *a, **k)
ShardWriter.write = write
from mocli.cli import main
main(sys.argv[1:])
"""


@pytest.mark.slow
def test_second_run_on_the_same_output_is_refused_naming_the_first(tmp_path, src):
    out = tmp_path / "o"
    args = ["convert", str(src), "-o", str(out), "--target", TARGET]
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "HELD": str(tmp_path / "held")}
    first = subprocess.Popen([sys.executable, "-c", HELD, "-q", *args], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (tmp_path / "held").exists() and first.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    assert (tmp_path / "held").exists(), first.stderr.read()  # the first run holds the lock mid-write
    second = _mocli(*args)
    err = second.communicate()[1]
    (tmp_path / "release").write_text("go")
    assert second.returncode == 2, err
    assert f"pid {first.pid}" in err and "another mocli run" in err
    assert first.wait() == 0, first.stderr.read()
    assert not (tmp_path / ".o.mocli-lock").exists()
    clean = _mocli("-q", "convert", str(src), "-o", str(tmp_path / "clean"), "--target", TARGET)
    assert clean.wait() == 0
    assert digest_tree(out) == digest_tree(tmp_path / "clean")


@pytest.mark.slow
def test_runs_started_together_end_in_one_clean_output(tmp_path, src):
    for i in range(3):
        out = tmp_path / f"o{i}"
        procs = [_mocli("convert", str(src), "-o", str(out), "--target", TARGET) for _ in range(2)]
        codes = sorted(p.wait() for p in procs)
        errs = [p.stderr.read() for p in procs]
        assert codes == [0, 2], (codes, errs)
        assert not any("Traceback" in e or "internal error" in e for e in errs)
    ref = _mocli("-q", "convert", str(src), "-o", str(tmp_path / "clean"), "--target", TARGET)
    assert ref.wait() == 0
    for i in range(3):
        assert digest_tree(tmp_path / f"o{i}") == digest_tree(tmp_path / "clean")
