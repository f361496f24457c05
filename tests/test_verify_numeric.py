"""verify's numpy number formats and decoders (``mocli.numerics.in_numpy``, ``mocli.targets.decode``) against
torch's float8 cast, the torch activation model and the test suite's own reference decoders: the
NVFP4 check runs without torch, so each numpy piece is held to an independent implementation here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mocli.numerics import in_numpy as N
from mocli.numerics.in_torch import nvfp4_quant as torch_nvfp4_quant
from mocli.targets import decode
from mocli.verify.expect import _byte_table, apply_table, bit_equal
from tests import reference as ref

F8 = torch.float8_e4m3fn


def _torch_codes(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(F8).view(torch.uint8).numpy()


def test_e4m3_values_are_torchs_for_every_code():
    codes = torch.arange(256, dtype=torch.uint8).view(F8).float().numpy()
    assert np.array_equal(codes, N.E4M3, equal_nan=True)
    assert N.E4M3[0x7E] == 448 and N.E4M3[1] == 2.0**-9 and np.isnan(N.E4M3[0xFF])


def test_e4m3_encode_is_torchs_cast():
    """Every code's value, the midpoints between neighbours (ties to even), one float32 ulp either side of
    them, signed zeros and NaNs, and four million values spread over the whole range."""
    v = N.E4M3[:0x7F].astype(np.float64)
    mids = ((v[1:] + v[:-1]) / 2).astype(np.float32)
    g = np.random.default_rng(0)
    spread = np.clip(g.standard_normal(4_000_000) * np.exp(g.uniform(-14, 7, 4_000_000)), -448, 448)
    cases = [N.E4M3[~np.isnan(N.E4M3)], mids, -mids, np.nextafter(mids, np.float32(0)),
             np.nextafter(mids, np.float32(1000)), np.array([0.0, -0.0, np.nan, -np.nan, 1e-30, -1e-30]), spread]
    for x in cases:
        x = np.asarray(x, dtype=np.float32)
        assert np.array_equal(N.e4m3_encode(x), _torch_codes(x))


@settings(max_examples=60, deadline=None)
@given(a=st.floats(2.0**-12, 2.0**8, width=32), b=st.floats(2.0**-12, 2.0**8, width=32),
       kind=st.sampled_from(["requant", "rescale"]))
def test_byte_tables_are_the_torch_formula(a, b, kind):
    """SEMANTICS §3 (requant: q * s * (1/S)) and §6 (rescale: bs * s2 / S2) evaluated in torch, the way
    verify built its tables before it ran without torch."""
    codes = torch.arange(256, dtype=torch.uint8).view(F8).float()
    sa, sb = torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32)
    vals = codes * sa * torch.reciprocal(sb) if kind == "requant" else codes * sa / sb
    want = vals.clamp(-448, 448).to(F8).view(torch.uint8).numpy()
    assert np.array_equal(_byte_table(kind, a, b), want)


def test_apply_table_gives_the_same_bytes_to_numpy_and_torch():
    q = np.random.default_rng(1).integers(0, 256, (33, 47), dtype=np.uint8)  # odd sizes: the pair lookup's tail
    got_np = apply_table("rescale", q, 0.75, 1.5)
    got_t = apply_table("rescale", torch.from_numpy(q).view(F8), torch.tensor(0.75), torch.tensor(1.5))
    assert isinstance(got_np, np.ndarray) and np.array_equal(got_np, got_t.numpy())
    assert np.array_equal(got_np, _byte_table("rescale", 0.75, 1.5)[q])
    assert apply_table("rescale", q, 2.0, 2.0) is not None and np.array_equal(apply_table("rescale", q, 2.0, 2.0), q)


def test_e2m1_round_is_the_serving_emulations_on_every_edge():
    """Every e2m1 value and midpoint (a midpoint goes to the lower value in both models), one ulp either
    side, signed zeros, saturation and infinities, and a million spread values: numpy's comparison
    count against torch's bucketize (``mocli.numerics.in_torch``), bit for bit."""
    from mocli.numerics.in_torch import e2m1_round as torch_e2m1_round

    mids = np.float32((N.E2M1[1:] + N.E2M1[:-1]) / 2)
    edges = np.concatenate([N.E2M1, mids, [0.0, 6.5, 1e9, np.inf, 1e-40]]).astype(np.float32)
    edges = np.concatenate([edges, np.nextafter(edges, np.float32(-1)), np.nextafter(edges, np.float32(99))])
    spread = (np.random.default_rng(2).standard_normal(1_000_000) * 3).astype(np.float32)
    for x in (np.concatenate([edges, -edges]), spread):
        got = N.e2m1_round(x)
        want = torch_e2m1_round(torch.from_numpy(x)).numpy()
        assert np.array_equal(got, want)
        assert np.array_equal(np.signbit(got), np.signbit(want))
    assert N.e2m1_round(mids)[:3].tolist() == [0.0, 0.5, 1.0]  # 0.25, 0.75, 1.25: to the lower value
    # NaN (a broken scale upstream) stays NaN, so the check it feeds fails (torch's sign() makes it 0)
    assert np.isnan(N.e2m1_round(np.array([np.nan, -np.nan], dtype=np.float32))).all()


@settings(max_examples=40, deadline=None)
@given(t=st.integers(1, 9), blocks=st.integers(1, 12), log_scale=st.floats(-8, 8), seed=st.integers(0, 2**31))
def test_nvfp4_quant_is_the_serving_emulations(t, blocks, log_scale, seed):
    """The activation model in numpy (verify) and in torch (the serving emulation) agree bit for bit,
    zero blocks and saturating scales included."""
    g = np.random.default_rng(seed)
    x = (g.standard_normal((t, 16 * blocks)) * np.exp(log_scale)).astype(np.float32)
    x[0, :16] = 0  # a zero block: scale 0, values 0
    gs = np.float32(np.exp(g.uniform(-6, 10)))
    got = N.nvfp4_quant(x, gs)
    want = torch_nvfp4_quant(torch.from_numpy(x), torch.tensor(gs)).numpy()
    assert np.array_equal(got.view(np.int32), want.view(np.int32))


def test_dequant_and_scaled_products_match_the_reference_decoder():
    """tests/reference.py decodes e2m1 by its own formula; the numpy table lookups must agree, NaN
    block scales included."""
    g = np.random.default_rng(2)
    packed = g.integers(0, 256, (40, 24), dtype=np.uint8)
    bs = g.integers(0, 256, (40, 3), dtype=np.uint8)
    want = ref.dequant_nvfp4(torch.from_numpy(packed), torch.from_numpy(bs).view(F8), 0.3).numpy()
    assert np.array_equal(N.dequant_nvfp4(packed, bs, 0.3), want, equal_nan=True)  # same float32 order: exact
    assert N.unpack_e2m1(np.array([[0x9F]], dtype=np.uint8)).tolist() == [[-6.0, -0.5]]  # low nibble first


@pytest.mark.parametrize("rows", [1, 7, 128, 300])
def test_scaled_matmul_is_the_reference_weight_times_x(rows, monkeypatch):
    """A GEMM on W dequantized a few rows at a time (chunks that do not divide the rows, a column slice
    of the packed bytes, with and without weight_scale_2) against float64 products of the reference
    decoder's W; a NaN block scale reaches the output rows it belongs to."""
    monkeypatch.setattr(N, "MATMUL_ROWS", 7)
    g = np.random.default_rng(rows)
    packed = g.integers(0, 256, (rows, 48), dtype=np.uint8)
    bs = g.integers(0, 0x77, (rows, 6), dtype=np.uint8)  # no NaN codes here
    x = g.standard_normal((5, 96)).astype(np.float32)
    for s2, cols in ((None, (0, 96)), (0.3, (0, 96)), (0.3, (32, 80))):
        w = ref.dequant_nvfp4(torch.from_numpy(packed), torch.from_numpy(bs).view(F8), 1.0 if s2 is None else s2)
        w = w.double().numpy()[:, cols[0]:cols[1]]
        got = N.scaled_matmul(x[:, :cols[1] - cols[0]], packed[:, cols[0] // 2:cols[1] // 2],
                              bs[:, cols[0] // 16:cols[1] // 16], s2)
        want = x[:, :cols[1] - cols[0]].astype(np.float64) @ w.T
        assert got.shape == (5, rows) and got.dtype == np.float32
        assert np.allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    bs[rows // 2, 1] = 0x7F  # NaN
    out = N.scaled_matmul(x, packed, bs)
    assert np.isnan(out[:, rows // 2]).all() and np.isfinite(np.delete(out, rows // 2, axis=1)).all()


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 300), kb=st.integers(1, 20), experts=st.integers(0, 3))
def test_decoders_give_numpy_what_they_give_torch(m, kb, experts):
    """One implementation of every inverse serves both libraries: unswizzle (padding faults too), the row
    unshuffle, the gate reorder and the halves view."""
    from mocli.ops.nvfp4 import swizzle_block_scales

    shape = (experts, m, kb) if experts else (m, kb)
    s = np.random.default_rng(m * 100 + kb).integers(0, 256, shape, dtype=np.uint8)
    sw = np.stack([swizzle_block_scales(x) for x in s]) if experts else swizzle_block_scales(s)
    got = decode.unswizzle(sw, m, kb, "t")
    assert isinstance(got, np.ndarray) and np.array_equal(got, s)
    assert np.array_equal(decode.unswizzle(torch.from_numpy(sw), m, kb, "t").numpy(), s)
    if sw.shape[-2:] != (m, kb):
        dirty = sw.copy()
        dirty.reshape(-1)[-1] = 1
        with pytest.raises(decode.LayoutError):
            decode.unswizzle(dirty, m, kb, "t")
    rows = 32 * (m % 5 + 1)
    x = torch.randint(0, 256, (rows, 4 * kb), dtype=torch.uint8)
    for fn in (decode.unshuffle_rows, decode.ungate_rows):
        assert np.array_equal(fn(x.numpy()), fn(x).numpy())
    for gated in (False, True):
        assert np.array_equal(decode.shuffled_halves(x.numpy(), gated), decode.shuffled_halves(x, gated).numpy())


def test_as_words_for_numpy_follows_torchs_alignment_rule():
    a = np.zeros((4, 16), dtype=np.uint8)
    assert decode.as_words(a).dtype == np.int64 and np.shares_memory(decode.as_words(a), a)
    assert decode.as_words(np.zeros((4, 6), dtype=np.uint8)).dtype == np.int16
    assert decode.as_words(np.zeros((4, 5), dtype=np.uint8)).dtype == np.uint8
    assert decode.as_words(a[:, 1:9]).dtype == np.uint8  # a row starting off a word boundary
    b = a.copy()
    b[2, 3] = 1
    assert not bit_equal(a, b) and bit_equal(a, a.copy()) and not bit_equal(a, a[:, :8])
    assert not bit_equal(np.array([0x00], np.uint8), np.array([0x80], np.uint8))  # +0 and -0 differ as bytes


def test_reader_arrays_are_the_files_bytes(tmp_path):
    """``TensorReader.array``: numpy views with the raw words of the dtypes numpy lacks, read-only, and a
    copy where a tensor starts off its dtype's alignment."""
    from safetensors.torch import save_file

    from mocli.io.safetensors_file import TensorReader, read_header

    ts = {"a": torch.tensor([1.5, -2.0], dtype=torch.bfloat16), "b": torch.tensor([3], dtype=torch.uint8),
          "c": torch.tensor([0.25, 7.0], dtype=torch.float32), "d": torch.tensor([448.0]).to(F8)}
    save_file(ts, tmp_path / "t.safetensors")
    h = read_header(tmp_path / "t.safetensors")
    with TensorReader() as r:
        got = {n: r.array(e) for n, e in h.tensors.items()}
        assert got["a"].dtype == np.uint16 and got["a"].tolist() == ts["a"].view(torch.int16).numpy().view(np.uint16).tolist()
        assert got["c"].tolist() == [0.25, 7.0] and got["d"].tolist() == [0x7E]
        assert not got["c"].flags.writeable
        assert torch.equal(r.view(h.tensors["c"]), ts["c"])
