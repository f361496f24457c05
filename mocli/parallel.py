"""Tensor- and expert-parallel ranks: what each GPU of a TP/EP deployment holds (SEMANTICS §10).

Restates vLLM's partitioning (``ColumnParallelLinear``, ``QKVParallelLinear``, ``RowParallelLinear``,
``FusedMoE``): contiguous equal slices, q/k/v on whole heads with kv heads replicated when there
are fewer than ranks, MoE tensor-parallel on the intermediate size or expert-parallel on experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Split(StrEnum):
    COLUMN = "column"  # output rows sliced; the rank computes its part of y
    ROW = "row"  # input columns sliced; rank outputs are summed (all-reduce)
    REPLICATED = "replicated"  # whole on every rank


# Last name component of a linear -> how vLLM partitions it (vllm/model_executor/models/llama.py,
# qwen2.py, qwen3_moe.py, mixtral.py, deepseek_v2.py: the *ParallelLinear class each one builds).
LINEAR_SPLIT: dict[str, Split] = {
    "q_proj": Split.COLUMN, "k_proj": Split.COLUMN, "v_proj": Split.COLUMN,  # QKVParallelLinear
    "gate_proj": Split.COLUMN, "up_proj": Split.COLUMN,  # MergedColumnParallelLinear (dense MLP, shared experts)
    "w1": Split.COLUMN, "w3": Split.COLUMN,
    "q_b_proj": Split.COLUMN, "kv_b_proj": Split.COLUMN,  # DeepSeek MLA ColumnParallelLinear
    "fc1": Split.COLUMN, "c_fc": Split.COLUMN,
    "o_proj": Split.ROW, "down_proj": Split.ROW, "w2": Split.ROW,  # RowParallelLinear
    "fc2": Split.ROW, "out_proj": Split.ROW, "dense": Split.ROW, "c_proj": Split.ROW,
    "q_a_proj": Split.REPLICATED, "kv_a_proj_with_mqa": Split.REPLICATED,  # DeepSeek MLA ReplicatedLinear
}
HEAD_SPLIT = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv"}


def split_of(module: str) -> Split | None:
    """How a dense linear is partitioned (None: mocli does not know this layer's partitioning)."""
    return LINEAR_SPLIT.get(module.rpartition(".")[2])


@dataclass(frozen=True)
class Heads:
    """Attention head counts from config.json (the text model's, for VLMs)."""

    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Heads | None:
        for cfg in (config, config.get("text_config"), config.get("language_config"), config.get("llm_config")):
            if not isinstance(cfg, dict):
                continue
            heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads", cfg.get("num_attention_heads"))
            if _pos_int(heads) and _pos_int(kv):
                hd = cfg.get("head_dim")
                if not _pos_int(hd):
                    hidden = cfg.get("hidden_size")
                    hd = hidden // heads if _pos_int(hidden) and hidden % heads == 0 else None
                return cls(heads, kv, hd) if hd else None
        return None


def _pos_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


@dataclass(frozen=True)
class ParallelLayout:
    """``tp`` tensor-parallel ranks; ``ep`` > 1: MoE expert-parallel over ep = tp x dp ranks."""

    tp: int = 1
    ep: int = 1

    @property
    def ranks(self) -> int:
        return self.ep if self.ep > 1 else self.tp

    @property
    def expert_parallel(self) -> bool:
        return self.ep > 1

    @property
    def single(self) -> bool:
        return self.ranks == 1

    def tp_rank(self, rank: int) -> int:
        """Dense layers are tensor-parallel over tp; with ep = tp x dp, rank r is tp rank r % tp (vLLM)."""
        return rank % self.tp

    def group(self, rank: int) -> str:
        """Directory of a rank's files ("" when there is one rank: the tp = 1 layout is unchanged)."""
        return "" if self.single else f"rank-{rank}"

    def to_dict(self) -> dict[str, Any]:
        return {"tp": self.tp, "ep": self.ep, "ranks": self.ranks,
                "moe": "expert-parallel" if self.expert_parallel else "tensor-parallel"}


def even(size: int, parts: int, part: int) -> tuple[int, int]:
    """[start, stop) of one of ``parts`` contiguous equal slices (caller checked divisibility)."""
    step = size // parts
    return part * step, (part + 1) * step


def column_rows(shard: str, n: int, tp: int, tp_rank: int, heads: Heads | None) -> tuple[int, int]:
    """Rows of a column-parallel shard on one tp rank; k/v heads are replicated when kv < tp."""
    if HEAD_SPLIT.get(shard.rpartition(".")[2]) == "kv" and heads is not None and heads.kv_heads < tp:
        head = tp_rank // (tp // heads.kv_heads)
        return head * heads.head_dim, (head + 1) * heads.head_dim
    return even(n, tp, tp_rank)


def expert_range(experts: int, layout: ParallelLayout, rank: int) -> tuple[int, int]:
    """Global expert ids [start, stop) a rank holds: all of them unless expert-parallel."""
    return even(experts, layout.ep, rank) if layout.expert_parallel else (0, experts)


def block_split(inter: int, tp: int, t: int, block: int = 32) -> tuple[int, int]:
    """gpt-oss's MoE loaders (native and Quark; interleaved gate/up): TP rank ``t``'s rows of I in whole
    ``block``-row blocks, unequal, ``P = block·ceil(I/(block·tp))`` each from the start (SEMANTICS §19.3)."""
    p = block * -(-inter // (block * tp))
    return min(t * p, inter), min((t + 1) * p, inter)


def intermediate_range(inter: int, layout: ParallelLayout, rank: int) -> tuple[int, int]:
    """The slice of I a rank holds: I / tp under MoE tensor parallel, all of it under expert parallel."""
    return (0, inter) if layout.expert_parallel else even(inter, layout.tp, layout.tp_rank(rank))


@dataclass(frozen=True)
class RankSlice:
    """One tp rank's part of a module: per shard, rows [a, b) and columns [c0, c1) of the source."""

    tp_rank: int
    rows: tuple[tuple[int, int], ...]
    cols: tuple[int, int]

    @property
    def n(self) -> int:
        return sum(b - a for a, b in self.rows)

    @property
    def k(self) -> int:
        return self.cols[1] - self.cols[0]

    def meta(self) -> list[list[int]]:
        return [[a, b, *self.cols] for a, b in self.rows]


def rank_slices(layout: ParallelLayout, heads: Heads | None, shards: list[Any]) -> dict[int, RankSlice]:
    """tp rank -> its slice of a dense module (``shards``: census Modules in fused order), one entry per
    distinct tp rank."""
    n_k = [m.out_in for m in shards]
    k = n_k[0][1]
    tp = layout.tp
    split = split_of(shards[0].name) if tp > 1 else Split.REPLICATED
    out = {}
    for t in sorted({layout.tp_rank(r) for r in range(layout.ranks)}):
        if split is Split.COLUMN:
            rows = tuple(column_rows(m.name, n, tp, t, heads) for m, (n, _) in zip(shards, n_k, strict=True))
            out[t] = RankSlice(t, rows, (0, k))
        elif split is Split.ROW:
            out[t] = RankSlice(t, tuple((0, n) for n, _ in n_k), even(k, tp, t))
        else:
            out[t] = RankSlice(t, tuple((0, n) for n, _ in n_k), (0, k))
    return out
