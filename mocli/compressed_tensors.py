"""compressed-tensors (llm-compressor) quantization configs, read as vLLM 0.33 reads them (SEMANTICS §17).

``config_groups`` map targets to a scheme each; a group's weights (and input activations) name the stored
scheme: float 4-bit tensor_group 16 is NVFP4 (W4A16_NVFP4 without input activations), float 8-bit is FP8
per tensor, per channel or in 128x128 blocks. A module's scheme is the first target that names it (exact, or
``re:`` matched from the start), else a class-name target (``Linear``: every linear, routed experts
included); ``ignore`` entries match the same way, on the module's name or its fused layer's (§17.4). A
later group's repeated target overrides the earlier one's (the engine's map is built in order).

Patterns come from files mocli does not control: ``re:`` ones run with a time limit under the ``regex`` module,
the one vLLM 0.33 matches with (``utils/config_utils.py``: ``import regex as re``), so a pathological pattern is
named (CFG008), never hangs; mocli.ct_patterns judges them under Python's ``re`` as well (CFG009).
"""

from __future__ import annotations

from typing import Any

from mocli.ct_schemes import attention_only, group_algo, group_targets, kv_algo
from mocli.exclusions import PatternReport
from mocli.findings import Findings
from mocli.quant_config import GROUP_SIZES, Algo, QuantConfig
from mocli.tables import SHARD_TO_FUSED

METHOD = "compressed-tensors"
REGEX_SECONDS = 0.05  # per match: a module name is short; longer means catastrophic backtracking
_LINEAR_CLASSES = ("linear", "routedexperts", "fusedmoe")


class PatternTimeout(ValueError):
    """A ``re:`` pattern that took longer than ``REGEX_SECONDS`` on a module name."""


def matches(pattern: str, name: str) -> bool:
    """compressed-tensors' rule: equal, or ``re:`` + ``re.match`` (anchored at the start, not the end)."""
    if not pattern.startswith("re:"):
        return pattern == name
    import regex  # only for ``re:`` patterns (6 ms of every command's start otherwise)

    try:
        return regex.match(pattern[3:], name, timeout=REGEX_SECONDS) is not None
    except TimeoutError:
        raise PatternTimeout(f"pattern {pattern!r} took over {REGEX_SECONDS} s on {name!r}") from None
    except regex.error as e:
        raise PatternTimeout(f"pattern {pattern!r} is not a regular expression ({e})") from None


def _container(module: str) -> str:
    """An expert projection's FusedMoE layer (``<layer>.experts.<e>.<proj>`` -> ``<layer>.experts``), else ""."""
    parts = module.rsplit(".", 2)
    return parts[0] if len(parts) == 3 and parts[1].isdigit() and parts[0].endswith(".experts") else ""


class Resolver:
    """A module's configured algorithm under compressed-tensors' matching (None: ignored or untargeted).

    A ``re:`` pattern that times out or does not compile is reported once (CFG008) and matches nothing
    from then on; answers are cached, so ``prime`` at open time does every match once."""

    def __init__(self, targets: dict[str, Algo], ignore: list[str], findings: Findings, where: str,
                 origins: dict[str, str] | None = None) -> None:
        self.targets, self.ignore = targets, ignore
        self.findings, self.where = findings, where
        self.origins = origins or {}  # pattern -> the list that holds it ("ignore", "config_groups.g.targets")
        self.broken: set[str] = set()
        self._cache: dict[str, Algo | None] = {}

    def names(self, module: str) -> list[str]:
        """The names the engine asks with for this module: its fused layer's and its own; an expert's
        MoE layer's and its own."""
        parent, _, last = module.rpartition(".")
        if container := _container(module):
            return [container, module]
        if last in SHARD_TO_FUSED:
            return [f"{parent}.{SHARD_TO_FUSED[last]}", module]
        return [module]

    def prime(self, modules, findings: Findings, re_seconds: float | None = None) -> None:
        """Match every module once (CFG008 under the engine's matcher), then judge the ``re:`` patterns
        under Python's ``re`` on the same names (CFG009, mocli.ct_patterns)."""
        self.findings = findings
        modules = sorted(modules)
        for m in modules:
            self(m)
        self._check_python_re(modules, findings, re_seconds)

    def _check_python_re(self, modules: list[str], findings: Findings, seconds: float | None) -> None:
        from mocli import ct_patterns

        patterns = [p for p in (*self.ignore, *self.targets) if p.startswith("re:") and p not in self.broken]
        if not patterns:
            return
        names = sorted({n for m in modules for n in self.names(m)})
        limit = ct_patterns.RE_SECONDS if seconds is None else seconds
        for slow in ct_patterns.slow_under_re(patterns, names, limit):
            how = (f"ran past {limit} s under Python's re on {slow.name!r} ({slow.reason})" if slow.name
                   else f"is {slow.reason}")
            findings.add("CFG009", f"{self.where}: {self.origins.get(slow.pattern, 'targets')}",
                         f"pattern {slow.pattern!r} {how}: vLLM 0.33 matches it with the regex module and is "
                         "unaffected; SGLang and compressed-tensors' own matcher run Python's re",
                         hint="write exact module names, or a re: pattern without a quantified group that holds "
                              "another quantifier, an alternation or a back-reference")

    def _match(self, pattern: str, names: list[str]) -> bool:
        if pattern in self.broken:
            return False
        try:
            return any(matches(pattern, n) for n in names)
        except PatternTimeout as e:
            self.broken.add(pattern)
            self.findings.add("CFG008", f"{self.where}: {self.origins.get(pattern, 'targets')}",
                              f"{e}; it is treated as matching nothing",
                              hint="write an exact module name or a simple re: prefix pattern")
            return False

    def __call__(self, module: str) -> Algo | None:
        if module not in self._cache:
            self._cache[module] = self._resolve(module)
        return self._cache[module]

    def _resolve(self, module: str) -> Algo | None:
        names = self.names(module)
        if any(self._match(p, names) for p in self.ignore):
            return None
        for target, algo in self.targets.items():
            if self._match(target, names):
                return algo
        for target, algo in self.targets.items():  # class names: "Linear" is every linear layer and routed experts
            if not target.startswith("re:") and target.lower() in _LINEAR_CLASSES:
                return algo
        return None


def parse(q: dict[str, Any], where: str, findings: Findings) -> QuantConfig:
    """``config.json["quantization_config"]`` with ``quant_method: compressed-tensors``."""
    cfg = QuantConfig(origin="config.json", method=METHOD, producer=_producer(q))
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        findings.add("CFG001", where, "compressed-tensors config has no config_groups")
        return cfg
    targets: dict[str, Algo] = {}
    origins: dict[str, str] = {}
    for gname, group in groups.items():
        gwhere = f"{where}: config_groups.{gname}"
        names = group_targets(group, gwhere, findings)
        if names is None or attention_only(names):
            continue
        algo = group_algo(group, q.get("format"), gwhere, findings)
        if algo is not None:
            for t in names:
                targets[t] = algo  # a later group's repeated target overrides the earlier one's
                origins[t] = f"config_groups.{gname}.targets"
    ignore = q.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        findings.add("CFG002", where, "ignore must be a list of strings")
        ignore = []
    algos = set(targets.values())
    cfg.algo = algos.pop() if len(algos) == 1 else Algo.MIXED_PRECISION if algos else None
    origins |= {p: "ignore" for p in ignore}
    cfg.resolver = Resolver(targets, ignore, findings, where, origins)
    cfg.kv_cache_algo = kv_algo(q.get("kv_cache_scheme"), where, findings)
    cfg.weight_only = all(isinstance(g, dict) and g.get("input_activations") is None for g in groups.values())
    cfg.group_size = GROUP_SIZES.get(cfg.algo) if cfg.algo is not None else None
    return cfg


def _producer(q: dict) -> dict[str, Any]:
    return {"name": "compressed-tensors", "version": q.get("version")}


def ignore_reports(resolver: Resolver, census) -> list[PatternReport]:
    """Each ``ignore`` entry with the engine names it reaches under compressed-tensors' rules (inspect, EXC001)."""
    from mocli.census import Kind

    reports = [PatternReport(p) for p in resolver.ignore]
    for m in census.modules.values():
        if m.kind is Kind.OTHER:
            continue
        names = resolver.names(m.name)
        for r in reports:
            if m.engine_name not in r.matches and resolver._match(r.pattern, names):
                r.matches.append(m.engine_name)
    return reports


def check_ignore(resolver: Resolver, census, findings: Findings) -> None:
    """EXC001: an ``ignore`` entry that reaches no module (a ModelOpt-style ``*`` or substring entry copied
    over matches nothing under these rules, §17.4); EXC002: a fused layer whose shards resolve to different
    schemes, which vLLM refuses ("Found different quantization schemes for the shards")."""
    for r in ignore_reports(resolver, census):
        if not r.matches and r.pattern not in resolver.broken:  # a broken one is CFG008's
            hint = ("compressed-tensors matches exact names or re: patterns, not wildcards or substrings"
                    if "*" in r.pattern or "re:" not in r.pattern else "check the pattern against the tensor names")
            key = "exclude" if resolver.origins.get(r.pattern) == "exclude" else "ignore"  # Quark's list is exclude
            findings.add("EXC001", f"{key}: {r.pattern}", "pattern matches no module", hint=hint)
    for g in census.fused:
        algos = {m.name.rpartition(".")[2]: resolver(m.name) for m in g.shards}
        if len(set(algos.values())) > 1:
            findings.add("EXC002", g.name, "its shards resolve to different schemes: " + ", ".join(
                f"{s} {a or 'unquantized'}" for s, a in algos.items()),
                hint="vLLM refuses a fused layer whose shards differ: ignore or target all shards alike")
