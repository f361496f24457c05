"""The engine's exclusion decision, hand-worked from SEMANTICS §2."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fixtures.generate import make_checkpoint
from mocli.census import build_census
from mocli.checkpoint import open_checkpoint
from mocli.exclusions import PartialFusedExclusion, _matches, engine_rewrite, is_excluded, pattern_reports

L0 = "model.layers.0"


def test_empty_list_excludes_nothing():
    assert not is_excluded(f"{L0}.self_attn.qkv_proj", [])


def test_fused_needs_every_shard():
    shards = [f"{L0}.self_attn.{s}_proj" for s in "qkv"]
    assert is_excluded(f"{L0}.self_attn.qkv_proj", shards)
    with pytest.raises(PartialFusedExclusion) as e:
        is_excluded(f"{L0}.self_attn.qkv_proj", shards[:2])
    assert e.value.kept == [shards[2]]


def test_one_expert_entry_excludes_the_whole_moe_layer():
    assert is_excluded(f"{L0}.mlp.experts", [f"{L0}.mlp.experts.3.gate_proj"])
    assert not is_excluded(f"{L0}.mlp.experts", [f"{L0}.mlp.gate"])


def test_legacy_substring_rule_and_language_model_prefix():
    # "model.layers.1" is a substring of layer 10's prefix too: the engine really does this.
    assert is_excluded("model.layers.10.mlp.down_proj", ["model.layers.1"])
    assert is_excluded("language_model.model.layers.0.mlp.down_proj", ["model.layers.0.mlp.down_proj"])


def test_fnmatch_star_crosses_dots():
    assert is_excluded(f"{L0}.self_attn.o_proj", ["model.*.o_proj"])
    assert not is_excluded(f"{L0}.mlp.experts", ["model.layers.*.mlp.experts.*"])


def test_engine_rewrite_of_trailing_star():
    assert engine_rewrite("mlp*") == ["mlp", "mlp.*"]
    assert engine_rewrite("model.layers.*") == ["model.layers.*"]
    assert engine_rewrite("lm_head") == ["lm_head"]
    # "*down*" matched down_proj; after the rewrite neither "*down" nor "*down.*" does.
    prefix = f"{L0}.mlp.down_proj"
    assert is_excluded(prefix, ["*down*"]) and not is_excluded(prefix, engine_rewrite("*down*"))
    # SEMANTICS §2's own example ("mlp*" no longer matching "mlp2") holds for fnmatch alone, but the
    # legacy substring rule (step 2) still excludes "mlp2" through the rewritten entry "mlp".
    assert is_excluded("mlp2", engine_rewrite("mlp*"))


def test_pattern_report_uses_engine_names(tmp_path):
    ck = open_checkpoint(make_checkpoint(tmp_path / "m", arch="qwen3_moe", algo="NVFP4"))
    census = build_census(ck.tensors)
    entries = ["*.q_proj", "model.layers.*.mlp.experts.*", "model.layers.0.mlp.experts.*", "model.layers.0.mlp.gate", f"{L0}.self_attn.q_proj"]
    reports = {r.pattern: r for r in pattern_reports(entries, census)}
    # q_proj only exists inside qkv_proj for the engine: the wildcard hits nothing there ...
    assert reports["*.q_proj"].matches == []
    assert "model.layers.0.self_attn.q_proj" in reports["*.q_proj"].checkpoint_matches
    # ... the MoE wildcard misses the FusedMoE prefix (no trailing dot) ...
    assert reports["model.layers.*.mlp.experts.*"].matches == []
    # ... unless the layer is spelled out: the prefix is then a substring of the entry (step 1).
    assert reports["model.layers.0.mlp.experts.*"].matches == ["model.layers.0.mlp.experts"]
    # ... an exact router entry matches exactly that router ...
    assert reports["model.layers.0.mlp.gate"].matches == ["model.layers.0.mlp.gate"]
    # ... and one shard alone half-excludes its fused group.
    assert reports[f"{L0}.self_attn.q_proj"].partial == [f"{L0}.self_attn.qkv_proj"]


def _every_prefix(entries: list[str], prefixes: list[str], rules: str) -> tuple[list[str], list[str]]:
    """``_matches`` as it was: ``is_excluded`` asked of every prefix (the reference for its candidate filter)."""
    verdicts = []  # (prefix, excluded; None where the engine refuses a half-excluded fused prefix)
    for p in prefixes:
        try:
            verdicts.append((p, is_excluded(p, entries, rules)))
        except PartialFusedExclusion:
            verdicts.append((p, None))
    return [p for p, v in verdicts if v], [p for p, v in verdicts if v is None]


_NAME = st.lists(st.sampled_from(["model", "language_model", "layers", "0", "1", "self_attn", "qkv_proj", "q_proj",
                                  "k_proj", "v_proj", "mlp", "gate", "experts", "gate_up_proj", "gate_proj", "up_proj",
                                  "lm_head", "*", "q*", "layers.1", "[01]", "?"]), min_size=1, max_size=5).map(".".join)


@settings(max_examples=1500, deadline=None)
@given(st.lists(_NAME, max_size=3), st.lists(_NAME, min_size=1, max_size=12), st.sampled_from(["modelopt", "fp8"]))
def test_candidate_filter_keeps_every_match(entries, prefixes, rules):
    # and the prefixes an entry is most likely to meet: itself within a longer name, its fused siblings' group,
    # a name within it (an MoE layer's)
    for e in entries:
        parent = e.rpartition(".")[0]
        prefixes = [*prefixes, f"language_model.{e}", f"{e}.experts", f"{parent}.qkv_proj", f"{parent}.gate_up_proj",
                    parent, parent.rpartition(".")[0]]
    assert _matches(entries, prefixes, rules) == _every_prefix(entries, prefixes, rules)


def test_candidate_filter_on_the_cases_it_must_keep():
    prefixes = [f"{L0}.self_attn.qkv_proj", f"{L0}.mlp.experts", f"language_model.{L0}.mlp.gate", f"{L0}.mlp.gate",
                "lm_head", f"{L0}.self_attn.o_proj"]
    cases = {f"{L0}.self_attn.q_proj": ([], [f"{L0}.self_attn.qkv_proj"]),  # a shard: its fused prefix half-excluded
             f"{L0}.mlp.experts.3.up_proj": ([f"{L0}.mlp.experts"], []),  # the MoE layer by substring
             f"{L0}.mlp.gate": ([f"language_model.{L0}.mlp.gate", f"{L0}.mlp.gate"], []),  # legacy substring, exact
             "lm_head": (["lm_head"], []), f"{L0}.self_attn": ([f"{L0}.self_attn.qkv_proj", f"{L0}.self_attn.o_proj"], [])}
    for entry, want in cases.items():
        assert _matches([entry], prefixes) == want == _every_prefix([entry], prefixes, "modelopt"), entry
