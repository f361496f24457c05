"""The engine's exclusion decision, hand-worked from SEMANTICS §2."""

from __future__ import annotations

import pytest

from fixtures.generate import make_checkpoint
from mocli.census import build_census
from mocli.checkpoint import open_checkpoint
from mocli.exclusions import PartialFusedExclusion, engine_rewrite, is_excluded, pattern_reports

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
