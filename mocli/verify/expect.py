"""What a converted module must hold, derived from the source by verify's own code.

Independent of ``mocli.plan`` and ``mocli.ops``: the requantization and rescaling tables are built
here from the SEMANTICS §3/§6 formulas, the §10 slice rule is restated here, and the consistency
rules for every derived scale are written out per role. Verify compares the converted bytes (after
the target's inverse transforms) and scales with these exactly.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from mocli.targets.decode import as_words

FP8 = torch.float8_e4m3fn


# --- byte tables (SEMANTICS §3, §6), evaluated on all 256 codes --------------------------------------

@lru_cache(maxsize=4096)
def _byte_table(kind: str, a: float, b: float) -> torch.Tensor:
    """The output byte for each of the 256 input codes, uint8 [256]."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    sa, sb = torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32)
    if kind == "requant":  # fp8(clamp(float(q) * s * (1/S), ±448)), 1/S rounded once
        vals = codes * sa * torch.reciprocal(sb)
    else:  # fp8(float(bs) * s2 / S2)
        vals = codes * sa / sb
    return vals.clamp(-448, 448).to(FP8).view(torch.uint8)


@lru_cache(maxsize=256)
def _device_table(kind: str, a: float, b: float, device: str) -> torch.Tensor:
    return _byte_table(kind, a, b).to(device)


@lru_cache(maxsize=4096)
def _pair_table(kind: str, a: float, b: float) -> np.ndarray:
    """Two input bytes at a time (a uint16 index) for the CPU: half the lookups."""
    byte = _byte_table(kind, a, b).numpy().astype(np.uint16)
    lo = np.tile(byte, 256)
    hi = np.repeat(byte, 256)
    return lo | (hi << 8)


def apply_table(kind: str, q: torch.Tensor, s: torch.Tensor, big: torch.Tensor) -> torch.Tensor:
    """Bytes of ``q`` requantized (kind "requant") or rescaled ("rescale") from s to big; uint8 on
    ``q``'s device (a gather through the 256-entry table on a GPU)."""
    raw = q.contiguous().view(torch.uint8)
    if float(s) == float(big):
        return raw
    if raw.device.type != "cpu":
        return _device_table(kind, float(s), float(big), str(raw.device))[raw.long()]
    table = _pair_table(kind, float(s), float(big))
    flat = raw.reshape(-1).numpy()
    out = np.empty_like(flat)
    even = flat.size & ~1
    np.take(table, flat[:even].view(np.uint16), out=out[:even].view(np.uint16))
    if even != flat.size:
        out[-1] = table[flat[-1]] & 0xFF
    return torch.from_numpy(out).reshape(raw.shape)


# --- SEMANTICS §10 restated: which source rows/columns a tp rank holds ---------------------------------

def rule_rows(shard: str, n: int, tp: int, t: int, kv_heads: int | None, head_dim: int | None) -> tuple[int, int]:
    last = shard.rpartition(".")[2]
    if last in ("k_proj", "v_proj") and kv_heads and kv_heads < tp:
        head = t * kv_heads // tp  # kv heads replicated: tp / kv ranks share one
        return head * head_dim, (head + 1) * head_dim
    return t * n // tp, (t + 1) * n // tp


def rule_slices(info: dict, shards: list, tp: int, heads: tuple[int, int] | None) -> list[list[int]] | None:
    """Expected [a, b, c0, c1] per shard for the rank in ``info`` (None: one rank, whole tensors)."""
    meta = info["meta"]
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


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and bytes; compared on the GPU when either tensor is there."""
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
