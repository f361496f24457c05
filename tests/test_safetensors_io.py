"""Header parsing and tensor reads against the safetensors library, and corrupt files."""

from __future__ import annotations

import blake3
import pytest
import torch
import xxhash
from safetensors.torch import load_file, save_file

from fixtures.generate import CORRUPTIONS, corrupt, make_checkpoint
from mocli.errors import CorruptFileError
from mocli.io.safetensors_file import TensorReader, read_header
from tests.conftest import REAL_QWEN


def test_reader_matches_safetensors_on_real_export():
    ref = load_file(str(REAL_QWEN / "model.safetensors"))
    header = read_header(REAL_QWEN / "model.safetensors")
    assert set(header.tensors) == set(ref)
    with TensorReader() as r:
        for name, entry in header.tensors.items():
            got = r.read(entry)
            assert got.dtype == ref[name].dtype and got.shape == ref[name].shape, name
            assert torch.equal(got.reshape(-1).view(torch.uint8), ref[name].reshape(-1).view(torch.uint8)), name


def test_zero_dim_and_empty_tensors(tmp_path):
    f = tmp_path / "x.safetensors"
    save_file({"s": torch.tensor(2.5), "e": torch.empty(0, 4)}, str(f))
    h = read_header(f)
    assert h.tensors["s"].shape == () and h.tensors["e"].shape == (0, 4)
    with TensorReader() as r:
        assert float(r.read(h.tensors["s"])) == 2.5
        assert r.read(h.tensors["e"]).shape == (0, 4)


@pytest.mark.parametrize("kind", [k for k in CORRUPTIONS if k not in ("invalid_json", "outside_dir")])
def test_corrupt_header_raises_named_error(tmp_path, kind):
    d = make_checkpoint(tmp_path / kind)
    corrupt(d, kind)
    with pytest.raises(CorruptFileError) as e:
        read_header(d / "model.safetensors")
    assert "model.safetensors" in e.value.message


def test_too_short_file(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"\x01\x02")
    with pytest.raises(CorruptFileError, match="too short"):
        read_header(f)


def test_header_not_an_object(tmp_path):
    import struct
    f = tmp_path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", 2) + b"[]")
    with pytest.raises(CorruptFileError, match="not a JSON object"):
        read_header(f)


@pytest.mark.parametrize("a,b", [(0, 300_000), (5, 299_999), (65_537, 65_538), (70_000, 70_000), (123, 200_000)])
def test_hash_range_over_small_chunks_equals_hashlib(tmp_path, monkeypatch, a, b):
    """Reads of a small buffer at a time (a range spanning many, ending mid-chunk, empty) hash exactly
    the range."""
    import hashlib
    import os

    from mocli.io import digests

    monkeypatch.setattr(digests, "CHUNK", 1000)
    monkeypatch.setattr(digests, "WINDOW", 1 << 16)  # the mapped path: windows of 64 KiB, updates of 1000
    monkeypatch.setattr(digests, "MAP_CHUNK", 1000)
    data = os.urandom(300_000)
    (tmp_path / "f").write_bytes(data)
    for mapped in (False, True):
        h = hashlib.sha256()
        with open(tmp_path / "f", "rb") as f:
            digests.hash_range(h, f.fileno(), a, b, read=not mapped)
        assert h.hexdigest() == hashlib.sha256(data[a:b]).hexdigest()
    assert digests.file_digest(tmp_path / "f", threads=True) == xxhash.xxh3_128(data).hexdigest()
    assert digests.file_digest(tmp_path / "f", read=True) == xxhash.xxh3_128(data).hexdigest()
    assert digests.digest_or_error(tmp_path / "f", "blake3", True, False, True) == (blake3.blake3(data).hexdigest(), None)
    assert digests.file_digest(tmp_path / "f", "blake3", threads=True) == blake3.blake3(data).hexdigest()
    assert digests.file_digest(tmp_path / "f", "sha256") == hashlib.sha256(data).hexdigest()
    assert digests.file_digest(tmp_path / "f") == xxhash.xxh3_128(data).hexdigest()


def test_hash_range_past_the_end_is_an_error_not_a_short_digest(tmp_path):
    """A file that ends before the range does (it shrank after its size was taken) raises instead of
    hashing fewer bytes."""
    from mocli.io import digests

    (tmp_path / "f").write_bytes(b"x" * 5000)
    for mapped in (False, True):
        with open(tmp_path / "f", "rb") as f, pytest.raises(OSError, match="end of file at byte 5000"):
            digests.hash_range(blake3.blake3(), f.fileno(), 0, 6000, read=not mapped)


def _rss_file_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    pytest.skip("no RssFile in /proc/self/status")


def test_drop_pages_gives_back_mapped_pages_and_views_still_read_the_file(tmp_path):
    """verify views the source and the output through maps; dropping the touched pages after each
    module keeps its RSS to one module's bytes, and a view read afterwards still has the file's bytes."""
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, generator=g)
    save_file({"t": t}, str(tmp_path / "a.safetensors"))
    entry = read_header(tmp_path / "a.safetensors").tensors["t"]
    with TensorReader() as r:
        v = r.view(entry)
        before = _rss_file_kib()
        assert int(v.sum()) == int(t.sum())  # touches every page
        touched = _rss_file_kib()
        r.drop_pages()
        dropped = _rss_file_kib()
        assert touched - before > 48 << 10  # 64 MiB mapped in
        assert touched - dropped > 48 << 10  # and given back
        assert torch.equal(v, t)  # faulted back in, same bytes


def test_views_from_several_threads(tmp_path, monkeypatch):
    """verify checks bytes on a second thread through the same reader: views stay right while both
    threads map, evict and re-map files (two maps at most here, four files)."""
    from concurrent.futures import ThreadPoolExecutor

    want = {}
    for i in range(4):
        t = {f"t{i}_{j}": torch.randint(0, 256, (64, 33), dtype=torch.uint8) for j in range(3)}
        save_file(t, str(tmp_path / f"{i}.safetensors"))
        want |= {n: (tmp_path / f"{i}.safetensors", v) for n, v in t.items()}
    entries = {n: read_header(f).tensors[n] for n, (f, _) in want.items()}
    monkeypatch.setattr(TensorReader, "MAX_OPEN", 2)
    with TensorReader() as r:
        def check(k: int) -> int:
            names = list(want)
            for step in range(300):
                n = names[(k * 7 + step * 5) % len(names)]
                assert torch.equal(r.view(entries[n]), want[n][1]), n
            return k

        with ThreadPoolExecutor(4) as ex:
            assert sorted(ex.map(check, range(4))) == [0, 1, 2, 3]


def _two_files(tmp_path):
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 256, (6, 5), dtype=torch.uint8, generator=g)  # 5-byte rows: no row is aligned
    b = torch.randint(0, 256, (4, 5), dtype=torch.uint8, generator=g)
    save_file({"a": a, "pad": torch.zeros(3, dtype=torch.uint8), "b": b}, str(tmp_path / "one.safetensors"))
    save_file({"b": b}, str(tmp_path / "two.safetensors"))
    return a, b, read_header(tmp_path / "one.safetensors").tensors, read_header(tmp_path / "two.safetensors").tensors


def test_gather_array_from_one_file_or_two(tmp_path):
    """``concatenate(row ranges)[idx]`` as bytes, gathered from maps of the files' pages (the parts in
    either order in one file, or in two files), against torch's own cat and indexing."""
    import numpy as np

    from mocli.stream import BufferPool, UnitContext

    a, b, one, two = _two_files(tmp_path)
    idx = np.array([4, 0, 5, 2, 1, 3])
    as_bytes = lambda t: t.contiguous().view(torch.uint8).reshape(t.shape[0], -1).numpy()  # noqa: E731
    with TensorReader() as reader:
        ctx = UnitContext(reader, None, BufferPool())
        for parts, want in (([(one["a"], 1, 4), (one["b"], 0, 3)], torch.cat([a[1:4], b[0:3]])),
                            ([(one["b"], 1, 4), (one["a"], 3, 6)], torch.cat([b[1:4], a[3:6]])),
                            ([(one["a"], 1, 4), (two["b"], 0, 3)], torch.cat([a[1:4], b[0:3]]))):
            assert np.array_equal(ctx.gather_array(parts, idx), as_bytes(want)[idx])


def test_byte_maxima_of_spans_in_one_file_or_two(tmp_path):
    """Each span's largest byte, against numpy on the tensors' own bytes: spans given out of file order, one
    ending where its file ends, an empty one (0), spans of two files, small ones gathered and large ones
    alone; overlapping
    spans are refused and a file truncated under its spans is a named error."""
    a, b, one, two = _two_files(tmp_path)
    fa, fb = a.reshape(-1).numpy(), b.reshape(-1).numpy()
    spans = [(two["b"], 0, 20), (one["b"], 5, 15), (one["pad"], 0, 3), (one["a"], 0, 0), (one["a"], 10, 30),
             (one["a"], 0, 1)]
    want = [fb.max(), fb[5:15].max(), 0, 0, fa[10:30].max(), fa[0]]
    with TensorReader() as reader:
        assert reader.byte_maxima(spans).tolist() == [int(x) for x in want]
        reader.ALONE = 8  # spans of 8 bytes and more reduced one by one, the rest gathered
        assert reader.byte_maxima(spans).tolist() == [int(x) for x in want]
        with pytest.raises(ValueError, match="overlapping"):
            reader.byte_maxima([(one["a"], 0, 10), (one["a"], 5, 20)])
    with open(tmp_path / "two.safetensors", "r+b") as fh:
        fh.truncate(two["b"].start + 10)
    with TensorReader() as reader, pytest.raises(CorruptFileError, match="unexpected end of file reading 'b'"):
        reader.byte_maxima([(two["b"], 0, 20)])


def test_mapped_bytes_are_private_and_a_truncated_file_is_a_named_error(tmp_path):
    a, _, one, _ = _two_files(tmp_path)
    f = tmp_path / "one.safetensors"
    before = f.read_bytes()
    with TensorReader() as reader:
        t = reader.mapped(one["a"], 5, 20)
        assert torch.equal(t, a.reshape(-1)[5:20])
        t.fill_(7)  # copy-on-write: the file keeps its bytes
        assert f.read_bytes() == before
        with open(f, "r+b") as fh:
            fh.truncate(one["a"].start + 10)
        with pytest.raises(CorruptFileError, match="unexpected end of file reading 'a'"):
            reader.mapped(one["a"], 0, 20)


def test_a_file_that_cannot_be_mapped_is_read_instead(tmp_path, monkeypatch):
    """Some file systems refuse mmap: ``mapped`` says so (None, asked once per file) and the units
    read the same bytes instead."""
    import mmap

    from mocli.stream import BufferPool, UnitContext

    a, b, one, _ = _two_files(tmp_path)
    tries = []

    def refuse(*args, **kw):
        tries.append(args)
        raise OSError(19, "No such device")

    monkeypatch.setattr(mmap, "mmap", refuse)
    with TensorReader() as reader:
        ctx = UnitContext(reader, torch.device("cpu"), BufferPool())
        assert reader.mapped(one["a"], 0, 10) is None
        assert torch.equal(ctx.rows(one["b"], 1, 3), b[1:3])
        got = ctx.array(one["a"], 1, 4)  # the torch-free units' bytes: read too
        assert got.tobytes() == a[1:4].contiguous().view(torch.uint8).numpy().tobytes()
    assert len(tries) == 1


def test_preallocate_reserves_the_blocks_and_keeps_the_size(tmp_path):
    """A shard's blocks are reserved up front and its size stays what was written (appends grow it,
    a partial output reads as before); a file system without fallocate is left alone."""
    import os

    from mocli.io.shard_writer import preallocate

    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"head")
        preallocate(fd, 8 << 20, path)
        st = os.fstat(fd)
        assert st.st_size == 4
        if st.st_blocks * 512 < 8 << 20 and not _fallocate_works(tmp_path / "probe"):
            pytest.skip("this file system reserves no blocks through fallocate")
        assert st.st_blocks * 512 >= 8 << 20
        os.pwrite(fd, b"x" * 100, 4)
        assert os.fstat(fd).st_size == 104 and os.pread(fd, 104, 0) == b"head" + b"x" * 100
    finally:
        os.close(fd)


def _fallocate_works(path) -> bool:
    """Whether fallocate(2) reserves blocks here, asked of the C library directly."""
    import ctypes
    import os

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
        return libc.fallocate(fd, 1, 0, 1 << 20) == 0 and os.fstat(fd).st_blocks * 512 >= 1 << 20
    except (OSError, AttributeError):
        return False
    finally:
        os.close(fd)


def _shard_into_case(tmp_path):
    """Two files of mixed dtypes (a 0-dim, an empty, odd sizes), half of the tensors as targets."""
    files = {"a.safetensors": {"w": torch.arange(3000, dtype=torch.int32).view(30, 100), "s": torch.tensor(2.5),
                               "e": torch.empty(0, 4, dtype=torch.bfloat16), "b": torch.randn(77).to(torch.bfloat16)},
             "b.safetensors": {"u": torch.arange(1001, dtype=torch.int64).to(torch.uint8), "f": torch.randn(5, 3)}}
    for f, ts in files.items():
        save_file(ts, str(tmp_path / f))
    entries = [e for f in files for e in read_header(tmp_path / f).tensors.values()]
    return files, entries


def test_shard_into_reads_targets_in_place_and_yields_the_rest(tmp_path):
    from mocli.loader import shard_into

    files, entries = _shard_into_case(tmp_path)
    want = {n: t for f in files for n, t in load_file(str(tmp_path / f)).items()}  # safetensors' own reader
    targets = {n: torch.full_like(want[n], 7) for n in ("w", "s", "e", "u")}
    ptrs = {n: t.data_ptr() for n, t in targets.items()}
    rest = [r for r in shard_into(entries, targets)]
    assert [sorted(r) for r in rest] == [["b"], ["f"]]  # per file, in file order, the non-targets only
    for n, t in [*targets.items(), *(kv for r in rest for kv in r.items())]:
        assert t.dtype == want[n].dtype and torch.equal(t, want[n]), n
    assert {n: t.data_ptr() for n, t in targets.items()} == ptrs  # written in place, not replaced


def test_shard_into_refuses_a_strided_target(tmp_path):
    from mocli.loader import shard_into

    _, entries = _shard_into_case(tmp_path)
    with pytest.raises(ValueError, match="contiguous"):
        next(shard_into(entries, {"w": torch.zeros(100, 30, dtype=torch.int32).T}))
