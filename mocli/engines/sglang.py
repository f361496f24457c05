"""SGLang 0.5.23's reading of a ModelOpt checkpoint, as findings (``validate --engine sglang``).

Restated from ``sglang==0.5.23``'s wheel (``srt/layers/quantization/modelopt_quant.py``,
``srt/layers/quantization/utils.py``, ``srt/configs/model_config.py``); each rule names the function
it mirrors. Where SGLang reads a checkpoint otherwise than vLLM (SEMANTICS §2 is vLLM's), a module can
be served by one engine and crash or be silently mis-served by the other (sglang#36596: exclusion
entries that reach fused shards only through wildcards).
"""

from __future__ import annotations

import re

from mocli.census import Census, Kind, Module
from mocli.findings import Findings, few
from mocli.quant_config import QuantConfig

VERSION = "0.5.23"
ENGINE = f"SGLang {VERSION}"  # as validate's summary names it too (mocli.engines.LABELS)

# utils.py :: is_layer_skipped: fused names it always expands, whatever the model declares
FALLBACK_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# modelopt_quant.py :: is_layer_excluded: MLA projections matched by their last name in every layer
MLA_TAILS = frozenset({"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"})
# architectures whose SGLang model declares no packed_modules_mapping (models/llama.py, qwen2.py, qwen3.py,
# mixtral.py): under MIXED_PRECISION their fused q/k/v and gate/up resolve to no algorithm
# (_resolve_quant_algo) and are built unquantized
NO_PACKED_MAPPING = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MixtralForCausalLM"})
# modelopt_quant.py :: ModelOptFp4Config: the names it accepts, spelled exactly so
FP4_CONFIG_ALGOS = frozenset({"FP8", "NVFP4", "NVFP4_AWQ", "W4A16_NVFP4"})
# ModelOptMixedPrecisionConfig: per-layer algorithms it builds (others: built unquantized, silently)
MIXED_LAYER_ALGOS = frozenset({"FP8", "FP8_PB_WO", "FP8_BLOCK_SCALES", "MXFP8", "NVFP4", "W4A16_NVFP4"})
_LIVE_REGEX = re.compile(r"[?+()\[\]{}|^$\\]")  # regex syntax SGLang leaves live in an exclude entry


class PartialShards(Exception):
    """SGLang's ValueError: "Detected some but not all shards of ... are quantized"."""


def _path_match(ignored: str, prefix: str) -> bool:
    """utils.py :: _module_path_match: equal, a dotted ancestor, or a dot-aligned sub-path; ``*`` is literal."""
    ignored, prefix = ignored.rstrip("."), prefix.rstrip(".")
    return ignored == prefix or prefix.startswith(ignored + ".") or f".{ignored}." in f".{prefix}."


def is_layer_skipped(prefix: str, entries: list[str], fused: dict[str, tuple[str, ...]]) -> bool:
    """utils.py :: is_layer_skipped (linear layers): fused names shard by shard, dotted paths, no wildcards."""
    proj = prefix.rsplit(".", 1)[-1]
    table = fused if proj in fused else FALLBACK_FUSED
    if proj in table:
        flags = {any(_path_match(e, prefix.replace(proj, s)) for e in entries) for s in table[proj]}
        if len(flags) > 1:
            raise PartialShards(prefix)
        return flags.pop()
    return any(_path_match(e, prefix) for e in entries)


def glob_full(pattern: str, text: str) -> bool:
    """``re.fullmatch`` of SGLang's translation (``.`` literal, ``*`` any run of characters, dots included)
    without a regex: a pattern read from an untrusted file must not backtrack for ever."""
    parts = pattern.split("*")
    if len(parts) == 1:
        return pattern == text
    if not (text.startswith(parts[0]) and text.endswith(parts[-1])) or len(parts[0]) + len(parts[-1]) > len(text):
        return False
    pos, end = len(parts[0]), len(text) - len(parts[-1])
    for middle in parts[1:-1]:  # greedy leftmost placement is exact for '*'-only patterns
        at = text.find(middle, pos, end)
        if at < 0:
            return False
        pos = at + len(middle)
    return True


def is_layer_excluded(prefix: str, entries: list[str]) -> bool:
    """modelopt_quant.py :: ModelOptQuantConfig.is_layer_excluded: a full match of the whole name (also
    without a leading ``language_model.``) or of any one of its components, or an MLA tail in any layer.
    Entries with other live regex syntax are left out (``live_regex``: a finding of their own)."""
    names = [prefix] + ([prefix.removeprefix("language_model.")] if prefix.startswith("language_model.") else [])
    last = prefix.rsplit(".", 1)[-1]
    for e in entries:
        if _LIVE_REGEX.search(e):
            continue
        if any(glob_full(e, n) or any(glob_full(e, part) for part in n.split(".")) for n in names):
            return True
        tail = e.rsplit(".", 1)[-1]
        if tail in MLA_TAILS and tail in last:
            return True
    return False


def builds_quantized(prefix: str, moe: bool, quant: QuantConfig, fused: dict[str, tuple[str, ...]]) -> bool:
    """Whether SGLang builds this module quantized (``_get_quant_method``; MoE layers by
    ``is_layer_excluded`` alone; MIXED_PRECISION through ``_resolve_quant_algo``). PartialShards where it
    refuses the checkpoint."""
    entries = quant.exclude_modules
    if moe:
        excluded = is_layer_excluded(prefix, entries)
    else:
        excluded = is_layer_skipped(prefix, entries, fused) or is_layer_excluded(prefix, entries)
    if excluded:
        return False
    if quant.quantized_layers:
        return _resolve(prefix, quant, fused) is not None
    return True


def _resolve(prefix: str, quant: QuantConfig, fused: dict[str, tuple[str, ...]]) -> str | None:
    """modelopt_quant.py :: _resolve_quant_algo: the exact name, the shards of a fused name (the model's
    own table only), else the first entry under the prefix (an MoE layer's container name)."""
    layers = quant.quantized_layers
    if prefix in layers:
        return str(layers[prefix].algo)
    base, _, proj = prefix.rpartition(".")
    if proj in fused:
        algos = {str(layers[f"{base}.{s}"].algo) for s in fused[proj] if f"{base}.{s}" in layers}
        if len(algos) == 1:
            return algos.pop()
    return next((str(v.algo) for k, v in layers.items() if k.startswith(prefix + ".")), None)


def fused_table(architecture: str | None) -> dict[str, tuple[str, ...]]:
    """The model's packed_modules_mapping as SGLang sees it (none for the architectures that declare none)."""
    return {} if architecture in NO_PACKED_MAPPING else dict(FALLBACK_FUSED)


def check(quant: QuantConfig, census: Census, architecture: str | None, findings: Findings) -> None:
    """Every SGL finding: what SGLang refuses, builds otherwise than stored, or leaves unapplied."""
    if not _check_config(quant, findings):
        return
    fused = fused_table(architecture)
    for e in quant.exclude_modules:
        if _LIVE_REGEX.search(e):
            findings.add("SGL007", f"exclude_modules: {e}", f"{ENGINE} reads it as a regular expression with live "
                         "syntax (only '.' and '*' are escaped); mocli does not evaluate it",
                         hint="write exact module names, or '*' wildcards")
    for prefix, mods in _prefixes(census):
        _check_prefix(prefix, mods, quant, fused, findings)


def _prefixes(census: Census) -> list[tuple[str, list[Module]]]:
    """Every prefix SGLang builds a quantizable layer for, with the stored modules behind it (lm_head
    included: SGLang's ParallelLMHead takes the quantization config)."""
    by: dict[str, list[Module]] = {}
    for m in census.modules.values():
        if m.is_linear or m.kind is Kind.EMBEDDING and m.name.rpartition(".")[2] == "lm_head":
            by.setdefault(m.engine_name, []).append(m)
    return list(by.items())


def _check_prefix(prefix: str, mods: list[Module], quant: QuantConfig, fused, findings: Findings) -> None:
    moe = mods[0].kind is Kind.EXPERT
    try:
        quantized = builds_quantized(prefix, moe, quant, fused)
    except PartialShards:
        findings.add("SGL003", prefix, f"{ENGINE} refuses the checkpoint: its dotted-path exclusion rule "
                     "(is_layer_skipped) excludes some but not all of these shards",
                     hint="exclude every shard of the fused group by its exact name, or none")
        return
    stored_q = [m.name for m in mods if m.scheme is not None]
    stored_u = [m.name for m in mods if m.scheme is None]
    if quantized and stored_u:
        findings.add("SGL001", prefix, f"{ENGINE} builds it quantized, but {len(stored_u)} module(s) are stored "
                     f"unquantized ({few(stored_u, 2)}): an NVFP4 layer fails to load, an FP8 one is silently cast",
                     hint="SGLang matches exclude entries by dotted path and regex, not vLLM's fnmatch and substring "
                          "rules (sglang#36596): list the engine's names exactly")
    elif not quantized and stored_q:
        findings.add("SGL002", prefix, f"{ENGINE} builds it unquantized, but {len(stored_q)} module(s) are stored "
                     f"quantized ({few(stored_q, 2)})",
                     hint="its exclusion or MIXED_PRECISION lookup reaches this module; SGLang would read quantized "
                          "bytes as BF16")


def _check_config(quant: QuantConfig, findings: Findings) -> bool:
    """SGL004-SGL006 (configs/model_config.py :: _parse_modelopt_quant_config and the config classes);
    False where SGLang refuses the checkpoint outright."""
    where, algo = f"{quant.origin}: quant_algo", quant.raw_algo or ""
    if quant.method == "compressed-tensors":
        return False  # not restated (mocli.engines.unjudged: validate's summary says "not judged")
    if quant.method != "modelopt":
        return True  # vLLM's serialized fp8 (mocli quantize): SGLang's own Fp8Config, not ModelOpt's
    if algo == "MIXED_PRECISION":
        layer_algos = {n: v.raw_algo for n, v in quant.quantized_layers.items()}
        if not any(a.upper() in ("NVFP4", "W4A16_NVFP4") for a in layer_algos.values()):
            findings.add("SGL004", where, f"{ENGINE} reads a MIXED_PRECISION checkpoint without an NVFP4 layer as "
                         "its W4AFP8 format (block FP8 linears, INT4 experts): a mis-load",
                         hint="SGLang serves MIXED_PRECISION checkpoints that hold NVFP4 or W4A16_NVFP4 layers")
            return False
        odd = sorted(n for n, a in layer_algos.items() if a.upper() not in MIXED_LAYER_ALGOS)
        if odd:
            findings.add("SGL005", f"{quant.origin}: quantized_layers", f"{ENGINE} builds {len(odd)} layer(s) of "
                         f"an algorithm it does not read unquantized, silently ({few(odd, 2)})",
                         hint=f"SGLang's MIXED_PRECISION layers are {', '.join(sorted(MIXED_LAYER_ALGOS))}")
    elif "FP4" in algo and algo not in FP4_CONFIG_ALGOS or "FP4" not in algo and algo not in ("FP8", "MXFP8"):
        findings.add("SGL004", where, f"{ENGINE} does not load quant_algo {algo!r} (case-sensitive; its ModelOpt "
                     "FP8 config takes FP8 only, its FP4 config " + ", ".join(sorted(FP4_CONFIG_ALGOS)) + ")",
                     hint="serve this checkpoint with vLLM, or re-export it in an algorithm SGLang reads")
        return False
    if (quant.kv_cache_algo or "").upper() == "NVFP4":
        findings.add("SGL006", f"{quant.origin}: kv_cache_quant_algo", f"{ENGINE} keeps a BF16 KV cache with "
                     "--kv-cache-dtype auto (it applies FP8 KV caches only)",
                     hint="start SGLang with --kv-cache-dtype nvfp4 to use the NVFP4 KV cache and its scales")
    return True
