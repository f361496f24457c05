"""Tensor- and expert-parallel findings (SEMANTICS §10): q/k/v split on whole heads (PAR001, PAR005),
experts over ep ranks (PAR002), every rank's slice holding whole scale entries of its scheme
(PAR003: ``Scheme.rows_split`` / ``cols_split``), layers mocli cannot split (PAR004)."""

from __future__ import annotations

from mocli.census import Census, Module, MoELayer
from mocli.findings import Findings
from mocli.parallel import HEAD_SPLIT, Heads, ParallelLayout, Split, rank_slices, split_of
from mocli.schemes import Scheme


def sliceable_units(census: Census) -> list[tuple[str, list[Module], Scheme]]:
    """``Census.dense_units`` whose shards all have a 2-D weight (the others are TNS findings)."""
    return [(n, s, a) for n, s, a in census.dense_units() if all(m.out_in for m in s)]


def check_parallel(par: ParallelLayout, heads: Heads | None, census: Census, findings: Findings) -> set[str]:
    """PAR findings for a tp/ep layout; returns the dense modules that can be sliced (for TGT checks)."""
    dense = sliceable_units(census)
    if par.single:
        return {n for n, _, _ in dense}
    at = f"tp {par.tp}" + (f", ep {par.ep}" if par.ep > 1 else "")
    if par.ep > 1 and par.ep % par.tp:
        findings.add("PAR002", "parallel layout", f"ep {par.ep} is not a multiple of tp {par.tp}",
                     hint="expert parallel spans tp x dp ranks (vLLM); choose ep = tp x dp")
    if par.ep > 1 and not any(layer.schemes - {None} for layer in census.moe):
        # ranks beyond tp would be byte copies of the tensor-parallel ones: data parallelism, which
        # engines serve from the tp ranks' files with no per-rank layout of its own
        findings.add("PAR002", "parallel layout", f"--ep {par.ep} splits MoE experts, and this checkpoint has no "
                     "quantized MoE layer", hint=f"convert with --tp {par.tp} alone; data-parallel replicas load "
                     "the same files")
    attention = [m for _, shards, _ in dense for m in shards if m.name.rpartition(".")[2] in HEAD_SPLIT]
    head_fault = _check_heads(par.tp, heads, attention, findings)
    ok: set[str] = set()
    for name, shards, scheme in dense:
        if split_of(shards[0].name) is None:
            findings.add("PAR004", name, f"mocli does not know how engines split '{name.rpartition('.')[2]}' "
                         f"across ranks ({at})", hint="convert at tp 1, or exclude the layer from quantization")
            continue
        faults = _dense_split_faults(par, heads, shards, scheme, head_fault)
        for f in faults:
            if f != "heads":
                findings.add("PAR003", name, f"{f} ({at})", hint="choose a tp that splits this layer evenly")
        if not faults:
            ok.add(name)
    for layer in census.moe:
        _check_moe_split(par, layer, findings)
    return ok


def _check_heads(tp: int, heads: Heads | None, attention: list[Module], findings: Findings) -> bool:
    """PAR001/PAR005: q/k/v split on whole heads (kv heads divided or replicated). True on a fault."""
    if not attention or tp == 1:
        return False
    if heads is None:
        findings.add("PAR005", "config.json", "no num_attention_heads / num_key_value_heads / head_dim",
                     hint="q/k/v are split on whole heads at tp > 1; add the counts to config.json")
        return True
    fault = False
    if heads.heads % tp:
        findings.add("PAR001", "config.json", f"{heads.heads} attention heads do not divide among {tp} ranks",
                     hint="choose a tp that divides num_attention_heads")
        fault = True
    kv = heads.kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        findings.add("PAR001", "config.json", f"{kv} kv heads neither divide among nor replicate evenly over "
                     f"{tp} ranks", hint="tp must divide num_key_value_heads, or be a multiple of it")
        fault = True
    for m in attention:
        want = (heads.heads if HEAD_SPLIT[m.name.rpartition(".")[2]] == "q" else kv) * heads.head_dim
        if m.out_in[0] != want:
            findings.add("PAR005", m.name, f"has {m.out_in[0]} rows but config.json's heads x head_dim "
                         f"says {want}", hint="fix num_attention_heads / num_key_value_heads / head_dim")
            fault = True
    return fault


def _dense_split_faults(par: ParallelLayout, heads: Heads | None, shards: list[Module], scheme: Scheme,
                        head_fault: bool) -> list[str]:
    """Why one dense module cannot be split over par.tp ranks ("heads": a PAR001/PAR005 already said)."""
    tp, faults = par.tp, []
    k = shards[0].out_in[1]
    split = split_of(shards[0].name)
    if split is Split.COLUMN:
        for m in shards:
            if m.name.rpartition(".")[2] in HEAD_SPLIT:
                if head_fault:
                    faults.append("heads")
            elif m.out_in[0] % tp:
                faults.append(f"{m.name.rpartition('.')[2]} has {m.out_in[0]} rows, not divisible by tp {tp}")
        if not faults:
            sl = rank_slices(par, heads, shards)[0]
            faults += [f"{m.name.rpartition('.')[2]}: {b - a} rows per rank is not a whole {scheme.scale_rows}-row "
                       f"{scheme} scale block" for m, (a, b) in zip(shards, sl.rows, strict=True)
                       if not scheme.rows_split(b - a)]
    elif split is Split.ROW:
        if k % tp:
            faults.append(f"K = {k} is not divisible by tp {tp}")
        elif not scheme.cols_split(k // tp):
            faults.append(f"K / tp = {k // tp} is not a whole number of {scheme.scale_cols}-column {scheme} scale "
                          "blocks")
    return faults


def _check_moe_split(par: ParallelLayout, layer: MoELayer, findings: Findings) -> None:
    """PAR002/PAR003: experts over ep ranks, or I over tp ranks (whole scale blocks of the scheme)."""
    schemes = layer.schemes - {None}
    if not schemes or layer.intermediate is None:
        return
    if par.ep > 1:
        if layer.num_experts % par.ep:
            findings.add("PAR002", layer.name, f"{layer.num_experts} experts do not divide among {par.ep} "
                         "expert-parallel ranks", hint="choose an ep that divides the number of experts")
        return
    i, tp = layer.intermediate, par.tp
    if i % tp:
        findings.add("PAR003", layer.name, f"intermediate size {i} is not divisible by tp {tp}" + (
                     " (vLLM's FusedMoEConfig asserts it)" if layer.interleaved else ""),
                     hint="choose a tp that divides I, or use --ep")
        return
    if layer.interleaved:
        # gpt-oss's loaders (native and Quark, vllm 0.33 models/gpt_oss.py :: _load_weights_mxfp4,
        # _load_weights_quark) split I in whole scale blocks, unequally (SEMANTICS §19.3): every rank's share is
        # whole blocks by construction, so only vLLM's I % tp assertion above applies
        return
    # a rank holds I / tp rows of w1 and w3 and I / tp columns of w2
    for s in sorted(schemes, key=str):
        if not (s.rows_split(i // tp) and s.cols_split(i // tp)):
            findings.add("PAR003", layer.name, f"I / tp = {i // tp} is not a whole number of "
                         f"{max(s.scale_rows, s.scale_cols)}-element {s} scale blocks", hint="choose a smaller tp, or use --ep")
