"""``procenv.madvise``: the kernel's advice over a whole map, the GIL released during the call."""

import ctypes
import errno
import mmap

import pytest

from mocli import procenv

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_REMOVE"), reason="needs Linux's madvise advice")


def test_remove_frees_shared_anonymous_pages():
    """The workers' slots: after MADV_REMOVE a shared anonymous map reads zeros (its pages are gone),
    from the first byte to the last."""
    mm = mmap.mmap(-1, 3 * mmap.PAGESIZE)
    mm[:] = b"\x5a" * len(mm)
    procenv.madvise(mm, mmap.MADV_REMOVE)
    assert mm[:] == bytes(len(mm))
    mm.close()  # no export left behind


def test_dontneed_drops_private_pages_of_a_file_map(tmp_path):
    """verify's ``drop_pages``: a copy-on-write map's pages are dropped, so a private write is gone and
    the file's bytes read again."""
    path = tmp_path / "f"
    data = bytes(range(256)) * (2 * mmap.PAGESIZE // 256)
    path.write_bytes(data)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    mm[:4] = b"xxxx"
    procenv.madvise(mm, mmap.MADV_DONTNEED)
    assert mm[:] == data
    mm.close()


def test_read_only_map_falls_back(tmp_path):
    """A read-only map has no writable buffer for ctypes: mmap's own madvise serves it."""
    path = tmp_path / "f"
    path.write_bytes(b"\1" * mmap.PAGESIZE)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        procenv.madvise(mm, mmap.MADV_DONTNEED)
        assert mm[:] == b"\1" * mmap.PAGESIZE


def test_kernel_refusal_is_an_oserror():
    mm = mmap.mmap(-1, mmap.PAGESIZE)
    with pytest.raises(OSError) as e:
        procenv.madvise(mm, 12345)
    assert e.value.errno == errno.EINVAL
    mm.close()


def test_the_call_drops_the_gil():
    """The call goes through a ctypes foreign function of a CDLL, which releases the GIL (a PyDLL's, or
    ``mmap.madvise``, would hold it: 0.18 s per GiB of slots freed with every other thread stopped)."""
    fn = procenv._libc_madvise()
    assert fn is not None
    assert not fn._flags_ & ctypes._FUNCFLAG_PYTHONAPI
