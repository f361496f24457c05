"""The engine's "is this module excluded?" decision (SEMANTICS §2), and a report per pattern.

Mirrors vLLM ``is_layer_skipped`` + ``ModelOptQuantConfigBase.is_layer_excluded``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from mocli.census import Census, Kind
from mocli.tables import FUSED_GROUPS, VLM_PREFIX_ALIASES

_WILDCARDS = frozenset("*?[")  # what makes an fnmatch pattern more than a literal


class PartialFusedExclusion(Exception):
    """The engine raises "some but not all shards excluded" for this fused prefix."""

    def __init__(self, prefix: str, excluded: list[str], kept: list[str]) -> None:
        super().__init__(prefix)
        self.prefix, self.excluded, self.kept = prefix, excluded, kept


def is_excluded(prefix: str, entries: list[str], rules: str = "modelopt") -> bool:
    """Engine semantics for one engine-side module prefix. Raises PartialFusedExclusion.

    ``rules``: "modelopt" (all three steps below) or "fp8" (vLLM Fp8Config: step 1 only)."""
    if not entries:
        return False
    # 1. exact, fused-aware; MoE layers by substring of an "experts" entry.
    head, _, last = prefix.rpartition(".")
    exact: bool
    if last in FUSED_GROUPS:
        shards = [f"{head}.{s}" if head else s for s in FUSED_GROUPS[last]]
        flags = [s in entries for s in shards]
        if any(flags) and not all(flags):
            raise PartialFusedExclusion(prefix, [s for s, f in zip(shards, flags, strict=True) if f],
                                        [s for s, f in zip(shards, flags, strict=True) if not f])
        exact = all(flags)
    elif "experts" in prefix:
        exact = any(prefix in e for e in entries if "experts" in e)
    else:
        exact = prefix in entries
    if exact or rules == "fp8":
        return exact
    # 2. legacy substring rule (also without a leading "language_model.").
    stripped = prefix.removeprefix("language_model.")
    for e in entries:
        if e != prefix and (e in prefix or e in stripped):
            return True
    # 3. wildcards; fnmatch's * also matches ".".
    return any(fnmatchcase(prefix, e) for e in entries)


def engine_rewrite(entry: str) -> list[str]:
    """vLLM (issue 28072) splits ``p*`` into ``p`` and ``p.*`` before renaming, unless ``*`` follows a dot."""
    if entry.endswith("*") and len(entry) > 1 and entry[-2] != ".":
        p = entry[:-1]
        return [p, p + ".*"]
    return [entry]


@dataclass
class PatternReport:
    pattern: str
    matches: list[str] = field(default_factory=list)  # engine prefixes it excludes
    partial: list[str] = field(default_factory=list)  # fused prefixes it half-excludes
    checkpoint_matches: list[str] = field(default_factory=list)  # checkpoint names (if engine ones miss)
    after_rewrite_lost: list[str] = field(default_factory=list)
    vlm_alias: str | None = None  # the spelling under which it would match

    def to_dict(self) -> dict:
        return {
            "pattern": self.pattern,
            "matches": self.matches,
            "partial_fused": self.partial,
            "matches_checkpoint_names_only": self.checkpoint_matches,
            "lost_after_engine_rewrite": self.after_rewrite_lost,
            "matches_with_vlm_prefix": self.vlm_alias,
        }


def engine_prefixes(census: Census) -> list[str]:
    """Every prefix the engine asks about: fused names, MoE layer names, the rest as stored."""
    seen: dict[str, None] = {}
    for m in census.modules.values():
        if m.kind is not Kind.OTHER:
            seen.setdefault(m.engine_name)
    return list(seen)


def _matches(entries: list[str], prefixes: list[str], rules: str = "modelopt") -> tuple[list[str], list[str]]:
    hit, partial = [], []
    for p in _candidates(entries, prefixes):
        try:
            if is_excluded(p, entries, rules):
                hit.append(p)
        except PartialFusedExclusion:
            partial.append(p)
    return hit, partial


def _candidates(entries: list[str], prefixes: list[str]) -> list[str]:
    """The prefixes ``is_excluded`` may say yes, or half, to (in order; a superset, found at C speed: a
    large MoE checkpoint's 63 patterns met 246 prefixes one call at a time). Without a wildcard (fnmatch's
    ``*?[``) an entry ``e`` can only be the prefix (exact, or fnmatch of a literal), a part of it (the legacy
    substring rule), a fused prefix's shard (``e``'s parent then within the prefix) or hold it (an MoE
    layer's); with one, or with no dot (no parent to look for), every prefix is a candidate."""
    keys = []
    for e in entries:
        parent = e.rpartition(".")[0]
        if not parent or not _WILDCARDS.isdisjoint(e):
            return prefixes
        keys.append((e, parent))
    if len(keys) == 1:
        e, parent = keys[0]
        return [p for p in prefixes if p in e or parent in p]
    return [p for p in prefixes if any(p in e or parent in p for e, parent in keys)]


def pattern_reports(entries: list[str], census: Census, rules: str = "modelopt") -> list[PatternReport]:
    prefixes = engine_prefixes(census)
    checkpoint_names = [m.name for m in census.modules.values() if m.kind is not Kind.OTHER]
    reports = []
    for entry in entries:
        r = PatternReport(entry)
        r.matches, r.partial = _matches([entry], prefixes, rules)
        if not r.matches and not r.partial:
            r.checkpoint_matches = [n for n in checkpoint_names if fnmatchcase(n, entry) or n == entry]
            r.vlm_alias = _vlm_alias(entry, prefixes)
        rewritten = engine_rewrite(entry) if rules == "modelopt" else [entry]
        if rewritten != [entry]:
            after, _ = _matches(rewritten, prefixes)
            r.after_rewrite_lost = [p for p in r.matches if p not in after]
        reports.append(r)
    return reports


def _vlm_alias(entry: str, prefixes: list[str]) -> str | None:
    for old, new in VLM_PREFIX_ALIASES:
        if entry.startswith(old):
            alias = new + entry[len(old):]
            hit, partial = _matches([alias], prefixes)
            if hit or partial:
                return alias
    return None


@dataclass
class ExclusionRewrite:
    entries: list[str]
    changes: list[tuple[str, str, str]]  # (finding code, entry or prefix, what was done)
    impossible: list[str]  # prefixes whose storage no exclusion list can express


def reconcile_exclusions(entries: list[str], census: Census) -> ExclusionRewrite:
    """The exclusion list every engine reads the same way and that matches what is stored
    (SEMANTICS §11.3): the stored tensors are the truth.

    Original entries stay (in order) when they match something, match only modules stored
    unquantized, half-exclude no fused group and mean the same after the engine's ``p*`` rewrite;
    every module stored unquantized that is then still not excluded gets its explicit name(s)."""
    prefixes = engine_prefixes(census)
    by_engine: dict[str, list] = {}
    for m in census.modules.values():
        if m.kind is not Kind.OTHER:
            by_engine.setdefault(m.engine_name, []).append(m)
    unquantized = {p for p in prefixes if all(m.scheme is None for m in by_engine[p])}
    changes: list[tuple[str, str, str]] = []
    keep: list[str] = []
    for r in pattern_reports(list(dict.fromkeys(entries)), census):
        if not r.matches and not r.partial:
            code = "EXC006" if r.vlm_alias else "EXC001"
            changes.append((code, r.pattern, "dropped: it matches no module the engine asks about"))
        elif r.partial:
            changes.append(("EXC002", r.pattern, f"dropped: it excludes only part of {_short(r.partial)}"))
        elif r.after_rewrite_lost:
            changes.append(("EXC005", r.pattern, "replaced by explicit names: the engine's p* rewrite changes "
                            "what it matches"))
        elif quantized := [p for p in r.matches if p not in unquantized]:
            changes.append(("EXC003", r.pattern, f"dropped: it excludes {_short(quantized)}, stored quantized"))
        else:
            keep.append(r.pattern)
    if len(keep) + len(changes) < len(entries):
        changes.append(("CFG004", "exclude_modules", "repeated entries removed"))
    covered = set(_matches(keep, prefixes)[0]) if keep else set()
    added = []
    for p in sorted(unquantized - covered, key=_natural_key):
        head, _, last = p.rpartition(".")
        names = [f"{head}.{s}" if head else s for s in FUSED_GROUPS[last]] if last in FUSED_GROUPS else [p]
        added += names
        changes.append(("EXC004", p, "added: stored unquantized"))
    final = keep + [n for n in dict.fromkeys(added) if n not in keep]
    # An explicit name can still over-reach through the engine's substring rule; such storage cannot
    # be described by any list, and the caller refuses to repair it.
    hit, partial = _matches(final, prefixes)
    impossible = sorted((set(hit) ^ unquantized) | set(partial), key=_natural_key)
    return ExclusionRewrite(final, changes, impossible)


def _short(items: list[str], n: int = 2) -> str:
    return ", ".join(items[:n]) + (f" (+{len(items) - n})" if len(items) > n else "")


def _natural_key(name: str) -> list:
    import re

    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
