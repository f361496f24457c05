"""Exclusion findings (SEMANTICS §2): patterns against the modules the engine asks about, and what the
config declares quantized against how each module is stored (EXC001-EXC006, CFG006)."""

from __future__ import annotations

from mocli.census import Census, Kind, Module
from mocli.exclusions import PartialFusedExclusion, is_excluded, pattern_reports
from mocli.findings import Findings, few
from mocli.quant_config import QuantConfig
from mocli.tables import ROUTER_TAKES_QUANT_CONFIG


def declared_quantized(quant: QuantConfig, census: Census, findings: Findings,
                       architecture: str | None = None) -> dict[str, bool | None]:
    """engine prefix -> will the engine quantize it? None where the engine would refuse (partial fused).
    An MoE router the model builds without the quantization config is never quantized (``tables``)."""
    out: dict[str, bool | None] = {}
    if architecture not in ROUTER_TAKES_QUANT_CONFIG:
        out |= {f"{layer.name.rpartition('.')[0]}.gate": False for layer in census.moe}
    for m in census.modules.values():
        if not m.is_linear or m.engine_name in out:
            continue
        try:
            excluded = is_excluded(m.engine_name, quant.exclude_modules, quant.method)
        except PartialFusedExclusion as e:
            findings.add("EXC002", e.prefix,
                         f"exclude_modules lists {', '.join(e.excluded)} but not {', '.join(e.kept)}",
                         hint="the engine refuses this ('some but not all shards excluded'): exclude all shards or none")
            out[m.engine_name] = None
            continue
        out[m.engine_name] = not excluded and quant.algo_for(m.name) is not None
    return out


def check_mixed_layers(quant: QuantConfig, census: Census, findings: Findings) -> None:
    """Every ``quantized_layers`` key names a module, or an MoE layer's experts container (ModelOpt 0.47
    lists experts once per layer under the FusedMoE prefix, e.g. ``model.layers.0.mlp.experts``)."""
    layers = {layer.name for layer in census.moe}
    for module in quant.quantized_layers:
        if module not in census.modules and module not in layers:
            findings.add("CFG006", f"quantized_layers.{module}", "no such module in the checkpoint",
                         hint="module names must match the checkpoint's tensor prefixes")


def check_exclusions(quant: QuantConfig, census: Census, declared: dict[str, bool | None],
                     findings: Findings) -> None:
    _check_patterns(quant, census, findings)
    # Stored state against the declaration, one finding per engine prefix.
    by_engine: dict[str, list[Module]] = {}
    for m in census.linears():
        by_engine.setdefault(m.engine_name, []).append(m)
    for prefix, mods in by_engine.items():
        stored_q = [m for m in mods if m.scheme is not None]
        stored_u = [m for m in mods if m.scheme is None]
        if stored_q and stored_u and mods[0].kind is Kind.FUSED_SHARD:
            findings.add("EXC002", prefix,
                         f"shards stored unquantized: {few([m.name.rpartition('.')[2] for m in stored_u])}; "
                         f"quantized: {few([m.name.rpartition('.')[2] for m in stored_q])}",
                         hint="the engine loads a fused group in one scheme; quantize or exclude all shards")
            continue
        want = declared.get(prefix)
        if want is None:
            continue
        if not want and stored_q:
            findings.add("EXC003", prefix, f"excluded by the config but {len(stored_q)} module(s) are stored "
                         f"quantized ({few([m.name for m in stored_q])})",
                         hint=f"the engine will load quantized bytes as BF16; fix {_key(quant)}")
        elif want and stored_u:
            findings.add("EXC004", prefix, f"not excluded but {len(stored_u)} module(s) are stored unquantized "
                         f"({few([m.name for m in stored_u])})",
                         hint="add it to " + ("ignore" if quant.resolver else "exclude_modules (and config.json ignore)"))


def _key(quant: QuantConfig) -> str:
    return "ignore" if quant.resolver is not None else "exclude_modules"


def _check_patterns(quant: QuantConfig, census: Census, findings: Findings) -> None:
    if quant.resolver is not None:  # compressed-tensors: ignore / targets under its own rules (SEMANTICS §17.4)
        from mocli.compressed_tensors import check_ignore

        check_ignore(quant.resolver, census, findings)
        return
    for r in pattern_reports(quant.exclude_modules, census, quant.method):
        loc = f"exclude_modules: {r.pattern}"
        if r.vlm_alias:
            findings.add("EXC006", loc, f"matches nothing, but {r.vlm_alias!r} would",
                         hint="the VLM prefix differs between exporter and engine; use the engine's spelling")
        elif not r.matches and not r.partial:
            hint = ("it matches checkpoint names " + ", ".join(r.checkpoint_matches[:3]) +
                    " but the engine asks for fused/MoE names (qkv_proj, gate_up_proj, …experts)"
                    if r.checkpoint_matches else "check the spelling against the tensor names")
            findings.add("EXC001", loc, "pattern matches no module", hint=hint)
        if r.after_rewrite_lost:
            findings.add("EXC005", loc,
                         f"after the engine's p* -> p, p.* rewrite it no longer matches {few(r.after_rewrite_lost)}",
                         hint=f"write it as {r.pattern[:-1]}.* or list the modules explicitly")
