"""mocli.ops.marlin's byte moves against vLLM's python reference restated in tests/reference.py (the
unpacked codes, 16x16 tiles and the 1024-entry permutation; the scales through torch's half), on every
shape family: unpadded, padded N, padded K, both tile families."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mocli.ops import marlin
from tests import reference as ref


@pytest.mark.parametrize("n,k", [(128, 256), (192, 192), (256, 64 * 3), (64, 128), (100, 48), (512, 1024), (320, 96)])
def test_repack_is_vllms_reference(n, k, byte_moves):
    g = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    np_, kp = marlin.padded_nk(n, k)
    got = marlin.repack(w.numpy(), np_, kp)
    assert got.shape == (kp // 16, 8 * np_)
    assert np.array_equal(got.view(np.int32), ref.marlin_repack(w, np_, kp).numpy())


@pytest.mark.parametrize("n,k", [(128, 256), (192, 192), (100, 48), (320, 96), (1024, 4096)])
def test_decode_undoes_vllms_reference(n, k, byte_moves):
    """verify's and serving's inverse (targets.marlin_decode) against vLLM's python repack restated, not
    against mocli's forward: a decode that shared the forward's mistake could not pass here."""
    from mocli.targets import marlin_decode

    g = torch.Generator().manual_seed(n + 3 * k)
    w = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    np_, kp = marlin.padded_nk(n, k)
    stored = ref.marlin_repack(w, np_, kp).numpy()
    assert np.array_equal(marlin_decode.decode_weight(stored, n, k, "w"), w.numpy())
    for sf, top in ((1.0, 0x7F), (8.0, 0x67)):  # sf 8 only where no scale is over 56 (scale_factor)
        codes = torch.randint(0, top, (n, k // 16), generator=g, dtype=torch.uint8)
        got = marlin_decode.decode_scales(ref.marlin_scales(codes, np_, kp, sf).numpy(), n, k // 16, sf, "s")
        assert np.array_equal(got, marlin_decode.flushed(codes.numpy(), sf))


def test_padding_picks_the_cheaper_family_and_the_first_on_a_tie():
    assert marlin.padded_nk(192, 192) == (192, 256)  # both cost 192*256 + ... : the first family
    assert marlin.padded_nk(128, 64) == (128, 64)
    assert marlin.padded_nk(100, 40) == (128, 64)  # (128, 128) costs more
    assert marlin.padded_nk(64, 200) == (64, 256)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([(128, 256), (192, 192), (100, 48), (64, 128)]), st.integers(0, 2**31),
       st.sampled_from([1.0, 2.0, 16.0]))
def test_scales_are_vllms_reference(shape, seed, sf):
    n, k = shape
    g = np.random.default_rng(seed)
    codes = g.integers(0, 0x7F, (n, k // 16), dtype=np.uint8)  # nonnegative, no NaN: what a checked export holds
    codes[g.random(codes.shape) < 0.1] = g.integers(0, 9, 1)[0]  # subnormals and zeros: the flush
    np_, kp = marlin.padded_nk(n, k)
    got = marlin.permute_scales(codes, np_, kp, marlin.scale_table(sf))
    assert np.array_equal(got, ref.marlin_scales(torch.from_numpy(codes), np_, kp, sf).numpy())


def test_scale_factor_and_global_scale():
    """sf lifts the largest block scale towards 448 by a power of two (1 where it is 448); the global
    scale is S2 * 2^119 / sf for BF16 activations, 2^7 for FP16, in float32, exactly."""
    as_codes = lambda *v: torch.tensor(v).to(torch.float8_e4m3fn).view(torch.uint8).numpy()  # noqa: E731
    assert marlin.scale_factor(as_codes(448.0, 1.0)) == 1.0
    assert marlin.scale_factor(as_codes(100.0, 0.0)) == 4.0  # 448 / 100 = 4.48
    assert marlin.scale_factor(as_codes(0.0)) == 1.0
    assert marlin.scale_factor(as_codes(1.0), "float16") == 1.0
    s2 = np.float32(0.00123)
    assert marlin.global_scale(s2, 4.0) == np.float32(s2 * np.float32(2.0**119) / np.float32(4.0))
    assert marlin.global_scale(s2, 1.0, "float16") == s2 * np.float32(128)


def test_bias_permutation():
    b = np.arange(64, dtype=np.uint16).view(np.uint8).reshape(64, 2)
    got = marlin.permute_bias(b, 96).view(np.uint16).reshape(-1)
    perm = [2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)]
    want = np.concatenate([np.arange(64), np.zeros(32, dtype=np.int64)]).reshape(-1, 32)[:, perm].reshape(-1)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("n,k", [(128, 256), (192, 192), (100, 48), (512, 1024), (320, 96)])
def test_the_independent_inverses_undo_the_forward(n, k, byte_moves):
    """targets.marlin_decode (written from the perm list, not from ops.marlin's factoring) give back the
    source bytes; a nonzero padding code and a swapped pair of words are caught or change the result."""
    from mocli.targets import marlin_decode as target
    from mocli.targets.decode import LayoutError

    g = np.random.default_rng(n + k)
    w = g.integers(0, 256, (n, k // 2), dtype=np.uint8)
    np_, kp = marlin.padded_nk(n, k)
    stored = marlin.repack(w, np_, kp)
    assert np.array_equal(target.decode_weight(stored, n, k, "w"), w)
    assert np.array_equal(target.decode_weight(stored.view(np.int32), n, k, "w"), w)
    words = stored.view(np.int32).copy()
    words[0, [0, 1]] = words[0, [1, 0]]
    assert not np.array_equal(target.decode_weight(words, n, k, "w"), w) or not words[0, 0] != words[0, 1]
    if (np_, kp) != (n, k):
        bad = marlin.repack(np.pad(w, ((0, np_ - n), (0, (kp - k) // 2)), constant_values=0x11), np_, kp)
        with pytest.raises(LayoutError):
            target.decode_weight(bad, n, k, "w")
    # sf makes the largest scale at most 448 (scale_factor): codes up to 448 at sf 1, up to 56 (0x66) at sf 8
    for sf, top in ((1.0, 0x7F), (8.0, 0x67)):
        codes = g.integers(0, top, (n, k // 16), dtype=np.uint8)
        got = target.decode_scales(marlin.permute_scales(codes, np_, kp, marlin.scale_table(sf)), n, k // 16, sf, "s")
        assert np.array_equal(got, target.flushed(codes, sf)) and (got == 0).any()


@pytest.mark.parametrize("n,k", [(128, 256), (192, 192), (100, 48), (320, 96), (1536, 512)])
def test_torch_repack_is_the_numpy_one_on_the_cpu(n, k):
    """convert --device cuda repacks in torch (mocli.ops.marlin_torch, from the layout's index formula)
    and the CPU in numpy byte moves: the same bytes, here on CPU tensors (test_gpu runs it on CUDA),
    and vLLM's python reference's, written into a half of a wider output as an MoE w13 is."""
    from mocli.ops import marlin_torch

    g = torch.Generator().manual_seed(5 * n + k)
    w = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    np_, kp = marlin.padded_nk(n, k)
    got = marlin_torch.repack(w, np_, kp)
    assert got.dtype == torch.uint8 and got.shape == (kp // 16, 8 * np_)
    assert np.array_equal(got.numpy(), marlin.repack(w.numpy(), np_, kp))
    assert np.array_equal(got.numpy().view(np.int32), ref.marlin_repack(w, np_, kp).numpy())
    wide = torch.zeros((kp // 16, 16 * np_), dtype=torch.uint8)
    marlin_torch.repack(w, np_, kp, out=wide[:, 8 * np_:])
    assert torch.equal(wide[:, 8 * np_:], got) and not wide[:, :8 * np_].any()
    strided = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)[:, k // 4:k // 4 + k // 2]
    assert np.array_equal(marlin_torch.repack(strided, np_, kp).numpy(), marlin.repack(strided.numpy(), np_, kp))
    for sf in (1.0, 4.0):
        codes = torch.randint(0, 0x7F, (n, k // 16), generator=g, dtype=torch.uint8)
        table = marlin.scale_table(sf)
        assert np.array_equal(marlin_torch.permute_scales(codes, np_, kp, table).numpy(),
                              marlin.permute_scales(codes.numpy(), np_, kp, table))


@pytest.mark.parametrize("threads", [2, 3])
def test_repack_shared_out_to_threads_gives_the_same_bytes(monkeypatch, threads, byte_moves):
    """A many-core CPU run repacks one weight's blocks in several threads (REPACK_THREADS): the bytes of
    vLLM's python reference, padding included, as with one."""
    monkeypatch.setattr(marlin, "REPACK_THREADS", threads)
    monkeypatch.setattr(marlin, "BLOCK_BYTES", 1 << 14)  # many blocks even for a small weight
    g = torch.Generator().manual_seed(threads)
    for n, k in ((1024, 512), (1000, 400)):
        w = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
        np_, kp = marlin.padded_nk(n, k)
        assert np.array_equal(marlin.repack(w.numpy(), np_, kp).view(np.int32), ref.marlin_repack(w, np_, kp).numpy())


def test_decode_shared_out_to_threads_undoes_vllms_reference(monkeypatch, byte_moves):
    """verify's inverse in several threads (DECODE_THREADS on a many-core machine): vLLM's python repack
    restated, undone byte for byte, padding included."""
    from mocli.targets import marlin_decode

    monkeypatch.setattr(marlin_decode, "DECODE_THREADS", 3)
    monkeypatch.setattr(marlin_decode, "BLOCK_BYTES", 1 << 14)
    g = torch.Generator().manual_seed(11)
    for n, k in ((1024, 512), (1000, 400)):
        w = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
        np_, kp = marlin.padded_nk(n, k)
        assert np.array_equal(marlin_decode.decode_weight(ref.marlin_repack(w, np_, kp).numpy(), n, k, "w"), w.numpy())


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([(128, 256), (192, 192), (100, 48)]), st.integers(0, 2**31),
       st.sampled_from([(0.25, 1.0), (0.75, 1.5), (1.0, 1.0)]), st.sampled_from([1.0, 4.0]))
def test_scales_rescaled_in_the_same_lookup(shape, seed, s2_big, sf):
    """An MoE half whose global scale is under the expert's max: its codes rescaled and rewritten in one
    lookup (``rescale=``), the bytes of rescaling first with the element-wise formula
    (``fp8.rescale_codes``, no table) and then vLLM's scale processing restated."""
    from mocli.ops import fp8

    n, k = shape
    g = np.random.default_rng(seed)
    codes = g.integers(0, 0x7F, (n, k // 16), dtype=np.uint8)
    s2, big = (np.float32(x) for x in s2_big)
    np_, kp = marlin.padded_nk(n, k)
    got = marlin.permute_scales(codes, np_, kp, marlin.scale_table(sf), rescale=fp8.rescale_table(s2, big))
    rescaled = fp8.rescale_codes(codes, np.full(codes.shape, s2), np.full(codes.shape, big))
    assert np.array_equal(got, ref.marlin_scales(torch.from_numpy(rescaled), np_, kp, sf).numpy())


@given(st.integers(1, 300), st.integers(1, 16), st.integers(1, 4))
def test_guided_blocks_cover_every_group_once(groups, per, threads):
    """The blocks a threaded repack hands out: in order, none empty or over ``per``, every group once,
    and the last one a single group wherever a block of ``per`` would not be the whole weight."""
    blocks = marlin._guided(groups, per, threads)
    assert [b for a, b in blocks][:-1] == [a for a, b in blocks][1:] and blocks[0][0] == 0 and blocks[-1][1] == groups
    assert all(1 <= b - a <= per for a, b in blocks)
    assert blocks[-1][1] - blocks[-1][0] == 1 or groups <= per


@pytest.mark.parametrize("where", ["caller", "helper"])
def test_a_failing_block_stops_the_other_threads(monkeypatch, where, byte_moves):
    """An error in a block, on the calling thread or on a helper, is raised to the caller, and no thread
    takes a block after it."""
    import threading
    import time

    from mocli.ops import marlin_native

    monkeypatch.setattr(marlin, "REPACK_THREADS", 2)
    monkeypatch.setattr(marlin, "BLOCK_BYTES", 1 << 14)
    owner, name = (marlin_native, "repack") if byte_moves == "c" else (marlin, "_repack_rows")
    taken, real = [], getattr(owner, name)

    def flaky(*args):
        caller = threading.current_thread() is threading.main_thread()
        failing = (where == "caller") == caller
        if not failing:
            time.sleep(0.002)  # the failing thread surely takes a block while most are left
        if failing and "failed" not in taken:
            taken.append("failed")
            raise MemoryError("planted")
        taken.append(caller)
        real(*args)

    monkeypatch.setattr(owner, name, flaky)
    w = np.zeros((4096, 256), dtype=np.uint8)  # 64 groups, a block of one each
    with pytest.raises(MemoryError, match="planted"):
        marlin.repack(w, *marlin.padded_nk(4096, 512))
    after = taken[taken.index("failed") + 1:]
    assert len(after) <= 1  # at most the block the other thread had in hand
