"""What a converted module must hold, derived from the source by verify's own code.

Independent of ``mocli.plan`` and ``mocli.ops``: the requantization and rescaling tables are built
here from the SEMANTICS §3/§6 formulas, the §10 slice rule is restated here, and the consistency
rules for every derived scale are written out per role. Verify compares the converted bytes (after
the target's inverse transforms) and scales with these exactly.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from mocli.numerics import FP8_MAX
from mocli.numerics.in_numpy import E4M3, e4m3_encode
from mocli.targets.decode import as_words

# Arrays here are numpy arrays (NVFP4, verified without torch) or torch tensors (FP8) alike.


def to_numpy(t: Any) -> np.ndarray:
    """A numpy array of ``t`` (a torch tensor is copied to the CPU; a float8 one as its bytes)."""
    if isinstance(t, np.ndarray):
        return t
    if not hasattr(t, "detach"):
        return np.asarray(t)
    torch = _torch()
    t = t.detach().cpu()
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.float().numpy()
    return t.view(torch.uint8).numpy() if t.element_size() == 1 and t.is_floating_point() else t.numpy()


def _torch():
    import torch

    return torch


# --- byte tables (SEMANTICS §3, §6), evaluated on all 256 codes --------------------------------------

@lru_cache(maxsize=4096)
def _byte_table(kind: str, a: float, b: float) -> np.ndarray:
    """The output byte for each of the 256 input codes, uint8 [256], in float32 arithmetic."""
    sa, sb = np.float32(a), np.float32(b)
    if kind == "requant":  # fp8(clamp(float(q) * s * (1/S), ±448)), 1/S rounded once
        vals = E4M3 * sa * (np.float32(1) / sb)
    elif kind == "requant_f16":  # vLLM's per_tensor_dequantize: a float16 weight times a 0-dim float32 scale,
        torch = _torch()          # which torch rounds to float16 too where both are on a GPU (SEMANTICS §17.2)
        dq = torch.from_numpy(np.nan_to_num(E4M3)).to(torch.float16) * torch.tensor(sa).half()
        vals = np.where(np.isnan(E4M3), np.nan, dq.float().numpy()) * (np.float32(1) / sb)
    else:  # fp8(float(bs) * s2 / S2)
        vals = E4M3 * sa / sb
    return e4m3_encode(np.clip(vals, -FP8_MAX, FP8_MAX))


@lru_cache(maxsize=256)
def _device_table(kind: str, a: float, b: float, device: str):
    return _torch().from_numpy(_byte_table(kind, a, b)).to(device)


@lru_cache(maxsize=4096)
def _pair_table(kind: str, a: float, b: float) -> np.ndarray:
    """Two input bytes at a time (a uint16 index) for the CPU: half the lookups."""
    byte = _byte_table(kind, a, b).astype(np.uint16)
    lo = np.tile(byte, 256)
    hi = np.repeat(byte, 256)
    return lo | (hi << 8)


def apply_table(kind: str, q, s, big):
    """Bytes of ``q`` requantized (kind "requant", or "requant_f16" through vLLM's float16 intermediate) or
    rescaled ("rescale") from s to big: uint8, a numpy array for a numpy ``q``, else a tensor on ``q``'s
    device (a gather through the 256-entry table on a GPU). Unchanged at s == big, but through float16."""
    same = float(s) == float(big) and kind != "requant_f16"
    if isinstance(q, np.ndarray):
        raw = np.ascontiguousarray(q).view(np.uint8)
        if same:
            return raw
        return _lookup(kind, float(s), float(big), raw)
    raw = q.contiguous().view(_torch().uint8)
    if same:
        return raw
    if raw.device.type != "cpu":
        return _device_table(kind, float(s), float(big), str(raw.device))[raw.long()]
    return _torch().from_numpy(_lookup(kind, float(s), float(big), raw.numpy()))


def _lookup(kind: str, a: float, b: float, raw: np.ndarray) -> np.ndarray:
    table = _pair_table(kind, a, b)
    flat = raw.reshape(-1)
    out = np.empty_like(flat)
    even = flat.size & ~1
    np.take(table, flat[:even].view(np.uint16), out=out[:even].view(np.uint16))
    if even != flat.size:
        out[-1] = table[flat[-1]] & 0xFF
    return out.reshape(raw.shape)


# --- SEMANTICS §10 restated: which source rows/columns a tp rank holds ---------------------------------

def rule_rows(shard: str, n: int, tp: int, t: int, kv_heads: int | None, head_dim: int | None) -> tuple[int, int]:
    last = shard.rpartition(".")[2]
    if last in ("k_proj", "v_proj") and kv_heads and kv_heads < tp:
        head = t * kv_heads // tp  # kv heads replicated: tp / kv ranks share one
        return head * head_dim, (head + 1) * head_dim
    return t * n // tp, (t + 1) * n // tp


def rule_slices(meta: dict, shards: list, tp: int, heads: tuple[int, int] | None) -> list[list[int]] | None:
    """Expected [a, b, c0, c1] per shard for the rank whose module ``meta`` this is (None: one rank, whole tensors)."""
    if "split" not in meta:
        return None
    t, split = meta["tp_rank"], meta["split"]
    kv, hd = heads if heads else (None, None)
    out = []
    for m in shards:
        n, k = m.out_in
        if split == "column":
            a, b = rule_rows(m.name, n, tp, t, kv, hd)
            out.append([a, b, 0, k])
        elif split == "row":
            out.append([0, n, t * k // tp, (t + 1) * k // tp])
        else:
            out.append([0, n, 0, k])
    return out


def heads_of(config: dict) -> tuple[int, int] | None:
    """(kv heads, head dim) from config.json, or None."""
    for cfg in (config, config.get("text_config"), config.get("language_config"), config.get("llm_config")):
        if isinstance(cfg, dict) and isinstance(cfg.get("num_attention_heads"), int):
            heads = cfg["num_attention_heads"]
            kv = cfg.get("num_key_value_heads", heads)
            hd = cfg.get("head_dim") or (cfg.get("hidden_size", 0) // heads if heads else None)
            return (kv, hd) if isinstance(kv, int) and isinstance(hd, int) else None
    return None


def bit_equal(a, b) -> bool:
    """Same shape and bytes (numpy arrays, or tensors compared on the GPU when either is there)."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        if a.shape != b.shape or a.itemsize != b.itemsize:
            return False
        if a.size == 0:
            return True
        wa, wb = as_words(a), as_words(b)
        if wa.dtype == wb.dtype and wa.shape == wb.shape:
            return bool(np.array_equal(wa, wb))
        return bool(np.array_equal(np.ascontiguousarray(wa).view(np.uint8).reshape(-1),
                                   np.ascontiguousarray(wb).view(np.uint8).reshape(-1)))
    torch = _torch()
    a, b = (torch.from_numpy(np.ascontiguousarray(t)) if isinstance(t, np.ndarray) else t for t in (a, b))
    if a.shape != b.shape or a.element_size() != b.element_size():
        return False
    dev = a.device if a.device.type != "cpu" else b.device
    a, b = a.detach().to(dev), b.detach().to(dev)
    if a.numel() == 0:
        return True
    wa, wb = as_words(a), as_words(b)
    if wa.dtype == wb.dtype and wa.shape == wb.shape:
        return torch.equal(wa, wb)  # views compared in place, strided or not
    # else the same flat byte order on both sides first (a transposed view is copied, as rows of words)
    return torch.equal(wa.contiguous().view(torch.uint8).reshape(-1), wb.contiguous().view(torch.uint8).reshape(-1))


def src_requant(src) -> str:
    """The requantization table of a per-tensor FP8 source: through vLLM's float16 intermediate where its
    spelling's engine path does that (compressed-tensors, SEMANTICS §17.2), else §3's float32."""
    return "requant_f16" if src.census.spelling.fp8_requant_f16 else "requant"
