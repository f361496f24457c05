"""The plugin's vLLM requirements (mocli/vllm_plugin/requirements.py) against each release's source,
read statically (tests/vllm_compat.py): no CUDA, no vLLM installed. The first run downloads each wheel
(about 330 MB) into the cache; skipped when it cannot be downloaded."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest

from mocli.vllm_plugin.requirements import REQUIREMENTS
from tests.vllm_compat import WheelUnavailable, check_source, source_tree

pytestmark = pytest.mark.vllm_compat

VERSIONS = ("0.32.0", "0.33.0")


@functools.cache
def _tree_or_reason(version: str) -> Path | str:  # one download attempt per release and session
    try:
        return source_tree(version)
    except WheelUnavailable as e:
        return f"vLLM {version}'s wheel is not available here: {e}"


def _tree(version: str) -> Path:
    found = _tree_or_reason(version)
    if isinstance(found, str):
        pytest.skip(found)
    return found


@pytest.fixture(scope="module", params=VERSIONS)
def release(request) -> tuple[str, Path]:
    return request.param, _tree(request.param)


def test_every_requirement_resolves(release):
    version, root = release
    assert check_source(root, REQUIREMENTS) == [], f"vLLM {version}"


# (file, text, replacement, the problems the checker must report, and nothing else)
DOCTORED = {
    "removed function": (
        "vllm/model_executor/model_loader/__init__.py", "def register_model_loader(", "def _gone(",
        ["vllm.model_executor.model_loader: no attribute register_model_loader"]),
    "renamed parameter": (
        "vllm/utils/torch_utils.py", "def get_kv_cache_quant_algo_string(quant_cfg:",
        "def get_kv_cache_quant_algo_string(quant_config:",
        ["vllm.utils.torch_utils.get_kv_cache_quant_algo_string: parameter quant_cfg missing",
         "vllm.utils.torch_utils.get_kv_cache_quant_algo_string: unexpected parameter quant_config"]),
    "new abstract method": (
        "vllm/model_executor/model_loader/base_loader.py", "    @abstractmethod\n    def download_model(",
        "    @abstractmethod\n    def warm_up(self) -> None: ...\n\n    @abstractmethod\n    def download_model(",
        ["vllm.model_executor.model_loader.base_loader.BaseModelLoader: abstract method warm_up is not implemented"]),
    "patch bypassed": (
        "vllm/engine/arg_utils.py", "from vllm.utils.torch_utils import resolve_kv_cache_dtype_string",
        "from vllm.utils.torch_utils import get_kv_cache_quant_algo_string, resolve_kv_cache_dtype_string",
        ["vllm.utils.torch_utils.get_kv_cache_quant_algo_string: imported by name in vllm.engine.arg_utils, "
         "which the patch does not reach"]),
}


@pytest.mark.parametrize("case", DOCTORED)
def test_a_doctored_release_reports_exactly_that_requirement(case, tmp_path):
    file, text, replacement, expected = DOCTORED[case]
    root = tmp_path / "vllm-0.33.0"
    shutil.copytree(_tree("0.33.0") / "vllm", root / "vllm")
    source = root / file
    original = source.read_text()
    assert original.count(text) == 1, f"{file} no longer holds {text!r} once: update this case"
    source.write_text(original.replace(text, replacement))
    assert check_source(root, REQUIREMENTS) == expected
