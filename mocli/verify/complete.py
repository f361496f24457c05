"""Completeness: the output holds everything the source converts to, and nothing else.

Verify's own restatement, independent of the planner: every quantized dense module (a fused group
in one scheme, or a lone linear) and every quantized MoE layer of the source is a converted module on
every rank, built from exactly those source modules and (MoE) holding the experts and rows SEMANTICS
§10 gives the rank; every other source tensor (KV-cache scales included) is passed through. A module
or tensor left out, one from another source, or a rank that claims someone else's experts fails here
even when every byte that *is* there is right.
"""

from __future__ import annotations

from mocli.census import Census, Kind
from mocli.formats.manifest import Layout, Parallelism, RankEntry
from mocli.parallel import block_split

# the tensors of a quantized module that its converted module replaces
_MODULE_SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "bias")


def expected_modules(census: Census) -> dict[str, list[str]]:
    """Converted module name -> the source modules it is built from."""
    out: dict[str, list[str]] = {}
    for g in census.fused:
        schemes = {m.scheme for m in g.shards}
        if len(schemes) == 1 and None not in schemes:
            out[g.name] = [m.name for m in g.shards]
    for m in census.modules.values():
        if m.scheme is not None and m.kind is Kind.LINEAR:
            out[m.name] = [m.name]
    for layer in census.moe:
        if len(layer.schemes) == 1 and None not in layer.schemes:
            out[layer.name] = [layer.name]
    return out


def expected_passthrough(census: Census, modules: dict[str, list[str]]) -> set[str]:
    """Source tensors no converted module replaces."""
    replaced: set[str] = set()
    layers = {layer.name: layer for layer in census.moe}
    for name, sources in modules.items():
        if name in layers:
            mods = [m for ex in layers[name].experts.values() for _, m in ex.projections() if m is not None]
        else:
            mods = [census.modules[s] for s in sources]
        replaced |= {e.name for m in mods for s, e in m.tensors.items() if s in _MODULE_SUFFIXES}
    every = {e.name for m in census.modules.values() for e in m.tensors.values()} | {e.name for e in census.kv_scales}
    return every - replaced


def _moe_rule(meta: dict, census_layer, parallel: Parallelism, rank_entry: RankEntry | None) -> list[str]:
    """SEMANTICS §10 for one MoE rank: experts [r·E/ep, ...) whole under expert parallel, else every
    expert with I/tp of the rows [t·I/tp, ...) (gpt-oss's interleaved experts: whole 32-row blocks, §19.3)."""
    if rank_entry is None:
        return []
    e_total, inter = census_layer.num_experts, census_layer.intermediate
    tp, ep, r = parallel.tp, parallel.ep, rank_entry.rank
    if ep > 1:
        want = {"expert_offset": r * e_total // ep, "experts": e_total // ep, "intermediate_slice": [0, inter]}
    else:
        t = rank_entry.tp_rank
        rows = block_split(inter, tp, t) if census_layer.interleaved else (t * inter // tp, (t + 1) * inter // tp)
        want = {"expert_offset": 0, "experts": e_total, "intermediate_slice": list(rows)}
    return [f"{k} is {meta.get(k)!r}, SEMANTICS §10 gives {v!r}" for k, v in want.items() if meta.get(k) != v]


def completeness(layout: Layout, census: Census, ranks: list[int]) -> list[dict[str, str]]:
    """Problems (module or tensor, what is wrong) of the checked ranks and the shared tensors."""
    problems: list[dict[str, str]] = []
    modules = expected_modules(census)
    layers = {layer.name: layer for layer in census.moe}
    declared = layout.ranks
    views = [(declared[r], declared[r].modules) for r in ranks] if declared else [(None, layout.modules)]
    for entry, mods in views:
        where = f" on rank {entry.rank}" if entry is not None else ""
        got = {m.name: m for m in mods}
        for name, sources in modules.items():
            if name not in got:
                problems.append({"module": name, "problem": f"missing{where}: the source converts to it "
                                 f"(from {', '.join(sources[:3])}{' ...' if len(sources) > 3 else ''})"})
            elif list(got[name].sources) != sources:
                problems.append({"module": name, "problem": f"built{where} from {list(got[name].sources)}, but the "
                                 f"source gives {sources}"})
            elif name in layers:
                problems += [{"module": name, "problem": f"{why}{where}"}
                             for why in _moe_rule(got[name].meta, layers[name], layout.parallel, entry)]
        for name in sorted(set(got) - set(modules)):
            problems.append({"module": name, "problem": f"is{where} in the output but the source converts to no "
                             "such module (another source?)"})
    passed = set(layout.passthrough())
    for name in sorted(expected_passthrough(census, modules) - passed):
        problems.append({"module": name, "problem": "source tensor neither converted nor passed through"})
    for name in sorted(passed - expected_passthrough(census, modules)):
        problems.append({"module": name, "problem": "passed through, but the source has no such tensor outside "
                         "its converted modules"})
    return problems
