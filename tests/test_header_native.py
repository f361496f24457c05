"""The C reader of safetensors headers (csrc/safetensors_header.c) against the Python path it stands in for
(orjson, then ``_clean_columns``, and ``_checked_entries`` naming the fault): where the C reader answers, the
Python path accepts the same header with the same columns; where it does not, the Python path decides. It
must answer for the headers the safetensors library writes (every real export here, and generated ones), or
the fast path would quietly be off."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mocli.errors import MocliError
from mocli.io import header
from tests.conftest import REAL

C = header._NATIVE
pytestmark = pytest.mark.skipif(C is None, reason="the C header reader is not built here")
DTYPES = list(header.DTYPE_SIZES)


def _python(raw: bytes, data_size: int):
    """What the Python path reads: (names, dtypes, shapes, starts, nbytes, metadata), or None where it reads
    nothing clean (a fault it names, or a header only ``_checked_entries`` takes)."""
    try:
        parsed, metadata = header._parsed(Path("h"), raw)
    except MocliError:
        return None
    cols = header._columns(parsed, 8 + len(raw), data_size)
    return None if cols is None else (list(parsed), *cols, metadata)


def _same_or_stricter(raw: bytes, data_size: int) -> tuple:
    got, want = C.parse(raw, 8 + len(raw), data_size), _python(raw, data_size)
    if got is not None:
        assert tuple(got) == want
    return got, want


def test_every_real_header_is_read_in_c_as_in_python():
    files = sorted(REAL.rglob("*.safetensors"))
    assert len(files) > 40
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            raw = fh.read(n)
        got, want = _same_or_stricter(raw, f.stat().st_size - 8 - n)
        assert got is not None and want is not None, f


@st.composite
def _headers(draw):
    """A header as the safetensors library lays one out (tensors end to end), then perhaps spoiled."""
    entries, at = {}, 0
    for i in range(draw(st.integers(0, 6))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        size = header.DTYPE_SIZES[dtype] * (1 if not shape else __import__("math").prod(shape))
        entries[draw(st.sampled_from([f"m.{i}.weight", f"é.{i}", f"a b{i}", f"x{i}"]))] = \
            {"dtype": dtype, "shape": shape, "data_offsets": [at, at + size]}
        at += size
    if draw(st.booleans()):
        entries["__metadata__"] = {"format": draw(st.sampled_from(["pt", "ünï", "a\\\"b"]))}
    text = json.dumps(entries, ensure_ascii=draw(st.booleans()),
                      separators=draw(st.sampled_from([(",", ":"), (", ", ": "), (" ,\n", " :\t")])))
    spoil = draw(st.sampled_from(["", "swap", "dup", "float", "neg", "zero", "big", "key", "tail", "cut", "space"]))
    if spoil == "swap":  # two sizes or offsets that no longer agree
        text = text.replace("[0, ", "[1, ", 1).replace("[0,", "[1,", 1)
    elif spoil == "dup" and entries:
        name = json.dumps(next(iter(entries)), ensure_ascii=False)
        text = text.replace("{", "{" + name + ": {\"dtype\": \"U8\", \"shape\": [], \"data_offsets\": [0, 1]}, ", 1)
    elif spoil == "float":
        text = text.replace("]", ".0]", 1)
    elif spoil == "neg":
        text = text.replace("[0", "[-0", 1)
    elif spoil == "zero":
        text = text.replace("[1", "[01", 1)
    elif spoil == "big":
        text = text.replace("[0", "[100000000000000000000", 1)
    elif spoil == "key":
        text = text.replace("\"shape\"", "\"shape\": [1], \"shape\"", 1)
    elif spoil == "tail":
        text += draw(st.sampled_from(["x", "{}", " \n"]))
    elif spoil == "cut":
        text = text[:draw(st.integers(0, max(0, len(text) - 1)))]
    elif spoil == "space":
        text = " " + text.replace(":", " : ")
    slack = draw(st.sampled_from([0, 0, 3, -1]))  # data past the last tensor, or one byte short of it
    return text.encode(), max(0, at + slack), spoil


@settings(max_examples=1500, deadline=None)
@given(_headers())
def test_c_is_the_python_path_or_stricter(case):
    raw, data_size, spoil = case
    got, want = _same_or_stricter(raw, data_size)
    if spoil in ("", "space") and want is not None and b"\\" not in raw:
        assert got is not None, raw  # a clean header without escapes: C reads it


@pytest.mark.parametrize("text", [
    '{"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "a": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}',
    '{"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "b": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}',
    '{"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2], "extra": 1}}',
    '{"a": {"dtype": "U9", "shape": [2], "data_offsets": [0, 2]}}',
    '{"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 5]}}',
    '{"a": {"dtype": "U8", "shape": [' + ",".join(["1"] * 65) + '], "data_offsets": [0, 1]}}',
    '{"a": {"dtype": "I64", "shape": [99999999999999999, 99999999999999999], "data_offsets": [0, 8]}}',
    '{"__metadata__": {"k": 1}}', '{"__metadata__": null}', '{"__metadata__": {}, "__metadata__": {}}',
    '{"a\\u0062": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}', '[]', '', '{',
    '{"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}', '{"\x01": {"dtype": "U8", "shape": [], "data_offsets": [0, 1]}}',
])
def test_what_c_leaves_to_the_python_path(text):
    raw = text.encode()
    assert C.parse(raw, 8 + len(raw), 4) is None
    _same_or_stricter(raw, 4)


def test_read_header_is_the_same_with_and_without_c(monkeypatch):
    f = next(iter(sorted(REAL.rglob("*.safetensors"))))
    fast = header.read_header(f)
    monkeypatch.setattr(header, "_NATIVE", None)
    assert header.read_header(f) == fast
    assert header._columns_or_none(f, True) is not None
