"""Lossless MXFP4 -> 128x128 block-FP8 re-encoding (SEMANTICS §19.7): hand-computed blocks."""
import pytest
import torch

from mocli.plan.mxfp4_fp8block import SpreadError, dequant, reencode

# e2m1 codes: 1 -> 0.5, 3 -> 1.5, 2 -> 1.0, 7 -> 6.0, sign bit 8


def _block(rows, cols, code_fill, plants):
    """Nibbles all zero except plants {(r, k): (nibble, code)}; codes per 32-group."""
    nib = torch.zeros(rows, cols, dtype=torch.int32)
    codes = torch.full((rows, cols // 32), code_fill, dtype=torch.uint8)
    for (r, k), (n, c) in plants.items():
        nib[r, k] = n
        codes[r, k // 32] = c
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).to(torch.uint8)
    return packed, codes


def test_spread_14_fits_with_hand_values():
    # 6 * 2^(140-127) and 0.5 * 2^(126-127): s = max e - 8 = (2 + 13) - 8 = 7
    packed, codes = _block(128, 128, 130, {(0, 0): (7, 140), (5, 64): (1, 126), (9, 33): (8 | 3, 130)})
    q, s = reencode(packed, codes)
    assert s.tolist() == [[128.0]]
    assert q[0, 0].float().item() == 384.0          # 6 * 2^13 / 2^7
    assert q[5, 64].float().item() == 2.0 ** -9      # smallest e4m3 subnormal
    d = dequant(q, s)
    assert d[0, 0].item() == 6 * 2.0 ** 13
    assert d[5, 64].item() == 0.5 * 2.0 ** -1
    assert d[9, 33].item() == -1.5 * 2.0 ** 3
    assert int((d != 0).sum()) == 3


def test_spread_15_adversarial_refused_naming_block():
    # 6 * 2^14 needs s >= 8; 0.5 * 2^-1 needs s <= 7: spread (2+14) - (-1-1) = 18
    packed, codes = _block(256, 256, 130, {(130, 200): (7, 141), (131, 130): (1, 126)})
    with pytest.raises(SpreadError) as err:
        reencode(packed, codes)
    assert (err.value.row, err.value.col, err.value.spread) == (1, 1, 18)
    assert "block (row 1, col 1)" in str(err.value)


def test_spread_15_benign_fits_under_value_rule():
    # codes 141 and 126 (scale-only rule refuses), but the values are 1.0 * 2^14 and 0.5 * 2^-1:
    # spread 14 - (-2) = 16 <= 17, s = 6
    packed, codes = _block(128, 128, 130, {(1, 1): (2, 141), (2, 100): (1, 126)})
    q, s = reencode(packed, codes)
    assert s.tolist() == [[64.0]]
    assert q[1, 1].float().item() == 256.0
    assert q[2, 100].float().item() == 2.0 ** -8
    assert dequant(q, s)[1, 1].item() == 2.0 ** 14


def test_all_zero_block_scale_one_and_planted_fault_visible():
    packed, codes = _block(128, 256, 127, {(3, 3): (5, 128)})   # 3.0 * 2^1 = 6
    q, s = reencode(packed, codes)
    assert s[0, 1].item() == 1.0
    d = dequant(q, s)
    assert d[3, 3].item() == 6.0
    bad = q.view(torch.uint8).clone()
    bad[3, 3] ^= 1
    assert not torch.equal(dequant(bad.view(torch.float8_e4m3fn), s), d)


def _decode_by_hand(packed, codes):
    """Second decode: per-element Python floats (no shared code with the module)."""
    lut = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    p, c = packed.tolist(), codes.tolist()
    out = []
    for r, row in enumerate(p):
        vals = []
        for j, byte in enumerate(row):
            for n, k in ((byte & 0xF, 2 * j), (byte >> 4, 2 * j + 1)):
                v = lut[n & 7] * 2.0 ** (c[r][k // 32] - 127)
                vals.append(-v if n & 8 else v)
        out.append(vals)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("fixture,packed_key", [("qwen3_moe-ct-mxfp4", "weight_packed"),
                                                 ("qwen3_moe-quark-mxfp4", "weight")])
def test_real_qwen3_moe_mxfp4_experts_bit_exact(fixture, packed_key):
    from pathlib import Path

    from safetensors import safe_open
    path = Path(__file__).resolve().parents[1] / f"fixtures/real/{fixture}/model.safetensors"
    if not path.exists():
        path = Path(f"/work/main/fixtures/real/{fixture}/model.safetensors")
    with safe_open(str(path), "pt") as f:
        names = [k[:-len(packed_key)] for k in f.keys()
                 if ".experts.0." in k and k.endswith("." + packed_key)]
        assert names
        for n in names:
            packed, codes = f.get_tensor(n + packed_key), f.get_tensor(n + "weight_scale")
            q, s = reencode(packed, codes)
            got = dequant(q, s).to(torch.float64)
            assert torch.equal(got, _decode_by_hand(packed, codes)), n


def test_rule_matches_brute_force_over_scales():
    """Random blocks with wide code spreads: reencode succeeds iff some power of two makes the cast exact."""
    g = torch.Generator().manual_seed(7)
    seen = set()
    for _ in range(40):
        packed = torch.randint(0, 256, (128, 64), generator=g, dtype=torch.uint8)
        lo = int(torch.randint(110, 130, (1,), generator=g))
        width = int(torch.randint(11, 18, (1,), generator=g))
        codes = torch.randint(lo, lo + width, (128, 4), generator=g, dtype=torch.uint8)
        if width == 17:  # only +-1.0: code spread 16 > 14, yet the values fit (value rule)
            packed = packed & 0xAA
        ref = _decode_by_hand(packed, codes).to(torch.float32)
        exact = [s for s in range(-40, 40)
                 if torch.equal((ref / 2.0 ** s).to(torch.float8_e4m3fn).float() * 2.0 ** s, ref)]
        try:
            reencode(packed, codes)
            ok = True
        except SpreadError:
            ok = False
        assert ok == bool(exact)
        seen.add(ok)
    assert seen == {True, False}


def test_tiny_blocks_keep_above_the_engine_clamp_or_are_refused():
    # 6 * 2^(90-127) = 1.5 * 2^-35: max e - 8 = -43, below 2^-33 (the smallest power of two >= 1e-10, which
    # vLLM's clamp_(min=1e-10) keeps), yet s = -33 still holds it: 6 * 2^-37 / 2^-33 = 0.375
    packed, codes = _block(128, 128, 127, {(0, 0): (7, 90)})
    q, s = reencode(packed, codes)
    assert s.tolist() == [[2.0 ** -33]] and 2.0 ** -33 > 1e-10 > 2.0 ** -34
    assert q[0, 0].float().item() == 0.375
    assert dequant(q, s)[0, 0].item() == 6 * 2.0 ** -37
    # 0.5 * 2^(85-127) = 2^-43 needs s <= -34: only a scale the engine would clamp
    packed, codes = _block(128, 256, 127, {(0, 200): (1, 85)})
    with pytest.raises(SpreadError) as err:
        reencode(packed, codes)
    assert (err.value.row, err.value.col, err.value.floor) == (0, 1, True)
    assert "below 1e-10" in str(err.value)
