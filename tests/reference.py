"""Straightforward second implementations used as test oracles (no mocli.ops imports).

Written from SEMANTICS directly, element by element where that is the clearest statement.
"""

from __future__ import annotations

import torch

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def swizzle_by_offsets(s: torch.Tensor) -> torch.Tensor:
    """SEMANTICS §5 explicit formula: (m, k) -> (m//128)*(Kp/4)*512 + (k//4)*512 + (m%32)*16 + ((m%128)//32)*4 + k%4."""
    m_, kb = s.shape
    mp, kp = -(-m_ // 128) * 128, -(-kb // 4) * 4
    out = torch.zeros(mp * kp, dtype=torch.uint8)
    m = torch.arange(m_).repeat_interleave(kb)
    k = torch.arange(kb).repeat(m_)
    off = (m // 128) * (kp // 4) * 512 + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4
    out[off] = s.contiguous().view(torch.uint8).reshape(-1)
    return out.reshape(mp, kp)


def unswizzle_by_offsets(flat: torch.Tensor, m_: int, kb: int) -> torch.Tensor:
    kp = flat.shape[-1]
    m = torch.arange(m_).repeat_interleave(kb)
    k = torch.arange(kb).repeat(m_)
    off = (m // 128) * (kp // 4) * 512 + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4
    return flat.contiguous().view(torch.uint8).reshape(-1)[off].reshape(m_, kb)


def shuffle_rows(x: torch.Tensor) -> torch.Tensor:
    """SEMANTICS §4: out[b + r] = in[b + 4*(r%8) + r//8] in blocks of 32 rows (a Python loop)."""
    out = torch.empty_like(x)
    for b in range(0, x.shape[0], 32):
        for r in range(32):
            out[b + r] = x[b + 4 * (r % 8) + r // 8]
    return out


def gated_reorder(x: torch.Tensor) -> torch.Tensor:
    """out[2i] = in[i], out[2i+1] = in[M/2 + i]."""
    half = x.shape[0] // 2
    out = torch.empty_like(x)
    for i in range(half):
        out[2 * i] = x[i]
        out[2 * i + 1] = x[half + i]
    return out


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """U8 [.., K/2] -> float32 [.., K], low nibble first; bit 3 sign."""
    table = torch.tensor(E2M1 + [-v for v in E2M1], device=packed.device)
    lo, hi = (packed & 15).long(), (packed >> 4).long()
    return torch.stack([table[lo], table[hi]], -1).flatten(-2)


def dequant_nvfp4(packed: torch.Tensor, bs: torch.Tensor, s2: float) -> torch.Tensor:
    v = unpack_fp4(packed)
    eff = bs.float().repeat_interleave(16, dim=-1) * s2
    return v * eff


def fp8_requant(q: torch.Tensor, s: torch.Tensor, big: torch.Tensor) -> torch.Tensor:
    """SEMANTICS §3 as written: fp8(clamp(float(q) * s * (1/S), ±448))."""
    x = q.float() * s.float()
    x = x * (1.0 / big.float())
    return x.clamp(-448, 448).to(torch.float8_e4m3fn)


def fp8_step(x: torch.Tensor) -> torch.Tensor:
    """Distance between adjacent e4m3 values around |x| (subnormal step 2^-9)."""
    ax = x.abs().clamp(min=2.0**-6)
    return torch.exp2(torch.floor(torch.log2(ax)) - 3)


# --- SEMANTICS §10, written from the text (not from mocli.parallel) -----------------------------------

def head_rows(role: str, n: int, tp: int, r: int, kv_heads: int, head_dim: int) -> slice:
    """Rows of q ("q") or k/v ("kv") on tp rank r; kv heads replicated when there are fewer than tp."""
    if role == "kv" and kv_heads < tp:
        head = r * kv_heads // tp
        return slice(head * head_dim, (head + 1) * head_dim)
    per = n // tp
    return slice(r * per, (r + 1) * per)


def part(n: int, parts: int, r: int) -> slice:
    per = n // parts
    return slice(r * per, (r + 1) * per)


def swizzle_experts(s: torch.Tensor) -> torch.Tensor:
    return torch.stack([swizzle_by_offsets(x) for x in s])


def pad_bytes(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out = torch.zeros(rows, cols, dtype=torch.uint8)
    out[: t.shape[0], : t.shape[1]] = t.view(torch.uint8)
    return out


# --- Marlin (SEMANTICS §13.5): vLLM's python reference restated step by step -------------------------

def marlin_weight_perm() -> torch.Tensor:
    """SEMANTICS §13.5 / vLLM marlin_utils_test.get_weight_perm(4): per run of 1024 codes."""
    perm = []
    for i in range(32):
        col, perm1 = i // 4, []
        for block in (0, 1):
            for row in (2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1):
                perm1.append(16 * row + col + 8 * block)
        for j in range(4):
            perm += [p + 256 * j for p in perm1]
    perm = torch.tensor(perm).reshape(-1, 8)[:, [0, 2, 4, 6, 1, 3, 5, 7]]
    return perm.reshape(-1)


def marlin_repack(packed: torch.Tensor, n_pad: int, k_pad: int) -> torch.Tensor:
    """uint8 [N, K/2] NVFP4 -> int32 [Kp/16, 2 Np]: unpack the codes (low nibble first), pad, transpose to
    [K, N], 16x16 tiles laid row after row, each run of 1024 permuted, 8 codes per int32 (code t at 4t)."""
    n, half = packed.shape
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(n, 2 * half).int()
    c = torch.zeros(n_pad, k_pad, dtype=torch.int32)
    c[:n, :2 * half] = codes
    c = c.T.reshape(k_pad // 16, 16, n_pad // 16, 16).permute(0, 2, 1, 3).reshape(k_pad // 16, 16 * n_pad)
    c = c.reshape(-1, 1024)[:, marlin_weight_perm()].reshape(k_pad // 16, 16 * n_pad)
    out = torch.zeros(k_pad // 16, 2 * n_pad, dtype=torch.int64)
    for t in range(8):
        out |= c[:, t::8].long() << (4 * t)
    return out.to(torch.int32) if out.max() < 2**31 else (out - (out >= 2**31).long() * 2**32).to(torch.int32)


def marlin_scales(codes: torch.Tensor, n_pad: int, k_pad: int, sf: float) -> torch.Tensor:
    """uint8 e4m3 codes [N, K/16] -> Marlin's uint8 [Kp/16, Np], as vLLM computes it in torch: transpose,
    pad, marlin_permute_scales (an 8x8 transpose per 64), to half, [0, 2, 1, 3], * sf, * 2^7, < 2 -> 0,
    int16 << 1, high byte."""
    s = codes.view(torch.float8_e4m3fn).T.to(torch.bfloat16)
    padded = torch.zeros(k_pad // 16, n_pad, dtype=torch.bfloat16)
    padded[:s.shape[0], :s.shape[1]] = s
    perm = [i + 8 * j for i in range(8) for j in range(8)]
    s = padded.reshape(-1, 64)[:, perm].reshape(k_pad // 16, n_pad).to(torch.half)
    s = s.view(-1, 4)[:, [0, 2, 1, 3]].reshape(k_pad // 16, n_pad)
    if sf > 1:
        s = (s.float() * sf).half()
    s = s * 128
    s[s < 2] = 0
    return (s.view(torch.int16) << 1).view(torch.uint8).reshape(k_pad // 16, n_pad, 2)[..., 1].contiguous()


def marlin_mxfp4_scales(codes: torch.Tensor, n_pad: int, k_pad: int) -> torch.Tensor:
    """uint8 E8M0 codes [N, K/32] -> Marlin's uint8 [Kp/32, Np], step by step as vLLM 0.32/0.33's
    ``prepare_fp4_layer_for_marlin`` (MXFP4 branch, params_dtype bf16, input_dtype None) writes it:
    ``.T``, ``view(float8_e8m0fnu)``, ``.to(bfloat16)``, ``marlin_pad_scales`` (F.pad with zeros),
    ``marlin_permute_scales`` (group 32 < Kp: ``reshape(-1, 64)[:, scale_perm]``, scale_perm from
    ``get_scale_perms``), ``mxfp4_marlin_process_scales`` (``view(-1, 4)[:, [0, 2, 1, 3]]``, then
    ``.to(float8_e8m0fnu)``)."""
    s = codes.T.contiguous().view(torch.float8_e8m0fnu).to(torch.bfloat16)
    s = torch.nn.functional.pad(s, (0, n_pad - s.shape[1], 0, k_pad // 32 - s.shape[0]))
    scale_perm = [i + 8 * j for i in range(8) for j in range(8)]
    s = s.reshape(-1, 64)[:, scale_perm].reshape(-1, n_pad)
    s = s.view(-1, 4)[:, [0, 2, 1, 3]].view(s.size(0), -1)
    return s.to(torch.float8_e8m0fnu).view(torch.uint8)


def marlin_bias(b: torch.Tensor, n_pad: int) -> torch.Tensor:
    """``marlin_permute_bias(marlin_pad_dim(b, n, Np))``: zero-padded, each run of 32 read at scale_perm_single."""
    single = [2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)]
    b = torch.nn.functional.pad(b, (0, n_pad - b.shape[0]))
    return b.reshape(-1, 32)[:, single].reshape(-1)


def shuffle16_row_indices(m: int) -> torch.Tensor:
    """FlashInfer ``get_shuffle_matrix_a_row_indices(w, epilogue_tile_m=64)``: 16-row blocks, srcToDstBlk16RowMap
    [0, 8, 1, 9, ..., 7, 15]; ``row_indices[new_row] = old_row`` (a loop, as FlashInfer writes it)."""
    row_map = [0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15]
    idx = torch.empty(m, dtype=torch.long)
    for old in range(m):
        idx[(old // 16) * 16 + row_map[old % 16]] = old
    return idx


def deepseek_block_major(w: torch.Tensor) -> torch.Tensor:
    """vLLM 0.33 ``flashinfer_utils._shuffle_deepseek_fp8_moe_weights`` on stacked [E, M, K] uint8 weights, as it
    is written there: rows from the shuffle indices, then [E, K/128, M, 128] (BlockMajorK)."""
    num_experts, m, k = w.shape
    rows = shuffle16_row_indices(m)
    blocked = w.view(num_experts, m, k // 128, 128)
    return blocked.permute(0, 2, 1, 3)[:, :, rows, :].contiguous()


# --- flashinfer-trtllm MXFP4 experts (SEMANTICS §19.6), restated from FlashInfer 0.7's Python source ---------

# flashinfer/utils.py :: srcToDstBlk32RowMap; get_shuffle_matrix_a_row_indices sets row_indices[new_row] = old_row
# with new_row = block * 32 + srcToDstBlk32RowMap[old_row % 32] (epilogue_tile_m = 128 -> blocks of 32)
SRC_TO_DST_BLK32 = [0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27,
                    4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31]


def shuffle_matrix_a_128(x: torch.Tensor) -> torch.Tensor:
    """``x[row_indices]`` with FlashInfer's row_indices (a loop over old rows)."""
    idx = torch.empty(x.shape[0], dtype=torch.long)
    for old in range(x.shape[0]):
        idx[old // 32 * 32 + SRC_TO_DST_BLK32[old % 32]] = old
    return x[idx]


def swap_every_two_rows(x: torch.Tensor) -> torch.Tensor:
    """vLLM ``swap_every_two_rows``: rows 2i <-> 2i+1 (gpt-oss (gate, up) -> (up, gate))."""
    return x.reshape(x.shape[0] // 2, 2, *x.shape[1:]).flip(1).reshape(x.shape)


def trtllm_mxfp4_rank(w13: torch.Tensor, s13: torch.Tensor, b13, w2: torch.Tensor, s2: torch.Tensor, b2,
                      interleaved: bool, i0: int, i1: int, ip: int, hp: int, pad: int, rank0: bool) -> dict:
    """One expert, one rank, as vLLM 0.33 loads and prepares it for trtllm_fp4_block_scale_moe (SEMANTICS §19.3,
    §19.6), step by step. Inputs as stored: ``w13``/``s13``/``b13`` the expert's gate_up rows interleaved
    (gate_i, up_i) when ``interleaved``, else ``[w1 (gate); w3 (up)]`` of the full I; ``w2``/``s2``/``b2`` down.
    1. parameters at their initial values (weights 0, scales ``pad``, biases 0), the rank's slice copied into
       their start (gpt-oss loaders) or w1 at [0, I_r) and w3 at [Ip, Ip + I_r) (generic ``_load_w13``);
    2. biases float32; gate/up -> (up, gate) pairs (``swap_every_two_rows`` / ``torch.stack([w3, w1], dim=1)``);
    3. rows shuffled (shuffle_matrix_a, 128) for weights, scales and biases; scales then 128x4 interleaved."""
    i, h, n = w13.shape[0] // 2, w2.shape[0], i1 - i0
    p13w, p13s = torch.zeros(2 * ip, hp // 2, dtype=torch.uint8), torch.full((2 * ip, hp // 32), pad, dtype=torch.uint8)
    p13b = torch.zeros(2 * ip, dtype=torch.float32)
    if interleaved:
        p13w[:2 * n, :w13.shape[1]] = w13[2 * i0:2 * i1]
        p13s[:2 * n, :s13.shape[1]] = s13[2 * i0:2 * i1]
        if b13 is not None:
            p13b[:2 * n] = b13[2 * i0:2 * i1].float()
        p13w, p13s, p13b = swap_every_two_rows(p13w), swap_every_two_rows(p13s), swap_every_two_rows(p13b)
    else:
        for t, src in ((p13w, w13), (p13s, s13)):
            t[:n, :src.shape[1]] = src[i0:i1]
            t[ip:ip + n, :src.shape[1]] = src[i + i0:i + i1]
        if b13 is not None:
            p13b[:n], p13b[ip:ip + n] = b13[i0:i1].float(), b13[i + i0:i + i1].float()
        p13w, p13s, p13b = (torch.stack([t[ip:], t[:ip]], dim=1).reshape(t.shape) for t in (p13w, p13s, p13b))
    p2w, p2s = torch.zeros(hp, ip // 2, dtype=torch.uint8), torch.full((hp, ip // 32), pad, dtype=torch.uint8)
    p2w[:h, :n // 2], p2s[:h, :n // 32] = w2[:, i0 // 2:i1 // 2], s2[:, i0 // 32:i1 // 32]
    p2b = torch.zeros(hp, dtype=torch.float32)
    if b2 is not None and rank0:
        p2b[:h] = b2.float()
    out = {"w13_weight": shuffle_matrix_a_128(p13w), "w13_weight_scale": swizzle_by_offsets(shuffle_matrix_a_128(p13s)),
           "w2_weight": shuffle_matrix_a_128(p2w), "w2_weight_scale": swizzle_by_offsets(shuffle_matrix_a_128(p2s))}
    if b13 is not None:
        out["w13_bias"] = shuffle_matrix_a_128(p13b)
    if b2 is not None:
        out["w2_bias"] = shuffle_matrix_a_128(p2b)
    return out


def dequant_mxfp4(packed: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """U8 [N, K/2] e2m1 (low nibble first) times E8M0 [N, K/32] (2^(c - 127)) -> float32 [N, K]."""
    return unpack_fp4(packed) * torch.exp2(codes.float() - 127.0).repeat_interleave(32, dim=-1)
