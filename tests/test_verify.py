"""verify: passes untouched conversions and fails on every planted fault class (mutation suite)."""

from __future__ import annotations

import html
import json
import shutil
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from fixtures.generate import make_checkpoint
from mocli.kinds import ModuleKind
from mocli.loader import load_converted
from mocli.numerics.in_torch import e2m1_round, nvfp4_quant
from mocli.verify import THRESHOLDS
from mocli.verify.flashinfer_args import cutlass_fused_moe_fp8_args, cutlass_fused_moe_nvfp4_args, mm_fp4_args
from tests import reference as ref
from tests.conftest import REAL_LLAMA, REAL_QWEN

CUTLASS, TRTLLM = "flashinfer-cutlass", "flashinfer-trtllm"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """One conversion per (source, target), made once; tests mutate copies."""
    from tests.conftest import run_cli

    base = tmp_path_factory.mktemp("conv")
    sources = {
        "qwen": REAL_QWEN,
        "llama": REAL_LLAMA,
        "mixtral": make_checkpoint(base / "mixtral-src", arch="mixtral", algo="FP8"),
        "padded": make_checkpoint(base / "padded-src", algo="NVFP4", heads=1, kv_heads=1, head_dim=48),
    }
    made = {}
    for key, src in sources.items():
        for target in (CUTLASS,) if key == "padded" else (CUTLASS, TRTLLM):  # N = 48: cutlass pads, trtllm refuses
            out = base / f"{key}-{target}"
            assert run_cli("-q", "convert", src, "-o", out, "--target", target).exit_code == 0
            made[key, target] = out
    return made


def _copy(converted, key, target, tmp_path):
    dst = tmp_path / "o"
    shutil.copytree(converted[key, target], dst)
    return dst


def _mutate(out, fn: Callable[[dict[str, torch.Tensor]], bool]) -> None:
    hit = False
    for f in sorted(out.glob("model-*.safetensors")):
        t = load_file(str(f))
        if fn(t):
            save_file(t, str(f), metadata={"format": "pt"})
            hit = True
    assert hit, "mutation touched nothing"


def _verify(cli, out, *args):
    r = cli("--json", "verify", out, *args)
    assert r.exit_code in (0, 1), r.stderr
    return r.exit_code, {m["module"]: m for m in r.json["modules"]}


# --- untouched outputs pass -------------------------------------------------------------------------

@pytest.mark.parametrize("key,target", [(k, t) for k in ("qwen", "llama", "mixtral") for t in (CUTLASS, TRTLLM)]
                         + [("padded", CUTLASS)])
def test_untouched_conversion_passes(cli, converted, key, target):
    code, mods = _verify(cli, converted[key, target])
    assert code == 0, {k: (m["error"], m["message"]) for k, m in mods.items() if not m["passed"]}
    assert mods and all(m["passed"] and m["error"] < m["threshold"] for m in mods.values())
    for m in mods.values():
        assert m["threshold"] in {v for t in THRESHOLDS.values() for v in (t.kept, t.unified, t.gemm2)}
        assert m["checks"] == {"bytes+consistency": "ok", "numeric": "ok"}
        assert m["emulated"] == ("nvfp4" in m["kind"] or m["kind"] == "fp8_block_linear")
        if m["emulated"]:
            assert "emulated" in m["kernel"]


def test_cpu_kernels_are_named(cli, converted):
    _, mods = _verify(cli, converted["mixtral", CUTLASS])
    assert mods["model.layers.0.block_sparse_moe.experts"]["kernel"] == "torch._scaled_mm per expert (CPU)"
    assert mods["model.layers.0.self_attn.qkv_proj"]["kernel"] == "torch._scaled_mm"


# --- the mutation suite ------------------------------------------------------------------------------

def _swap_experts(prefix: str):
    def fn(t):
        hit = False
        for suffix in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"):
            name = f"{prefix}.{suffix}"
            if name in t and t[name].dim() == 3:
                w = t[name].clone()
                w[[0, 1]] = w[[1, 0]]
                t[name] = w
                hit = True
        return hit
    return fn


def _scale(name: str, factor: float):
    def fn(t):
        if name not in t:
            return False
        t[name] = t[name] * factor
        return True
    return fn


def _unswizzle_scales(name: str, rows: int, cols: int, twice: bool = False):
    def fn(t):
        if name not in t:
            return False
        s = t[name]
        def one(x):
            if twice:
                return ref.swizzle_by_offsets(x).view(torch.float8_e4m3fn)
            plain = ref.unswizzle_by_offsets(x, rows, cols)
            out = torch.zeros_like(x.view(torch.uint8))
            out[:rows, :cols] = plain
            return out.view(torch.float8_e4m3fn)
        t[name] = torch.stack([one(x) for x in s]) if s.dim() == 3 else one(s)
        return True
    return fn


def _dirty_padding(name: str, rows: int | None = None, cols: int | None = None):
    def fn(t):
        if name not in t:
            return False
        w = t[name].clone()
        raw = w.view(torch.uint8)
        if rows is not None:
            raw[rows:] = 0x11
        if cols is not None:
            raw[:, cols:] = 0x11
        t[name] = w
        return True
    return fn


def _other_layer(name: str, other: str):
    def fn(t):
        if name not in t:
            return False
        t[name] = t[other].clone()
        return True
    return fn


Q0 = "model.layers.0.mlp.experts"
M0 = "model.layers.0.block_sparse_moe.experts"
MUTATIONS = {
    # w1/w3 halves swapped: [w1; w3] written instead of [w3; w1] (SEMANTICS §4: GSM8K 0%)
    # rows 0..127 of the 128x4-swizzled scales are exactly the first 128 logical rows (one tile)
    "nvfp4 moe w1/w3 swapped": ("qwen", CUTLASS, Q0, [lambda t: _swap_rows(t, f"{Q0}.w13_weight", 128)
                                                       and _swap_rows(t, f"{Q0}.w13_weight_scale", 128)]),
    "fp8 moe w1/w3 swapped": ("mixtral", CUTLASS, M0, [lambda t: _swap_rows(t, f"{M0}.w13_weight", 128)]),
    "nvfp4 moe experts exchanged": ("qwen", CUTLASS, Q0, [_swap_experts(Q0)]),
    "fp8 moe experts exchanged (trtllm)": ("mixtral", TRTLLM, M0, [_swap_experts(M0)]),
    "nvfp4 moe block scales unswizzled": ("qwen", CUTLASS, Q0, [_unswizzle_scales(f"{Q0}.w13_weight_scale", 256, 16)]),
    "nvfp4 moe block scales swizzled twice": ("qwen", TRTLLM, Q0,
                                              [_unswizzle_scales(f"{Q0}.w2_weight_scale", 256, 8, twice=True)]),
    "nvfp4 dense block scales unswizzled": ("qwen", CUTLASS, "model.layers.1.self_attn.qkv_proj",
                                            [_unswizzle_scales("model.layers.1.self_attn.qkv_proj.weight_scale",
                                                               512, 16)]),
    "nvfp4 moe g1_alphas x2": ("qwen", CUTLASS, Q0, [_scale(f"{Q0}.g1_alphas", 2.0)]),
    "fp8 moe g2_alphas x2": ("mixtral", TRTLLM, M0, [_scale(f"{M0}.g2_alphas", 2.0)]),
    "nvfp4 dense alpha x2": ("qwen", TRTLLM, "model.layers.0.self_attn.o_proj",
                             [_scale("model.layers.0.self_attn.o_proj.alpha", 2.0)]),
    "fp8 dense weight_scale x2": ("llama", CUTLASS, "model.layers.1.mlp.gate_up_proj",
                                  [_scale("model.layers.1.mlp.gate_up_proj.weight_scale", 2.0)]),
    "fp8 dense input_scale x0.5": ("llama", TRTLLM, "model.layers.0.self_attn.qkv_proj",
                                   [_scale("model.layers.0.self_attn.qkv_proj.input_scale", 0.5)]),
    "nvfp4 padded weight columns not zero": ("padded", CUTLASS, "model.layers.0.self_attn.o_proj",
                                             [_dirty_padding("model.layers.0.self_attn.o_proj.weight", cols=24)]),
    "nvfp4 padded weight rows not zero": ("padded", CUTLASS, "model.layers.1.self_attn.qkv_proj",
                                          [_dirty_padding("model.layers.1.self_attn.qkv_proj.weight", rows=144)]),
    "nvfp4 swizzle padding not zero": ("padded", CUTLASS, "model.layers.0.self_attn.qkv_proj",
                                       [_dirty_padding("model.layers.0.self_attn.qkv_proj.weight_scale", rows=144)]),
    "fp8 dense shard from another layer": ("llama", CUTLASS, "model.layers.0.self_attn.qkv_proj",
                                           [_other_layer("model.layers.0.self_attn.qkv_proj.weight",
                                                         "model.layers.1.self_attn.qkv_proj.weight")]),
    "nvfp4 moe w2 from another layer": ("qwen", TRTLLM, Q0, [_other_layer(f"{Q0}.w2_weight",
                                                                         "model.layers.1.mlp.experts.w2_weight")]),
}


def _swap_rows(t, name, half):
    if name not in t:
        return False
    w = t[name]
    t[name] = torch.cat([w[:, half:], w[:, :half]], dim=1).contiguous()
    return True


@pytest.mark.parametrize("fault", sorted(MUTATIONS))
def test_verify_fails_on_planted_fault(cli, converted, tmp_path, fault):
    key, target, module, mutations = MUTATIONS[fault]
    out = _copy(converted, key, target, tmp_path)
    for m in mutations:
        _mutate(out, m)
    code, mods = _verify(cli, out)
    assert code == 1
    assert not mods[module]["passed"], mods[module]
    others = [m for name, m in mods.items() if name != module and not m["passed"]]
    assert not others, "the fault should be pinned to its module"


def _flip_expert_byte(name: str, expert: int):
    def fn(t):
        if name not in t:
            return False
        w = t[name].clone()
        w[expert].view(torch.uint8).view(-1)[7] ^= 0x01
        t[name] = w
        return True
    return fn


def _force_stacked(monkeypatch, chunk_bytes: int | None = None) -> list:
    """Verify's stacked expert-bytes check of FP8 experts (CUDA's path) on the CPU too; returns the list
    of experts the expert-by-expert check was then called for."""
    from mocli.verify.kinds import fp8_moe

    calls = []
    monkeypatch.setattr(fp8_moe, "STACKED_BYTES_ON", ("cpu", "cuda"))
    if chunk_bytes is not None:
        monkeypatch.setattr(fp8_moe, "STACKED_BYTES", chunk_bytes)
    cls = fp8_moe.Fp8Moe
    monkeypatch.setattr(cls, "expert_bytes", lambda self, *a, _f=cls.expert_bytes: calls.append(a[1]) or _f(self, *a))
    return calls


@pytest.mark.parametrize("key,target,tensor,chunk", [("mixtral", CUTLASS, "w13_weight", 1),
                                                     ("mixtral", TRTLLM, "w2_weight", None),
                                                     ("mixtral", CUTLASS, "w2_weight", None),
                                                     ("mixtral", TRTLLM, "w13_weight", 1)])
def test_stacked_expert_bytes_check_agrees_with_expert_by_expert(cli, converted, tmp_path, monkeypatch, key, target,
                                                                  tensor, chunk):
    """The stacked bytes check (CUDA's path, forced here on the CPU; chunk 1: one expert per stack) passes
    an intact layer without going expert by expert, and one flipped bit in one expert still fails the
    layer, named as the expert by expert check names it (the numerics alone would not see one bit)."""
    calls = _force_stacked(monkeypatch, chunk)
    code, _ = _verify(cli, converted[key, target])
    assert code == 0 and not calls
    out = _copy(converted, key, target, tmp_path)
    layer = Q0 if key == "qwen" else M0
    _mutate(out, _flip_expert_byte(f"{layer}.{tensor}", 1))
    code, mods = _verify(cli, out)
    assert code == 1 and f"{tensor} (expert 1) differs" in mods[layer]["message"], mods[layer]
    assert calls


@pytest.mark.parametrize("par,expert", [(["--tp", "2"], 1), (["--tp", "2", "--ep", "2"], None)])  # None: expert parallel
def test_stacked_expert_bytes_check_per_rank(cli, tmp_path, monkeypatch, par, expert):
    """Tensor- and expert-parallel outputs through the stacked check: every rank's slice of every expert
    matches without the expert-by-expert path; a flipped bit in rank 1's local expert 1 fails rank 1
    only, named by its global index."""
    calls = _force_stacked(monkeypatch)
    out = tmp_path / "o"
    src = make_checkpoint(tmp_path / "src", arch="mixtral", algo="FP8")
    assert cli("-q", "convert", src, "-o", out, "--target", TRTLLM, *par).exit_code == 0
    r = cli("--json", "verify", out)
    assert r.exit_code == 0 and not calls, [m["message"] for m in r.json["modules"] if not m["passed"]]
    _mutate(out / "rank-1", _flip_expert_byte(f"{M0}.w13_weight", 1))
    r = cli("--json", "verify", out)
    failed = [m for m in r.json["modules"] if not m["passed"]]
    assert r.exit_code == 1 and [(m["module"], m["rank"]) for m in failed] == [(M0, 1)], failed
    n = failed[0]["shape"]["expert_offset"] + 1 if expert is None else expert
    assert expert is not None or n > 1  # expert parallel: rank 1's local expert 1 is not global expert 1
    assert f"w13_weight (expert {n}) differs" in failed[0]["message"], failed


def test_a_layout_fault_in_the_bytes_wins_over_the_gemms(cli, converted, monkeypatch):
    """On the CPU the expert bytes are checked on a second thread beside the GEMMs. A layout fault the
    bytes find is reported as when the bytes ran first: the module is a layout failure, its numbers are
    not reported, and the fault the GEMMs hit on their own decoding comes second to it."""
    from mocli.targets.decode import LayoutError
    from mocli.verify.kinds import nvfp4_moe

    def planted(t, rows, cols, what):
        raise LayoutError(f"planted: {what}")

    monkeypatch.setattr(nvfp4_moe, "unswizzle", planted)  # the bytes' decoding and the GEMMs' both
    code, mods = _verify(cli, converted["qwen", TRTLLM])
    m = mods[Q0]
    assert code == 1 and m["kernel"] == "layout check" and m["error"] is None, m
    assert m["message"].startswith(f"planted: {Q0}.w13_weight_scale[0]"), m["message"]
    assert m["checks"]["numeric"] == "not run"
    assert [n for n, x in mods.items() if not x["passed"]] == [n for n in mods if n.endswith(".mlp.experts")]


def test_differences_found_before_a_layout_fault_are_kept(cli, converted, tmp_path, monkeypatch):
    """A layout fault at expert 1 stops that layer's byte checks; what they found before it (a flipped
    byte in expert 0) is still reported, after the fault, and nothing after it (a flipped byte in the
    last expert)."""
    from mocli.targets.decode import LayoutError
    from mocli.verify.kinds import nvfp4_moe

    real = nvfp4_moe.unswizzle

    def planted(t, rows, cols, what):
        if what.endswith("w13_weight_scale[1]"):
            raise LayoutError(f"planted: {what}")
        return real(t, rows, cols, what)

    out = _copy(converted, "qwen", TRTLLM, tmp_path)
    _mutate(out, _flip_expert_byte(f"{Q0}.w13_weight", 0))
    _mutate(out, _flip_expert_byte(f"{Q0}.w13_weight", -1))
    monkeypatch.setattr(nvfp4_moe, "unswizzle", planted)
    code, mods = _verify(cli, out)
    m = mods[Q0]
    assert code == 1 and m["kernel"] == "layout check", m
    assert m["message"].startswith(f"planted: {Q0}.w13_weight_scale[1]"), m["message"]
    assert "w13_weight (expert 0) differs from the source" in m["message"], m["message"]
    assert m["message"].count("differs from the source") == 1, m["message"]


# --- CLI behaviour ----------------------------------------------------------------------------------

def test_nvfp4_checks_run_on_the_cpu_and_say_so(cli, converted, monkeypatch):
    """NVFP4 checks run in numpy: where a GPU was asked for (or auto found one) the report says the
    checks ran on the CPU instead, and why; --device cuda on a machine without one is still refused."""
    from mocli.verify import modules, runner

    out = converted["qwen", TRTLLM]
    if not torch.cuda.is_available():
        r = cli("verify", out, "--device", "cuda")
        assert r.exit_code == 2 and "no CUDA device" in r.stderr, r.stderr
    monkeypatch.setattr(runner, "requested_device", lambda device: "cuda:0")
    monkeypatch.setattr(modules, "check_device", lambda device: None)
    r = cli("--json", "verify", out)
    assert r.exit_code == 0 and r.json["device"] == "cpu" and r.json["device_requested"] == "cuda:0"
    r = cli("verify", out)
    assert r.exit_code == 0 and "ran on cpu, not cuda:0: NVFP4 checks" in " ".join(r.stdout.split())
    monkeypatch.setattr(runner, "requested_device", lambda device: "cpu")
    r = cli("--json", "verify", out)
    assert r.exit_code == 0 and "device_requested" not in r.json


def test_junit_xml_and_human_output(cli, converted, tmp_path):
    xml_path = tmp_path / "verify.xml"
    r = cli("verify", converted["qwen", CUTLASS], "--junit-xml", xml_path)
    assert r.exit_code == 0 and "6 module check(s) passed, 0 failed" in r.stdout and "emulated" in r.stdout
    suite = ET.parse(xml_path).getroot()
    assert suite.get("tests") == "6" and suite.get("failures") == "0"
    assert {c.get("name") for c in suite.iter("testcase")} >= {"model.layers.0.mlp.experts"}


def test_junit_records_failures(cli, converted, tmp_path):
    out = _copy(converted, "llama", CUTLASS, tmp_path)
    _mutate(out, _scale("model.layers.1.mlp.gate_up_proj.weight_scale", 2.0))
    r = cli("verify", out, "--junit-xml", tmp_path / "v.xml")
    assert r.exit_code == 1 and "FAILED" in r.stdout
    failures = ET.parse(tmp_path / "v.xml").getroot().findall(".//failure")
    # the module's scale check, and the shard whose digest no longer matches the manifest
    messages = sorted(f.get("message") for f in failures)
    assert len(messages) == 2 and any(m.startswith("xxh3_128 digest differs") for m in messages) \
        and any("weight_scale" in m for m in messages)


def test_html_report_says_why_a_cell_failed(cli, converted, tmp_path):
    out = _copy(converted, "qwen", CUTLASS, tmp_path)
    _mutate(out, _scale("model.layers.0.self_attn.qkv_proj.alpha", 2.0))
    r = cli("--json", "verify", out, "--report", tmp_path / "v.html")
    assert r.exit_code == 1
    message = next(m["message"] for m in r.json["modules"] if not m["passed"])
    page = (tmp_path / "v.html").read_text()
    assert "FAIL: " in page and ">0.00<" not in page.split("FAIL: ")[0][-40:]
    problems = page.split("<h2>problems</h2>")[1]
    assert "model.layers.0.self_attn.qkv_proj" in problems and html.escape(message[:40]) in problems
    assert page.count('Kernels named "emulated"') == 1 and "<i>emulated</i>" not in page


def test_layers_filter_tokens_seed(cli, converted):
    r = cli("--json", "verify", converted["qwen", TRTLLM], "--layers", "*layers.1.mlp*", "--tokens", "8",
            "--seed", "3")
    assert r.exit_code == 0
    assert [m["module"] for m in r.json["modules"]] == ["model.layers.1.mlp.experts"]
    assert r.json["tokens"] == 8 and r.json["seed"] == 3
    r = cli("verify", converted["qwen", TRTLLM], "--layers", "nothing*")
    assert r.exit_code == 2 and "matches no converted module" in r.stderr


def test_not_a_converted_directory(cli):
    r = cli("verify", REAL_QWEN)
    assert r.exit_code == 2 and "not a mocli-converted" in r.stderr


@pytest.mark.slow
def test_changed_source_is_refused(cli, tmp_path, real_copy):
    src = real_copy("llama-fp8_kv")
    out = tmp_path / "o"
    assert cli("-q", "convert", src, "-o", out, "--target", CUTLASS).exit_code == 0
    assert cli("-q", "verify", out).exit_code == 0
    with open(src / "model.safetensors", "r+b") as f:  # flip one byte of tensor data
        f.seek(-1, 2)
        b = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([b[0] ^ 1]))
    r = cli("verify", out)
    assert r.exit_code == 2 and "no longer matches" in r.stderr
    r = cli("verify", out, "--source", REAL_LLAMA)  # an unchanged copy is accepted
    assert r.exit_code == 0


def test_flashinfer_kernels_need_gpu(cli, converted):
    if torch.cuda.is_available():
        pytest.skip("GPU present")
    r = cli("verify", converted["qwen", CUTLASS], "--kernels", "flashinfer")
    assert r.exit_code == 2 and "CUDA" in r.stderr
    r = cli("verify", converted["qwen", CUTLASS], "--device", "cuda")
    assert r.exit_code == 2


# --- FlashInfer call contracts (SEMANTICS §4, §7, §9): arguments only, no kernel here ---------------

def test_cutlass_fused_moe_fp8_arguments(converted):
    ck = load_converted(converted["mixtral", CUTLASS])
    mod = ck.modules[M0]
    x = torch.randn(5, mod.hidden)
    ids, w = torch.randint(0, 4, (5, 2)), torch.rand(5, 2)
    a = cutlass_fused_moe_fp8_args(mod, x, ids, w)
    assert a["input"].dtype == torch.float8_e4m3fn
    assert torch.equal(a["input"].view(torch.uint8),
                       (x / mod.w13_input_scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))
    assert a["token_selected_experts"].dtype == torch.int32 and a["token_final_scales"].dtype == torch.float32
    g1, a2_inv, g2, a1 = a["quant_scales"]
    assert g1.shape == (4,) and torch.allclose(g1, mod.w13_weight_scale * mod.w13_input_scale)  # a1 folded in
    assert a2_inv.dim() == 0 and torch.isclose(a2_inv, 1 / mod.w2_input_scale)
    assert torch.allclose(g2, mod.w2_weight_scale * mod.w2_input_scale) and a1.dim() == 0
    assert a["fc1_expert_weights"].shape == (4, 2 * mod.intermediate, mod.hidden)


def test_cutlass_fused_moe_nvfp4_and_mm_fp4_arguments(converted):
    ck = load_converted(converted["qwen", CUTLASS])
    mod = ck.modules[Q0]
    a = cutlass_fused_moe_nvfp4_args(mod, torch.zeros(3, 128, dtype=torch.uint8), torch.zeros(3, 16),
                                     torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2))
    assert a["fc1_expert_weights"].dtype == torch.long and a["fc1_expert_weights"].shape == (8, 256, 16)
    qs = a["quant_scales"]
    assert [q.dtype for q in qs] == [torch.float32, torch.int32, torch.float32, torch.float32, torch.int32,
                                     torch.float32]
    assert torch.allclose(qs[0], 1 / mod.w13_input_scale) and torch.allclose(qs[2], mod.g1_alphas)
    lin = ck.modules["model.layers.0.self_attn.o_proj"]
    m = mm_fp4_args(lin, torch.zeros(2, 128, dtype=torch.uint8), torch.zeros(2, 16))
    assert m["b"].shape == (128, 256) and m["alpha"].shape == (1,)
    assert torch.isclose(m["alpha"][0], lin.input_scale * lin.weight_scale_2)


# --- the activation quantizer against hand values ---------------------------------------------------

def test_e2m1_round_and_nvfp4_quant_hand_values():
    assert e2m1_round(torch.tensor([0.2, 0.3, 2.4, 2.6, 5.1, 7.0, -1.3])).tolist() == [0.0, 0.5, 2.0, 3.0, 6.0,
                                                                                       6.0, -1.5]
    x = torch.tensor([[6.0] + [3.0] * 15])  # block amax 6, gs 1: sf = fp8(1.0); values exact
    assert torch.equal(nvfp4_quant(x, torch.tensor(1.0)), x)


# --- every byte it certifies (issue: verify must check every byte) ------------------------------------

def test_scale_that_no_kernel_reads_is_checked_for_consistency(cli, converted, tmp_path):
    """A doubled w13_weight_scale in an FP8 MoE output feeds no torch kernel (g1_alphas does)."""
    for target in (CUTLASS, TRTLLM):
        out = _copy(converted, "mixtral", target, tmp_path / target)
        _mutate(out, _scale(f"{M0}.w13_weight_scale", 2.0))
        code, mods = _verify(cli, out)
        assert code == 1 and "w13_weight_scale" in mods[M0]["message"], mods[M0]


def test_one_flipped_byte_fails_naming_the_file(cli, converted, tmp_path):
    out = _copy(converted, "qwen", TRTLLM, tmp_path)
    shard = next(out.glob("model-*.safetensors"))
    from mocli.io.safetensors_file import read_header

    e = read_header(shard).tensors[f"{Q0}.w13_weight_scale"]  # flip one bit of one block scale, in place
    with open(shard, "r+b") as f:
        f.seek(e.start + 1000)
        b = f.read(1)
        f.seek(e.start + 1000)
        f.write(bytes([b[0] ^ 0x01]))
    r = cli("--json", "verify", out)
    assert r.exit_code == 1
    assert [p["file"] for p in r.json["files"]["problems"]] == [shard.name]
    mods = {m["module"]: m for m in r.json["modules"]}
    assert not mods[Q0]["passed"] and "w13_weight_scale" in mods[Q0]["message"]  # and the bytes check says where


def test_flipped_passthrough_byte_is_caught(cli, converted, tmp_path):
    out = _copy(converted, "llama", CUTLASS, tmp_path)
    _mutate(out, lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"] * 2) or True)
    r = cli("--json", "verify", out)
    assert r.exit_code == 1 and [p["tensor"] for p in r.json["passthrough"]["problems"]] == ["model.norm.weight"]


def test_tensor_nothing_checks_is_a_failure(cli, converted, tmp_path):
    import json

    out = _copy(converted, "llama", CUTLASS, tmp_path)
    m = json.loads((out / "mocli-layout.json").read_text())
    m["tensors"]["lm_head.weight"]["role"] = "something"  # claimed by no module and not pass-through
    (out / "mocli-layout.json").write_text(json.dumps(m))
    r = cli("--json", "verify", out)
    assert r.exit_code == 1 and r.json["coverage"]["unchecked"] == ["lm_head.weight"]


def test_saturating_fp8_moe_intermediate_is_not_a_false_alarm(cli, tmp_path):
    """Scales that make most intermediate activations saturate are a property of the checkpoint, not a
    layout fault: GEMM2 is checked on the kernel's own quantized intermediate."""
    src = make_checkpoint(tmp_path / "src", arch="mixtral", algo="FP8")

    def tiny_a2(t):
        for k in [k for k in t if k.endswith("w2.input_scale")]:
            t[k] = torch.tensor(1e-4)
        return True

    from fixtures.generate import _edit_tensors

    _edit_tensors(src, tiny_a2)
    for target in (CUTLASS, TRTLLM):
        out = tmp_path / target
        assert cli("-q", "convert", src, "-o", out, "--target", target).exit_code == 0
        code, mods = _verify(cli, out)
        assert code == 0, {k: m["message"] for k, m in mods.items() if not m["passed"]}
        moe = mods[M0]
        assert moe["stages"]["gemm2"] < 0.01 and moe["stages"]["gemm1"] < 0.05


def test_rescaled_nvfp4_linears_get_the_honest_threshold(cli, tmp_path):
    from fixtures.generate import make_broken

    src, _ = make_broken("SCL005", tmp_path / "src")  # q/k/v and w1/w3 weight_scale_2 differ
    assert cli("-q", "convert", src, "-o", tmp_path / "o", "--target", CUTLASS).exit_code == 0
    code, mods = _verify(cli, tmp_path / "o")
    assert code == 0
    qkv, o = mods["model.layers.0.self_attn.qkv_proj"], mods["model.layers.0.self_attn.o_proj"]
    assert qkv["threshold"] == THRESHOLDS[ModuleKind.NVFP4_LINEAR].unified and o["threshold"] == THRESHOLDS[ModuleKind.NVFP4_LINEAR].kept
    assert 0.002 < qkv["error"] < THRESHOLDS[ModuleKind.NVFP4_LINEAR].unified  # one fp8 rounding of rescaled block scales


# --- per rank (SEMANTICS §10) --------------------------------------------------------------------------

@pytest.mark.parametrize("key,extra", [("llama", ["--tp", "2"]), ("qwen", ["--tp", "2"]), ("qwen", ["--ep", "2"]),
                                       ("qwen", ["--tp", "2", "--ep", "2"])])
def test_per_rank_outputs_verify_with_cross_rank_checks(cli, tmp_path, key, extra):
    src = {"llama": REAL_LLAMA, "qwen": REAL_QWEN}[key]
    out = tmp_path / "o"
    assert cli("-q", "convert", src, "-o", out, "--target", TRTLLM, *extra).exit_code == 0
    r = cli("--json", "verify", out, "--report", tmp_path / "v.html")
    assert r.exit_code == 0, [m["message"] for m in r.json["modules"] if not m["passed"]]
    assert r.json["ranks"] == [0, 1] and {m["rank"] for m in r.json["modules"]} == {0, 1}
    checks = {c["check"] for c in r.json["cross_rank"]}
    if "--tp" in extra:
        assert "column-parallel rank outputs concatenate to the full layer" in checks
        assert "row-parallel rank outputs sum to the full layer" in checks
    page = (tmp_path / "v.html").read_text()
    assert "rank 1" in page and "<script" not in page and "http" not in page.replace("http-equiv", "")
    one = cli("--json", "verify", out, "--rank", "1")
    assert one.exit_code == 0 and {m["rank"] for m in one.json["modules"]} == {1} and one.json["cross_rank"] == []


def test_wrong_rank_slice_is_caught(cli, tmp_path):
    """Rank 1's o_proj holding rank 0's columns: bytes and the row-parallel sum both fail."""
    out = tmp_path / "o"
    assert cli("-q", "convert", REAL_LLAMA, "-o", out, "--target", CUTLASS, "--tp", "2").exit_code == 0
    name = "model.layers.0.self_attn.o_proj.weight"
    t0 = load_file(str(next((out / "rank-0").glob("model-*.safetensors"))))[name]
    f1 = next((out / "rank-1").glob("model-*.safetensors"))
    t1 = load_file(str(f1))
    t1[name] = t0.clone()
    save_file(t1, str(f1), metadata={"format": "pt"})
    r = cli("--json", "verify", out)
    assert r.exit_code == 1
    bad = [(m["module"], m["rank"]) for m in r.json["modules"] if not m["passed"]]
    assert bad == [("model.layers.0.self_attn.o_proj", 1)]
    cross = {c["module"]: c for c in r.json["cross_rank"]}
    assert not cross["model.layers.0.self_attn.o_proj"]["passed"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("n,k,rowwise", [(509, 40, False), (509, 48, True), (32, 64, False)])
def test_scaled_mm_takes_any_n_and_k(device, n, k, rowwise):
    """Sampled rows give N like 509; cuBLASLt wants multiples of 16. The padded GEMM must equal a
    dequantized float64 product (bf16 output rounding allowed), cut back to N columns."""
    from mocli.verify.common import scaled_mm

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(n + k)
    xq = (torch.randn(24, k, generator=g) * 30).to(torch.float8_e4m3fn)
    wq = (torch.randn(n, k, generator=g) * 30).to(torch.float8_e4m3fn)
    sa = torch.rand(24, 1, generator=g) + 0.5 if rowwise else torch.tensor(0.25)
    sb = torch.rand(n, generator=g) + 0.5 if rowwise else torch.tensor(0.125)
    ref = (xq.double() * sa.double()) @ (wq.double() * sb.double().reshape(-1, 1)).T
    out = scaled_mm(xq.to(device), wq.to(device), sa.to(device), sb.to(device)).cpu().double()
    assert out.shape == (24, n)
    assert torch.allclose(out, ref, rtol=2 ** -7, atol=1e-3 * ref.abs().max().item())


def test_early_digests_are_the_ones_verify_checks(cli, tmp_path):
    """verify's digests started before torch is imported: one per declared output file and source shard,
    each taken (not hashed a second time) by the check, and a file changed afterwards is still caught."""
    from mocli.formats.layout import read_layout
    from mocli.io.digests import BackgroundDigests
    from mocli.verify import VerifyOptions, verify
    from mocli.verify.early import start_digests

    src = make_checkpoint(tmp_path / "src", arch="qwen3_moe", algo="FP8")
    out = tmp_path / "o"
    assert cli("-q", "convert", src, "-o", out, "--target", "flashinfer-cutlass").exit_code == 0
    manifest = json.loads((out / "mocli-layout.json").read_text())
    early = start_digests(read_layout(out), None, None)
    assert isinstance(early, BackgroundDigests)
    assert len(early.futures) == len(manifest["files"]) + len(manifest["provenance"]["source_shards"])
    report = verify(out, VerifyOptions(early_digests=early))
    assert report["ok"] and early.futures == {}  # every one taken by the check
    assert start_digests(read_layout(out), None, 0) is None  # --rank: verify's own list
    assert start_digests(None, None, None) is None  # not a converted directory
    shard = next(out.glob("model-*.safetensors"))
    with open(shard, "r+b") as f:  # one bit of the shard's last byte
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    early = start_digests(read_layout(out), None, None)
    report = verify(out, VerifyOptions(early_digests=early))
    assert not report["ok"] and early.futures == {}
    assert [p["file"] for p in report["files"]["problems"]] == [shard.name]


def test_module_checks_side_by_side_agree_and_stop_at_an_error(cli, converted, monkeypatch):
    """Several numpy module checks at once (``kinds.WORKERS``, one per 4 cores: 1 on the build machine,
    so forced here) give the report of one at a time, in the manifest's order, though the largest
    modules start first (an MoE layer started last would run alone at the end); a module whose check
    raises stops the run with that error, and the modules not started yet are not checked."""
    from mocli.verify import modules
    from mocli.verify.kinds import nvfp4_linear, nvfp4_moe

    monkeypatch.setattr("mocli.workers.PROCS", 0)  # threads of this process (tests/test_workers.py: processes)
    out = converted["qwen", TRTLLM]
    one = cli("--json", "verify", out).json
    monkeypatch.setattr(modules, "WORKERS", 2)
    started: list[str] = []
    real_dense, real_moe = nvfp4_linear.check, nvfp4_moe.check
    monkeypatch.setattr(nvfp4_linear, "check", lambda name, *a, **k: started.append(name) or real_dense(name, *a, **k))
    monkeypatch.setattr(nvfp4_moe, "check", lambda name, *a, **k: started.append(name) or real_moe(name, *a, **k))
    many = cli("--json", "verify", out).json
    strip = lambda r: [{k: v for k, v in m.items() if k != "seconds"} for m in r["modules"]]  # noqa: E731
    assert many["ok"] and strip(many) == strip(one)
    # the manifest lists the 4 dense modules before the 2 MoE layers; the layers start first
    assert [m["module"] for m in one["modules"]][-2:] == [n for n in started if n.endswith("experts")]
    assert all(n.endswith("experts") for n in started[:2]) and len(started) == 6, started

    started.clear()

    def first_fails(name, *a, **k):
        started.append(name)
        if len(started) == 1:
            raise RuntimeError("planted: the first MoE layer")
        time.sleep(1.5)  # the others take a while: the queued ones are cancelled meanwhile
        return real_moe(name, *a, **k)

    def slow_dense(name, *a, **k):
        started.append(name)
        time.sleep(1.5)
        return real_dense(name, *a, **k)

    monkeypatch.setattr(nvfp4_moe, "check", first_fails)
    monkeypatch.setattr(nvfp4_linear, "check", slow_dense)
    with pytest.raises(RuntimeError, match="planted"):
        from mocli.verify import VerifyOptions, verify

        verify(out, VerifyOptions(device="cpu"))
    # with two at a time, the failing module's worker may take one more before the run is cancelled (two,
    # on a machine too busy to cancel within 1.5 s); the rest never start
    assert 2 <= len(started) <= 4 and started[0].endswith("experts"), started


def test_fp4_kernels_are_sought_only_on_sm100(monkeypatch):
    """Torch is loaded for NVFP4 only where FlashInfer's NVFP4 kernels could run: FlashInfer installed,
    a layout they read, and an sm_100+ device (asked through the driver, without torch); an H100/H200
    (sm_90) checks NVFP4 in numpy."""
    import importlib.util

    from mocli.targets import layout_of
    from mocli.verify import VerifyOptions, modules

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flashinfer" else None)
    cutlass, trtllm = layout_of(CUTLASS), layout_of(TRTLLM)
    for cc, want in (((9, 0), False), ((10, 0), True), (None, False)):
        monkeypatch.setattr(modules, "capability", lambda device, cc=cc: cc)
        assert modules._fp4_kernels_possible(cutlass, VerifyOptions()) is want
        assert modules._fp4_kernels_possible(trtllm, VerifyOptions()) is False  # no FlashInfer NVFP4 kernel reads it
        assert modules._fp4_kernels_possible(cutlass, VerifyOptions(device="cpu")) is False
        assert modules._fp4_kernels_possible(cutlass, VerifyOptions(kernels="flashinfer")) is True


@pytest.mark.parametrize("target", [CUTLASS, TRTLLM])
def test_nvfp4_fused_moe_reference_against_an_independent_decoder(converted, target):
    """The reference of the NVFP4 fused-MoE check (FlashInfer's kernel, sm_100+: no CUDA here) through a
    stand-in kernel that computes the routed layer from the source's experts with the test suite's own
    decoder in float64: the check's reference must agree, and a kernel that swaps w1 and w3 must fail."""
    import numpy as np

    from mocli.census import build_census
    from mocli.checkpoint import open_checkpoint
    from mocli.loader import open_converted
    from mocli.tables import WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2
    from mocli.targets import layout_of
    from mocli.verify.kinds.context import CheckContext
    from mocli.verify.kinds.nvfp4_moe import Nvfp4Moe
    from mocli.verify.results import VerifyOptions
    from mocli.verify.source import SourceTensors

    src = open_checkpoint(str(REAL_QWEN))
    census = build_census(src.tensors)
    with src.reader() as reader:
        np_src = SourceTensors(src, census, reader)
        name = census.moe[0].name
        case = Nvfp4Moe(name, CheckContext({}, np_src, layout_of(target), VerifyOptions(), 1, None))
        ck = open_converted(converted["qwen", target])
        mod = ck.module_arrays(name)

        def weight(m) -> torch.Tensor:
            packed = torch.from_numpy(np.array(np_src.arr(m.tensors[WEIGHT].name)))
            bs = torch.from_numpy(np.array(np_src.arr(m.tensors[WEIGHT_SCALE].name))).view(torch.float8_e4m3fn)
            return ref.dequant_nvfp4(packed, bs, float(np_src.scalar(m, WEIGHT_SCALE_2))).double()

        class Kernel:
            swap = False

            def fused_moe(self, ck_, name_, x, ids, w):
                xq = torch.from_numpy(case.ref_in).double()
                out = torch.zeros(x.shape[0], mod.hidden, dtype=torch.float64)
                for t in range(x.shape[0]):
                    for k in range(ids.shape[1]):
                        ex = case.layer.experts[mod.expert_offset + int(ids[t, k])]
                        gate, up = (ex.up, ex.gate) if self.swap else (ex.gate, ex.up)
                        h = torch.nn.functional.silu(xq[t] @ weight(gate).T) * (xq[t] @ weight(up).T)
                        hq = nvfp4_quant(h.float()[None], torch.tensor(1 / float(case.a2))) * float(case.a2)
                        out[t] += float(w[t, k]) * (hq.double()[0] @ weight(ex.down).T)
                return out.float().numpy()

        kernel = Kernel()
        got = case.fused(kernel, ck, mod)
        assert got[0] == "flashinfer.cutlass_fused_moe" and got[3][0] < 0.01, got
        kernel.swap = True
        assert case.fused(kernel, ck, mod)[3][0] > got[3][1], "a kernel with w1 and w3 swapped passed"


def test_compare_bytes_finds_each_difference_and_a_short_file(tmp_path, monkeypatch):
    """Verbatim tensors in chunks smaller than the tensors (so a tensor spans several), lengths that are no
    multiple of 8 (the byte-by-byte tail): each difference is reported with the chunk it is in, counted by
    hand; an output shorter than its header says is a difference, not an error."""
    from types import SimpleNamespace

    from mocli.io.safetensors_file import TensorReader, read_header
    from mocli.verify import files

    monkeypatch.setattr(files, "COMPARE_CHUNK", 64)
    rng = torch.Generator().manual_seed(0)
    tensors = {n: torch.randint(0, 256, (k,), dtype=torch.uint8, generator=rng)
               for n, k in (("a", 150), ("b", 150), ("c", 7), ("same", 133))}
    save_file(tensors, tmp_path / "src.safetensors")
    edited = {n: t.clone() for n, t in tensors.items()}
    edited["a"][149] ^= 1  # last chunk [128, 150): in its 22-byte tail past 16 whole words
    edited["b"][70] ^= 0x80  # second chunk [64, 128)
    edited["c"][0] ^= 1  # a tensor shorter than one word
    save_file(edited, tmp_path / "out.safetensors")
    src = SimpleNamespace(tensors=read_header(tmp_path / "src.safetensors").tensors)
    out = read_header(tmp_path / "out.safetensors").tensors
    with TensorReader() as ro, TensorReader() as rs:
        found = files.compare_bytes(out, src, ro, rs)
    assert found == [{"tensor": "a", "problem": "differs from the source (bytes 128..150)"},
                     {"tensor": "b", "problem": "differs from the source (bytes 64..128)"},
                     {"tensor": "c", "problem": "differs from the source (bytes 0..7)"}]
    short = tmp_path / "short.safetensors"
    save_file(tensors, short)
    last = max(read_header(short).tensors.values(), key=lambda e: e.start)
    with open(short, "r+b") as f:
        f.truncate(last.start + 10)
    with TensorReader() as ro, TensorReader() as rs:  # the header still promises the bytes the file lost
        found = files.compare_bytes({last.name: last}, src, ro, rs)
    assert found == [{"tensor": last.name, "problem": "differs from the source (bytes 0..64)"}]


@pytest.mark.parametrize("src, target, kernels, wanted", [
    (REAL_QWEN, "marlin", "auto", False),  # every check in numpy, no FlashInfer layout
    (REAL_QWEN, "marlin", "flashinfer", True),  # asked for: the runtime says why not, with torch
    (REAL_QWEN, "flashinfer-cutlass", "auto", True),  # FlashInfer's NVFP4 kernels read it (sm_100+)
    (REAL_LLAMA, "flashinfer-cutlass", "auto", True),  # FP8: checked in torch
])
def test_verify_starts_a_cuda_context_only_where_it_may_use_one(cli, tmp_path, src, target, kernels, wanted):
    """``verify.early.gpu_context_wanted``, which decides whether ``warm_cuda`` makes the device's primary
    context while verify starts: never where no check can use torch on the GPU."""
    from mocli.formats.layout import read_layout
    from mocli.verify.early import gpu_context_wanted

    out = tmp_path / "o"
    assert cli("convert", src, "-o", out, "--target", target).exit_code == 0
    assert gpu_context_wanted(read_layout(out), kernels) is wanted
    assert gpu_context_wanted(None, "auto") is True  # a quantized or repaired output: FP8 in torch
