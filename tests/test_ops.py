"""Pure transforms against hand-computed values, the explicit formulas, and FlashInfer where importable."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mocli.numerics.in_torch import unpack_e2m1
from mocli.ops import fp8, nvfp4
from mocli.ops.rows import gated_act_row_indices, gated_shuffled_row_indices
from mocli.ops.rows import shuffle_row_indices as _shuffle_np
from mocli.targets import decode
from tests import reference as ref


def shuffle_row_indices(m: int) -> torch.Tensor:
    return torch.from_numpy(_shuffle_np(m).copy())


def gated_rows(m: int) -> torch.Tensor:
    return torch.from_numpy(gated_act_row_indices(m).copy())


def swizzle_block_scales(s: torch.Tensor) -> torch.Tensor:
    """The numpy swizzle on a tensor's bytes ([E, M, Kb]: per expert), back as a tensor of s's dtype."""
    raw = s.view(torch.uint8).numpy()
    out = np.stack([nvfp4.swizzle_block_scales(x) for x in raw]) if raw.ndim == 3 else nvfp4.swizzle_block_scales(raw)
    return torch.from_numpy(out).view(s.dtype)


def test_e2m1_unpack_hand_values():
    # byte 0x21: low nibble 1 (0.5) first, high nibble 2 (1.0); 0xF8: 8 (-0.0), 15 (-6)
    out = unpack_e2m1(torch.tensor([[0x21, 0xF8]], dtype=torch.uint8))
    assert out.tolist() == [[0.5, 1.0, -0.0, -6.0]]


@pytest.mark.parametrize("shape", [(128, 4), (130, 3), (300, 9), (1, 1), (256, 16)])
def test_swizzle_matches_explicit_offsets(shape):
    s = torch.randint(0, 256, shape, dtype=torch.uint8)
    assert torch.equal(swizzle_block_scales(s), ref.swizzle_by_offsets(s))


def test_swizzle_hand_positions():
    # (m=1, k=0) -> offset 16; (m=32, k=0) -> 4; (m=0, k=4) -> 512 (Kp=8)
    s = torch.zeros(128, 8, dtype=torch.uint8)
    s[1, 0], s[32, 0], s[0, 4] = 1, 2, 3
    flat = swizzle_block_scales(s).reshape(-1)
    assert flat[16] == 1 and flat[4] == 2 and flat[512] == 3


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 300), kb=st.integers(1, 20), experts=st.integers(0, 3))
def test_unswizzle_inverts_swizzle(m, kb, experts):
    shape = (experts, m, kb) if experts else (m, kb)
    s = torch.randint(0, 256, shape, dtype=torch.uint8).view(torch.float8_e4m3fn)
    sw = swizzle_block_scales(s)
    back = torch.stack([decode.unswizzle(x, m, kb, "t") for x in sw]) if experts else decode.unswizzle(sw, m, kb, "t")
    assert torch.equal(back.view(torch.uint8), s.view(torch.uint8))
    if experts:  # stacked experts at once (verify's batched bytes check), padding still checked in each
        assert torch.equal(decode.unswizzle(sw, m, kb, "t").view(torch.uint8), s.view(torch.uint8))
        if sw.shape[-2:] != (m, kb):
            dirty = sw.clone().view(torch.uint8)
            dirty[-1].view(-1)[-1] = 1  # the last expert's last byte: padding in the 128x4 tiles
            with pytest.raises(decode.LayoutError):
                decode.unswizzle(dirty, m, kb, "t")


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 300), kb=st.integers(1, 20), experts=st.integers(0, 3), where=st.integers(0, 1 << 30))
def test_numpy_unswizzle_matches_the_reference_offsets(m, kb, experts, where):
    """NVFP4 verify unswizzles numpy arrays by the offset formula's digits (a reshape of 4-byte words),
    not the gather the torch path uses: both against the reference's own offset gather, stacked experts
    at once, and a non-zero byte anywhere in the padding (rows past m, columns past kb) refused."""
    shape = (experts, m, kb) if experts else (m, kb)
    s = torch.randint(0, 256, shape, dtype=torch.uint8)
    flat = [ref.swizzle_by_offsets(x) for x in (s if experts else [s])]
    sw = torch.stack(flat) if experts else flat[0]
    got = decode.unswizzle(sw.numpy(), m, kb, "t")
    assert isinstance(got, np.ndarray) and got.shape == shape
    want = torch.stack([ref.unswizzle_by_offsets(f, m, kb) for f in flat]) if experts else \
        ref.unswizzle_by_offsets(sw, m, kb)
    assert np.array_equal(got, want.numpy())
    assert np.array_equal(got, decode.unswizzle(sw, m, kb, "t").numpy())  # the torch gather
    mp, kp = sw.shape[-2:]
    pad = [(r, c) for r in range(mp) for c in range(kp) if r >= m or c >= kb]
    if pad:  # the last matrix with one padding element set, swizzled by the formula as a whole
        r, c = pad[where % len(pad)]
        grown = torch.zeros((mp, kp), dtype=torch.uint8)
        grown[:m, :kb] = s[-1] if experts else s
        grown[r, c] = 1
        dirty = sw.clone()
        dirty[-1 if experts else ...] = ref.swizzle_by_offsets(grown)
        with pytest.raises(decode.LayoutError):
            decode.unswizzle(dirty.numpy(), m, kb, "t")


def test_shuffle_and_reorder_match_loops():
    x = torch.arange(128 * 2).reshape(128, 2)
    assert torch.equal(x[shuffle_row_indices(128)], ref.shuffle_rows(x))
    assert torch.equal(x[gated_rows(128)], ref.gated_reorder(x))
    with pytest.raises(ValueError):
        shuffle_row_indices(48)


@pytest.mark.flashinfer
def test_layout_helpers_match_flashinfer():
    fi = pytest.importorskip("flashinfer")
    from flashinfer.fused_moe.core import reorder_rows_for_gated_act_gemm

    x = torch.randint(0, 256, (256, 64), dtype=torch.uint8)
    assert torch.equal(x[shuffle_row_indices(256)], fi.shuffle_matrix_a(x, 128))
    assert torch.equal(x[gated_rows(256)], reorder_rows_for_gated_act_gemm(x))


@settings(max_examples=30, deadline=None)
@given(blocks=st.integers(1, 6), cols=st.integers(1, 9))
def test_row_orders_are_undone_by_their_independent_inverses(blocks, cols):
    x = torch.randint(0, 256, (32 * blocks, cols), dtype=torch.uint8)
    assert torch.equal(decode.unshuffle_rows(x[shuffle_row_indices(32 * blocks)]), x)
    assert torch.equal(decode.ungate_rows(x[gated_rows(32 * blocks)]), x)
    v = torch.arange(32 * blocks)  # a vector (per-row scales): its elements are the rows
    assert torch.equal(decode.unshuffle_rows(v[shuffle_row_indices(32 * blocks)]), v)
    assert torch.equal(decode.ungate_rows(v[gated_rows(32 * blocks)]), v)
    # three experts stacked: each one's rows undone on its own (rows are the second-to-last dim)
    e = torch.randint(0, 256, (3, 32 * blocks, cols), dtype=torch.uint8)
    idx = torch.from_numpy(gated_shuffled_row_indices(32 * blocks).copy())
    assert torch.equal(decode.ungate_rows(decode.unshuffle_rows(e[:, idx])), e)
    assert np.array_equal(nvfp4.permute_rows(x.numpy(), _shuffle_np(32 * blocks)), ref.shuffle_rows(x).numpy())
    # the numpy gathers move the same rows, from one array or from parts without concatenating them
    assert np.array_equal(nvfp4.permute_rows(x.numpy(), gated_shuffled_row_indices(32 * blocks)),
                          decode_free_gather(x, idx))
    half = 16 * blocks
    parts = [x.numpy()[:half], x.numpy()[half:]]
    assert np.array_equal(nvfp4.gather_rows(parts, gated_shuffled_row_indices(32 * blocks)),
                          decode_free_gather(x, idx))


def requantize_fp8(q: torch.Tensor, s: torch.Tensor, big: torch.Tensor) -> torch.Tensor:
    """The numpy requantization (``ops.fp8``) on a tensor's bytes, back as a float8 tensor."""
    raw = q.view(torch.uint8).numpy()
    return torch.from_numpy(np.array(fp8.requantize_fp8(raw, s.numpy(), big.numpy()))).view(torch.float8_e4m3fn)


def has_nan_fp8(t: torch.Tensor) -> bool:
    return fp8.has_nan_fp8(t.view(torch.uint8).numpy())


def decode_free_gather(x: torch.Tensor, idx: torch.Tensor) -> np.ndarray:
    return np.stack([x[int(i)].numpy() for i in idx])


def test_tables_equal_the_float_formulas_for_every_code():
    """The byte tables give exactly the bytes of SEMANTICS §3/§6 evaluated element by element."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn)
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        s = torch.rand((), generator=g) * 10 ** float(torch.randint(-6, 1, (), generator=g))
        big = s * (1 + torch.rand((), generator=g) * 20)
        assert torch.equal(requantize_fp8(codes, s, big).view(torch.uint8), ref.fp8_requant(codes, s, big).view(torch.uint8))
        want = (codes.float() * s / big).clamp(-448, 448).to(torch.float8_e4m3fn)
        got = fp8.rescale_block_scales(codes.view(torch.uint8).numpy(), s.numpy(), big.numpy())
        assert np.array_equal(got, want.view(torch.uint8).numpy())
    odd = codes[:5]  # an odd byte count takes the tail path
    assert torch.equal(requantize_fp8(odd, s, big).view(torch.uint8), ref.fp8_requant(odd, s, big).view(torch.uint8))


def test_nan_codes_are_found():
    x = torch.zeros(1000, dtype=torch.uint8)
    assert not has_nan_fp8(x)
    for code in (0x7F, 0xFF):
        x[777] = code
        assert has_nan_fp8(x.view(torch.float8_e4m3fn))
    x[777] = 0xFE  # -448, the largest magnitude: finite
    assert not has_nan_fp8(x)
    # the tables keep NaN as NaN (convert refuses such input rather than hiding it)
    q = torch.tensor([0x7F, 0xFF, 0x10], dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert has_nan_fp8(requantize_fp8(q, torch.tensor(1.0), torch.tensor(2.0)))


def test_pad_2d_zero_fills():
    p = nvfp4.pad_2d(np.full((3, 5), 7, dtype=np.uint8), 4, 8)
    assert p.shape == (4, 8) and p.dtype == np.uint8
    assert p.sum() == 7 * 15 and p[3].sum() == 0 and p[:, 5:].sum() == 0


def test_numpy_fp8_rounding_is_torchs_cast():
    """The numpy e4m3 encoder (NVFP4 rescaling without torch) against torch's own cast: every code's
    value, every midpoint between neighbours (the ties), both signs, zeros, saturation, NaN, and a
    million random values across the range."""
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn).float()
    pos = finite[finite > 0].sort().values
    g = torch.Generator().manual_seed(3)
    x = torch.cat([finite, (pos[1:] + pos[:-1]) / 2, -(pos[1:] + pos[:-1]) / 2, pos / 3, pos * 1.0001,
                   torch.tensor([0.0, -0.0, 448, 449, 464, 465, 1e9, -1e9, float("inf"), -float("inf"), 1e-12]),
                   torch.randn(10**6, generator=g) * 10 ** torch.randint(-8, 3, (10**6,), generator=g)])
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(fp8.encode_fp8(x.numpy()), want)
    assert fp8.encode_fp8(np.array([np.nan], dtype=np.float32))[0] == 0x7F
    assert np.array_equal(np.nan_to_num(fp8.decode_fp8(codes.numpy()), nan=-1),
                          np.nan_to_num(codes.view(torch.float8_e4m3fn).float().numpy(), nan=-1))


@settings(max_examples=200, deadline=None)
@given(s=st.floats(2.0**-20, 8.0, width=32), big=st.floats(2.0**-20, 8.0, width=32))
def test_numpy_rescale_table_is_the_torch_formula_on_every_code(s, big):
    """SEMANTICS §6 rescale, all 256 codes at once, for any pair (not only s <= big): the numpy table
    against the formula run in torch; NaN codes stay NaN (0x7F)."""
    codes = torch.arange(256, dtype=torch.uint8)
    s32, b32 = torch.tensor(s, dtype=torch.float32), torch.tensor(big, dtype=torch.float32)
    want = (codes.view(torch.float8_e4m3fn).float() * s32 / b32).clamp(-448, 448).to(torch.float8_e4m3fn)
    want = want.view(torch.uint8).numpy().copy()
    want[[0x7F, 0xFF]] = 0x7F
    got = fp8.rescale_block_scales(codes.numpy(), s32.numpy(), b32.numpy())
    assert np.array_equal(got, want) or s32 == b32 and np.array_equal(got, codes.numpy())
    odd = fp8.rescale_block_scales(codes.numpy()[:5].reshape(5, 1), s32.numpy(), b32.numpy())  # the odd tail
    assert odd.shape == (5, 1) and np.array_equal(odd.reshape(-1), got[:5])


def test_rescale_codes_elementwise_is_the_torch_formula():
    """fp8.rescale_codes (planning's one call for every expert's top code, each with its own s2 and S2)
    against the formula run in torch per element: NaN codes stay NaN, s2 == S2 keeps the code."""
    g = torch.Generator().manual_seed(7)
    n = 4096
    codes = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    s2 = (torch.rand(n, generator=g) * 8 + 2.0**-12).float()
    big = torch.where(torch.rand(n, generator=g) < 0.2, s2, s2 * (1 + torch.rand(n, generator=g) * 30))
    want = (codes.view(torch.float8_e4m3fn).float() * s2 / big).clamp(-448, 448).to(torch.float8_e4m3fn)
    want = want.view(torch.uint8).numpy().copy()
    nan = ((codes & 0x7F) == 0x7F).numpy()
    want[nan] = 0x7F
    same = (s2 == big).numpy()
    want[same] = codes.numpy()[same]
    got = fp8.rescale_codes(codes.numpy(), s2.numpy(), big.numpy())
    assert got.dtype == np.uint8 and np.array_equal(got, want)
    assert int(fp8.rescale_codes(0x48, np.float32(1.0), np.float32(2.0))) == 0x40  # 4.0 -> 2.0, a 0-dim call


def test_numpy_nan_check():
    x = np.zeros(1000, dtype=np.uint8)
    assert not fp8.has_nan_fp8(x) and not fp8.has_nan_fp8(x[:0])
    for code in (0x7F, 0xFF):
        x[777] = code
        assert fp8.has_nan_fp8(x)
    x[777] = 0xFE
    assert not fp8.has_nan_fp8(x)


# --- requantization properties (SEMANTICS §3) ------------------------------------------------------

fp8_bytes = st.lists(st.integers(0, 255).filter(lambda b: b not in (0x7F, 0xFF)), min_size=1, max_size=64)


@settings(max_examples=100, deadline=None)
@given(raw=fp8_bytes, s=st.floats(1e-4, 1.0), ratio=st.floats(1.0, 64.0))
def test_requantized_values_within_half_an_fp8_step(raw, s, ratio):
    q = torch.tensor(raw, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale, big = torch.tensor(s, dtype=torch.float32), torch.tensor(s * ratio, dtype=torch.float32)
    q2 = requantize_fp8(q, scale, big)
    orig = q.float() * scale
    new = q2.float() * big
    # |error| <= half a step of the new grid (in units of the new scale), step at the requantized value
    target = orig / big
    assert torch.all((new - orig).abs() <= 0.5 * ref.fp8_step(target) * big * (1 + 1e-6))
    assert torch.equal(q2.view(torch.uint8), ref.fp8_requant(q, scale, big).view(torch.uint8))


@settings(max_examples=50, deadline=None)
@given(raw=fp8_bytes, s=st.floats(1e-4, 1.0))
def test_max_scale_shard_is_byte_identical(raw, s):
    q = torch.tensor(raw, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale = torch.tensor(s, dtype=torch.float32)
    assert torch.equal(requantize_fp8(q, scale, scale.clone()).view(torch.uint8), q.view(torch.uint8))


def test_rescale_block_scales_hand_value():
    bs = np.array([[0x40, 0x48]], dtype=np.uint8)  # 2.0, 4.0 in e4m3
    out = fp8.rescale_block_scales(bs, np.float32(1.0), np.float32(2.0))
    assert out.tolist() == [[0x38, 0x40]]  # 1.0, 2.0
    same = fp8.rescale_block_scales(bs, np.float32(2.0), np.float32(2.0))
    assert same is bs


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cols", [1, 3, 8, 24])
def test_row_decoders_keep_dtype_shape_and_bytes(dtype, cols):
    """The decoders move rows as wide words where the row's bytes allow: same result as moving the
    row's elements one by one (the loops in tests.reference), for every width."""
    raw = torch.randint(0, 256, (2, 64, cols * torch.tensor([], dtype=dtype).element_size()), dtype=torch.uint8)
    x = raw.view(dtype)
    idx = torch.from_numpy(gated_shuffled_row_indices(64).copy())
    got = decode.ungate_rows(decode.unshuffle_rows(x[:, idx]))
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got.view(torch.uint8), raw)


def test_as_words_is_the_same_memory_at_the_widest_width():
    t = torch.zeros(4, 16, dtype=torch.uint8)
    assert decode.as_words(t).dtype == torch.int64 and decode.as_words(t).data_ptr() == t.data_ptr()
    assert decode.as_words(torch.zeros(4, 6, dtype=torch.uint8)).dtype == torch.int16
    assert decode.as_words(torch.zeros(4, 5, dtype=torch.uint8)).dtype == torch.uint8
    assert decode.as_words(t[:, 1:9]).dtype == torch.uint8  # a row starting off a word boundary
    assert decode.as_words(torch.tensor(1.0)).shape == (1,)


def test_bit_equal_hand_cases():
    from mocli.verify.expect import bit_equal

    a = torch.arange(256, dtype=torch.uint8).reshape(8, 32)
    assert bit_equal(a, a.clone())
    b = a.clone()
    b[7, 31] ^= 0x80  # one bit, in the last word
    assert not bit_equal(a, b)
    # a transposed view against its copy, and against the copy with one bit flipped
    t = a.view(torch.int64).t()
    assert bit_equal(t, t.contiguous()) and not bit_equal(t, b.view(torch.int64).t().contiguous())
    assert not bit_equal(a, a.reshape(32, 8))  # same bytes, other shape
    assert not bit_equal(a.view(torch.int16), a.view(torch.int16).reshape(8, 16).to(torch.int32))
    # -0.0 and 0.0 are equal numbers and different bytes; NaN is not equal to itself and is the same bytes
    assert not bit_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    nan = torch.tensor([float("nan")])
    assert bit_equal(nan, nan.clone())
    # float8 with no wider view (odd width, odd offset): still bytes, never numbers
    fp8 = torch.float8_e4m3fn
    z = torch.tensor([[0x00, 1, 2]], dtype=torch.uint8)
    assert not bit_equal(z.view(fp8), torch.tensor([[0x80, 1, 2]], dtype=torch.uint8).view(fp8))
    n = torch.tensor([[0x7F, 1, 2]], dtype=torch.uint8).view(fp8)  # a NaN code
    assert bit_equal(n, n.clone())
    base = torch.zeros(2, 10, dtype=torch.uint8)
    other = base.clone()
    other[0, 3] = 0x80
    assert not bit_equal(base.view(fp8)[:, 1:9], other.view(fp8)[:, 1:9])
    assert bit_equal(torch.empty(0, 3), torch.empty(0, 3))


@pytest.mark.parametrize("target", ["flashinfer-cutlass", "flashinfer-trtllm"])
@pytest.mark.parametrize("gated", [True, False])
def test_row_halves_are_views_of_the_decoded_rows(target, gated):
    """What verify compares without copying: part k of ``moe_rows_halves``, its leading dims read in
    order, is the k-th half of the decoded rows (the whole of them ungated), and shares the stored memory."""
    from mocli.targets import layout_of

    layout = layout_of(target)
    x = torch.randint(0, 256, (128, 24), dtype=torch.uint8)
    stored = x
    if target == "flashinfer-trtllm":
        idx = torch.from_numpy(gated_shuffled_row_indices(128).copy()) if gated else shuffle_row_indices(128)
        stored = x[idx].contiguous()
    halves = layout.moe_rows_halves(stored, gated)
    assert halves.shape[0] == (2 if gated else 1) and halves.data_ptr() == stored.data_ptr()
    parts = x.chunk(halves.shape[0])
    for h, p in zip(halves, parts, strict=True):
        assert torch.equal(h.reshape(p.shape), p)
    assert layout.moe_rows_halves(stored[:127], gated) is None or not gated and target == "flashinfer-cutlass"


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_check_finite_judges_every_float_scale_piece_and_no_weight(dtype):
    """The engine's write-time check (issue 43.2): an Inf or NaN in a computed scale piece, a torch tensor or the
    numpy words a unit writes, is SCL006 naming tensor, rank and value; weights and copies are not judged."""
    from mocli.stream.units import BadData, OutTensor, Piece, SourceRange, check_finite

    td = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[dtype]
    key = ("rank-1", "m.alpha")
    tensors = {key: OutTensor("m.alpha", dtype, (3,), "alpha", [], ["input_scale * weight_scale_2"], "rank-1"),
               ("", "m.weight"): OutTensor("m.weight", dtype, (3,), "weight", [], [])}
    good = torch.tensor([1.0, 2.0, 65504.0], dtype=td)
    words = good.view(torch.int16).numpy() if dtype != "F32" else good.numpy()
    check_finite([Piece(key, 0, good), Piece(key, 0, words)], tensors)
    check_finite([Piece(("", "m.weight"), 0, torch.full((3,), float("inf"), dtype=td))], tensors)
    check_finite([Piece(key, 0, SourceRange(None, 0, 0))], tensors)  # verbatim bytes: validated as the source
    for bad in (float("inf"), -float("inf"), float("nan")):
        t = torch.tensor([1.0, 2.0, bad], dtype=td)
        for data in (t, t.view(torch.int16).numpy() if dtype != "F32" else t.numpy()):
            with pytest.raises(BadData) as e:
                check_finite([Piece(key, 0, data)], tensors)
            assert e.value.code == "SCL006" and e.value.tensor == "m.alpha on rank-1"
            assert f"is {bad}" in e.value.message and "element 2" in e.value.message


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from([(7,), (8,), (3, 5), (4, 6), (16, 33)]), st.booleans())
def test_byte_lookup_is_plain_indexing(seed, shape, strided):
    """``byte_lookup`` (two bytes per lookup where it can) gives ``table[codes]``, any shape, odd sizes and
    strided views included."""
    from mocli.numerics.lookup import byte_lookup

    g = np.random.default_rng(seed)
    table = g.integers(0, 256, 256, dtype=np.uint8)
    codes = g.integers(0, 256, (*shape[:-1], 2 * shape[-1]), dtype=np.uint8)
    codes = codes[..., ::2] if strided else codes[..., :shape[-1]]
    assert np.array_equal(byte_lookup(codes, table), table[codes])


@pytest.mark.parametrize("r,k,c", [(64, 3, 64), (128, 16, 64), (192, 5, 128)])
def test_gather_transposed_is_a_row_gather_then_a_transpose(r, k, c):
    """res[k, c] = src[rows[c], k], into a column slice of a wider array (the half of an MoE expert's
    scales): the words path against numpy's plain ``src[rows].T``; the rest of the array untouched."""
    from mocli.ops.marlin import gather_transposed

    g = np.random.default_rng(r + k)
    src, rows = g.integers(0, 256, (r, k), dtype=np.uint8), g.permutation(r)[:c]
    wide = np.full((k, 3 * c), 7, dtype=np.uint8)
    gather_transposed(src, rows, wide[:, c:2 * c])
    assert np.array_equal(wide[:, c:2 * c], src[rows].T)
    assert (wide[:, :c] == 7).all() and (wide[:, 2 * c:] == 7).all()


@pytest.mark.parametrize("r,c", [(256, 1536), (96, 200), (6, 10), (4, 1)])
def test_decode_transpose_on_words_is_a_transpose(r, c):
    """verify's transpose of Marlin scales (four rows to a word where the row count allows) against
    numpy's own ``.T``."""
    from mocli.targets.marlin_decode import transposed

    a = np.random.default_rng(r * c).integers(0, 256, (r, c), dtype=np.uint8)
    got = transposed(a)
    assert got.flags.c_contiguous and np.array_equal(got, a.T)
