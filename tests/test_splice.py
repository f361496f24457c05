"""Writes through vmsplice and splice (``mocli.io.splice``): the bytes land where pwrite would put them,
the buffer is free once the call returns, and every way the path can fail either falls back to pwrite
with the same bytes or raises the file's own error."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest

from mocli.io import splice
from mocli.io.shard_writer import ShardFile, ShardWriter, TensorSpec
from mocli.io.splice import PIPE_BYTES, SplicePipes

pytestmark = pytest.mark.skipif(splice._vmsplice() is None, reason="no vmsplice here (not Linux, or not glibc)")


def _data(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _write(pipes: SplicePipes, path, data: np.ndarray, pos: int = 0, n: int | None = None, flags: int = 0) -> int:
    """``write_at`` of ``data`` (its first ``n`` bytes) into ``path`` at ``pos``: what it returned."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | flags)
    try:
        return pipes.write_at(fd, data.ctypes.data, data.nbytes if n is None else n, pos)
    finally:
        os.close(fd)


def test_bytes_land_at_the_offset_across_many_pipe_fills(tmp_path):
    path, pipes = tmp_path / "f", SplicePipes()
    data = _data(3 * PIPE_BYTES + 12345)
    path.write_bytes(b"\xaa" * 100)
    assert _write(pipes, path, data, pos=77) == data.nbytes
    pipes.close()
    raw = path.read_bytes()
    assert raw[:77] == b"\xaa" * 77 and raw[77:] == data.tobytes() and pipes.ok


def test_the_buffer_may_change_as_soon_as_the_call_returns(tmp_path):
    """vmsplice lends the pages to the pipe: they must be in the file's page cache before it returns."""
    path, pipes = tmp_path / "f", SplicePipes()
    data = _data(2 * PIPE_BYTES, seed=1)
    want = data.tobytes()
    _write(pipes, path, data)
    data[:] = 0
    pipes.close()
    assert path.read_bytes() == want


def test_small_writes_and_refused_files_are_left_to_pwrite(tmp_path):
    pipes, data = SplicePipes(), _data(PIPE_BYTES)
    assert _write(pipes, tmp_path / "f", data, n=splice.MIN_BYTES - 1) == 0 and pipes.ok
    assert _write(pipes, tmp_path / "g", data, flags=os.O_APPEND) == 0  # splice refuses an offset here (EINVAL)
    assert not pipes.ok  # and from now on every write goes to pwrite
    assert _write(pipes, tmp_path / "h", data) == 0
    pipes.close()


def test_shard_writer_writes_the_same_bytes_with_and_without_splicing(tmp_path, monkeypatch):
    data = _data(PIPE_BYTES + 4097, seed=2)
    outs = []
    for env in ("0", "1"):
        monkeypatch.setenv("MOCLI_NO_SPLICE", env)
        f = ShardFile("x.bin", [TensorSpec("t", "U8", (data.nbytes,), data.nbytes)], offsets={"t": (8, data.nbytes)})
        path = tmp_path / f"x{env}.bin"
        path.write_bytes(b"\0" * 8)
        w = ShardWriter([(path, f)], {("g", "t"): 0})
        assert w._pipes.ok == (env == "0")
        spliced, real = [], w._pipes.write_at
        w._pipes.write_at = lambda *a, spliced=spliced, real=real: spliced.append(real(*a)) or spliced[-1]
        w.write(("g", "t"), 0, data[:100_000])
        w.write(("g", "t"), 100_000, data[100_000:])
        w.close()
        assert sum(spliced) == (data.nbytes if env == "0" else 0)  # all spliced, or none
        outs.append(path.read_bytes())
    assert outs[0] == outs[1] == b"\0" * 8 + data.tobytes()


def test_unaligned_read_only_and_mapped_buffers(tmp_path):
    """vmsplice reads the pages it is lent: a buffer that starts mid-page, a read-only array and an array
    over a file's read-only map (as a mapped source tensor is) all land whole."""
    import mmap

    pipes, data = SplicePipes(), _data(PIPE_BYTES + 999, seed=5)
    src = tmp_path / "src"
    src.write_bytes(data.tobytes())
    with open(src, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
        mapped = np.frombuffer(m, dtype=np.uint8)
        cases = {"unaligned": data[1:], "read-only": np.frombuffer(data.tobytes(), dtype=np.uint8), "mapped": mapped[3:]}
        for name, buf in cases.items():
            assert _write(pipes, tmp_path / name, buf) == buf.nbytes, name
            assert (tmp_path / name).read_bytes() == buf.tobytes(), name
        del mapped, buf, cases
    pipes.close()
    assert pipes.ok


def test_a_full_disk_is_raised_as_pwrite_would_raise_it(tmp_path, monkeypatch):
    pipes, data = SplicePipes(), _data(2 * PIPE_BYTES, seed=3)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(splice.os, "splice", full)
    with pytest.raises(OSError) as e:
        _write(pipes, tmp_path / "f", data)
    assert e.value.errno == errno.ENOSPC and pipes.ok  # the path works; the disk is full
    monkeypatch.undo()
    assert _write(pipes, tmp_path / "f", data) == data.nbytes  # the pipe that held bytes was dropped: a clean start
    pipes.close()
    assert (tmp_path / "f").read_bytes() == data.tobytes()


def test_threads_write_through_pipes_of_their_own_and_close_closes_them(tmp_path):
    before = len(os.listdir("/proc/self/fd"))
    pipes = SplicePipes()
    datas = [_data(PIPE_BYTES * 2 + i, seed=10 + i) for i in range(4)]

    def one(i: int) -> None:
        for _ in range(3):
            _write(pipes, tmp_path / f"f{i}", datas[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(pipes._open) == 4
    pipes.close()
    assert len(os.listdir("/proc/self/fd")) == before
    assert all((tmp_path / f"f{i}").read_bytes() == datas[i].tobytes() for i in range(4))


def test_a_real_full_tmpfs_raises_enospc(tmp_path):
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    pipes, data = SplicePipes(), _data(PIPE_BYTES, seed=4)
    try:
        with pytest.raises(OSError) as e:
            _write(pipes, mnt / "f", data)
        assert e.value.errno == errno.ENOSPC
    finally:
        pipes.close()
        subprocess.run(["umount", str(mnt)], check=True)
