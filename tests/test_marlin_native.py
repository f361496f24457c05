"""The C byte moves (csrc/marlin_repack.c through mocli.ops.marlin_native, csrc/marlin_decode.c through
mocli.targets.marlin_decode) against the numpy passes they replace, which test_marlin_ops holds to vLLM's
python reference, as it holds the C paths (its ``byte_moves`` cases): any shape, a source whose rows are
not contiguous with each other (a column slice), an output that is part of a wider one, any run of
groups; the arguments the C code would misread are refused before it runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mocli.io import header
from mocli.ops import marlin, marlin_native
from mocli.targets import marlin_decode

needs_c = pytest.mark.skipif(not (marlin_native.OK and marlin_decode.NATIVE), reason="the C byte moves are not built here")


def test_built_wherever_a_compiler_is():
    """pip builds the extensions where it finds a C compiler (``$CC``, else the one Python was built with)
    and Python's headers; a build that broke quietly (setup.py, a compile error) would leave every C test
    skipped and the slow path on."""
    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    headers = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    if shutil.which(cc) is None or not headers or os.environ.get("MOCLI_NATIVE") == "0":
        pytest.skip(f"no {cc} or no Python.h here: the numpy passes serve")
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        pytest.skip("a free-threaded Python has no limited API: the numpy passes serve")
    assert marlin_native.OK and marlin_decode.NATIVE, f"{cc} is here but the C byte moves are not built: pip install -e ."
    assert header._NATIVE is not None, f"{cc} is here but the C header reader is not built: pip install -e ."


def test_mocli_native_0_turns_them_off():
    code = ("from mocli.ops import marlin_native as n; from mocli.targets import marlin_decode as d; "
            "from mocli.io import header as h; print(n.OK, d.NATIVE, h._NATIVE is not None)")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "MOCLI_NATIVE": "0"}).stdout.strip()
    assert got == "False False False"


@needs_c
@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.integers(1, 40), st.integers(0, 16), st.integers(0, 2**31))
def test_repack_is_the_numpy_one(n, k16, extra, seed):
    """Any N and K (padding in both), from a column slice of a wider source, into the second half of a
    wider output (an MoE w13), one run of groups at a time: what numpy writes, and nothing around it."""
    k = 16 * k16
    g = np.random.default_rng(seed)
    wide = g.integers(0, 256, (n, k // 2 + 8 * extra), dtype=np.uint8)
    w = wide[:, 8 * extra:]  # rows not contiguous with each other
    np_, kp = marlin.padded_nk(n, k)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(marlin_native, "OK", False)
        want = marlin.repack(np.ascontiguousarray(w), np_, kp)
    out = np.full((kp // 16, 16 * np_), 0xA5, dtype=np.uint8)
    half = out[:, 8 * np_:]
    groups = np_ // 64
    cut = int(g.integers(0, groups + 1))
    marlin_native.repack(w, kp, half, 0, cut)
    marlin_native.repack(w, kp, half, cut, groups)
    assert np.array_equal(half, want)
    assert (out[:, :8 * np_] == 0xA5).all()


@needs_c
@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.integers(1, 40), st.integers(0, 2**31))
def test_decode_is_the_numpy_one(n, k16, seed):
    """The inverse of any stored bytes, padding rows and columns included (nonzero there too), as numpy's
    decode reads them, in runs of groups; and of a repack, the weight back."""
    k = 16 * k16
    g = np.random.default_rng(seed)
    np_, kp = marlin.padded_nk(n, k)
    stored = g.integers(0, 256, (kp // 16, 8 * np_), dtype=np.uint8)
    groups = np_ // 64
    cut = int(g.integers(0, groups + 1))
    got, want = (np.full((np_ + 64, kp // 2), 0xA5, dtype=np.uint8) for _ in range(2))
    assert marlin_decode._c_decoded(stored, got, [(0, cut), (cut, groups)])
    # the words a column slice of wider rows, the result a column slice of a wider array
    wide = np.zeros((kp // 16, 8 * np_ + 512), dtype=np.uint8)
    wide[:, 512:] = stored
    into = np.full((np_, kp // 2 + 24), 0x5A, dtype=np.uint8)
    assert marlin_decode._c_decoded(wide[:, 512:], into[:, 8:8 + kp // 2], [(0, groups)])
    assert np.array_equal(into[:, 8:8 + kp // 2], got[:np_]) and (into[:, :8] == 0x5A).all() and (into[:, 8 + kp // 2:] == 0x5A).all()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(marlin_decode, "NATIVE", False)
        marlin_decode._decode_blocks(stored.view(np.uint64), want, [(0, groups)], groups)
    assert np.array_equal(got, want) and (got[np_:] == 0xA5).all()
    w = g.integers(0, 256, (n, k // 2), dtype=np.uint8)
    assert np.array_equal(marlin_decode.decode_weight(marlin.repack(w, np_, kp), n, k, "w"), w)


@needs_c
@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.integers(1, 40), st.integers(0, 2**31), st.sampled_from([1.0, 4.0]),
       st.booleans())
def test_scales_are_the_numpy_ones(n, k32, seed, sf, spoil):
    """Block scales back from any stored bytes, NVFP4's through the E5M3 table and MXFP4's as they are,
    padding to be zero (NVFP4) or the manifest's code (MXFP4): the numpy path's result, or its refusal."""
    from mocli.targets import mxfp4_marlin_decode as mx
    from mocli.targets.decode import LayoutError

    k = 32 * k32
    g = np.random.default_rng(seed)
    np_, kp = marlin.padded_nk(n, k)
    nv = marlin.permute_scales(g.integers(0, 0x60, (n, k // 16), dtype=np.uint8), np_, kp, marlin.scale_table(sf))
    mxs = g.integers(0, 256, (kp // 32, np_), dtype=np.uint8)
    fill = int(mxs[-1, -1])
    if spoil:  # a stored byte anywhere: in padding where there is some
        nv[g.integers(0, nv.shape[0]), g.integers(0, np_)] = 3
    cases = {"nvfp4": lambda: marlin_decode.decode_scales(nv, n, k // 16, sf, "s"),
             "mxfp4": lambda: mx.decode_scales(mxs, n, k // 32, "s", fill=fill)}
    for what, call in cases.items():
        got = want = None
        try:
            got = call()
        except LayoutError as e:
            got = str(e)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(marlin_decode, "NATIVE", False)
            try:
                want = call()
            except LayoutError as e:
                want = str(e)
        assert type(got) is type(want) and (got == want if isinstance(got, str) else np.array_equal(got, want)), what


@needs_c
def test_arguments_the_c_code_would_misread_are_refused():
    """The repack raises; the decode's check sends the blocks to numpy instead (a view it cannot take)."""
    w = np.zeros((128, 128), dtype=np.uint8)
    np_, kp = marlin.padded_nk(128, 256)
    out = np.zeros((kp // 16, 8 * np_), dtype=np.uint8)
    bad = {
        "words with fewer rows than Kp/16": lambda: marlin_native.repack(w, kp, out[:-1], 0, 2),
        "a weight read backwards": lambda: marlin_native.repack(w[::-1], kp, out, 0, 2),
        "a weight whose rows overlap": lambda: marlin_native.repack(
            np.lib.stride_tricks.as_strided(w, (128, 128), (64, 1)), kp, out, 0, 2),
        "groups past the output": lambda: marlin_native.repack(w, kp, out, 0, 3),
        "a weight of another dtype": lambda: marlin_native.repack(w.view(np.int8), kp, out, 0, 2),
        "a transposed weight": lambda: marlin_native.repack(w.T, kp, out, 0, 2),
        "K not a multiple of 16": lambda: marlin_native.repack(w[:, :124], kp, out, 0, 2),
        "a read-only output": lambda: marlin_native.repack(w, kp, np.broadcast_to(out, out.shape), 0, 2),
    }
    for what, call in bad.items():
        with pytest.raises(ValueError):
            call()
            pytest.fail(what)
    assert not out.any()
    # what C would misread, the repack itself hands to numpy
    back = np.random.default_rng(3).integers(0, 256, (128, 128), dtype=np.uint8)[::-1]
    assert not marlin_native.takes(back, kp, out, 2)
    assert np.array_equal(marlin.repack(back, np_, kp), marlin.repack(np.ascontiguousarray(back), np_, kp))
    rows = np.zeros((128, kp // 2), dtype=np.uint8)
    for words, into, blocks in ((out, rows[:64], [(0, 2)]), (out, rows[:, :-1], [(0, 2)]), (out, rows, [(0, 3)]),
                                (out.T, rows, [(0, 1)]), (out, np.broadcast_to(rows, rows.shape), [(0, 2)]),
                                (out[::-1], rows, [(0, 2)]), (out, rows[::-1], [(0, 2)])):
        assert not marlin_decode._c_decoded(words, into, blocks)
    assert not rows.any()
    scales, table = np.zeros((16, 128), dtype=np.uint8), np.arange(256, dtype=np.uint8)
    for raw, n, kb in ((scales[:, :100], 100, 16), (scales, 129, 16), (scales, 128, 17), (scales, 0, 16),
                       (scales.view(np.int8), 128, 16), (scales[:, ::2], 64, 16)):
        assert not marlin_decode.c_takes_scales(raw, n, kb)
        with pytest.raises(ValueError):
            marlin_decode.scales_in_c(raw, n, kb, table, 0, "s")
    with pytest.raises(ValueError):
        marlin_decode.scales_in_c(scales, 128, 16, table[:255], 0, "s")


@needs_c
@settings(max_examples=80, deadline=None)
@given(st.integers(2, 300), st.integers(1, 40), st.integers(0, 2**31), st.sampled_from(["halves", "slice", "odd-even"]),
       st.sampled_from(["none", "stored", "padding", "source"]))
def test_weight_matches_is_the_decodes_verdict(n, k16, seed, shape, spoil):
    """``weight_matches`` says True exactly where numpy's decode of the whole stored image (padding rows and
    columns included) is the parts' rows and zeros elsewhere: for halves with padding rows between them (an
    MoE w13), a column slice of a wider source (w2 under tensor parallelism) and interleaved rows; a byte
    spoiled in the words, in Marlin's padding or in the source is seen."""
    k = 16 * k16
    g = np.random.default_rng(seed)
    np_, kp = marlin.padded_nk(n, k)
    half = n // 2
    wide = g.integers(0, 256, (n, k // 2 + 8), dtype=np.uint8)
    if shape == "halves":  # two halves of n // 2 rows, each followed by padding rows
        parts = [(slice(0, half - 1), wide[:half - 1, 8:]), (slice(half, n - 1), wide[half:n - 1, 8:])]
    elif shape == "slice":
        parts = [(slice(None), wide[:, 8:])]
    else:
        parts = [(slice(1, n, 2), wide[1::2, 8:]), (slice(0, n, 2), wide[0::2, 8:])]
    image = np.zeros((n, k // 2), dtype=np.uint8)
    for rows, part in parts:
        image[rows] = part
    stored = marlin.repack(image, np_, kp)
    if spoil == "stored":
        stored[g.integers(0, stored.shape[0]), g.integers(0, stored.shape[1])] ^= np.uint8(1 << int(g.integers(0, 8)))
    elif spoil == "padding" and (np_ > n or kp > k):
        full = np.zeros((np_, kp // 2), dtype=np.uint8)
        full[:n, :k // 2] = image
        full[int(g.integers(n, np_)) if np_ > n else 0, kp // 2 - 1 if kp > k else 0] = 0x10
        stored = marlin.repack(full, np_, kp)
    elif spoil == "source":
        rows, part = parts[int(g.integers(0, len(parts)))]
        if part.size:
            part[g.integers(0, part.shape[0]), g.integers(0, part.shape[1])] ^= np.uint8(0x80)
    with pytest.MonkeyPatch.context() as mp:  # the verdict of numpy's decode of the whole image
        mp.setattr(marlin_decode, "NATIVE", False)
        back = np.zeros((np_, kp // 2), dtype=np.uint8)
        marlin_decode._decode_blocks(stored.view(np.uint64), back, [(0, np_ // 64)], np_ // 64)
    want = np.zeros_like(back)
    for rows, part in parts:
        want[:n][rows, :k // 2] = part
    assert marlin_decode.weight_matches(stored.view(np.int32), n, k, parts) == np.array_equal(back, want)
    assert marlin_decode.weight_matches(stored, n, k, parts) == np.array_equal(back, want)


@needs_c
def test_weight_matches_refuses_what_it_cannot_show():
    """Arguments C would misread, and parts that do not tile what ``decode_weight`` returns: False, never a
    guess (the caller then decodes)."""
    n, k = 128, 256
    np_, kp = marlin.padded_nk(n, k)
    w = np.random.default_rng(5).integers(0, 256, (n, k // 2), dtype=np.uint8)
    stored = marlin.repack(w, np_, kp)
    assert marlin_decode.weight_matches(stored, n, k, [(slice(0, 64), w[:64]), (slice(64, n), w[64:])])
    wider = np.zeros((stored.shape[0], stored.shape[1] + 512), dtype=np.uint8)
    wider[:, :stored.shape[1]] = stored
    bad = {
        "words that are a column slice": (wider[:, :stored.shape[1]], [(slice(None), w)]),
        "parts that overlap": (stored, [(slice(0, 96), w[:96]), (slice(64, n), w[64:])]),
        "a part of other rows than its slice": (stored, [(slice(0, 64), w[:63])]),
        "a part read backwards": (stored, [(slice(None), w[::-1])]),
        "a part whose bytes are not contiguous": (stored, [(slice(None), np.repeat(w, 2, axis=1)[:, ::2])]),
        "a part of wider items": (stored, [(slice(None), w.view(np.uint16))]),
        "a slice stepping back": (stored, [(slice(None, None, -1), w[::-1].copy())]),
        "rows past n": (stored, [(slice(0, n + 64), np.zeros((n + 64, k // 2), dtype=np.uint8))]),
    }
    for what, (words, parts) in bad.items():
        assert not marlin_decode.weight_matches(words, n, k, parts), what
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(marlin_decode, "NATIVE", False)
        assert not marlin_decode.weight_matches(stored, n, k, [(slice(None), w)])
