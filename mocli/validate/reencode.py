"""TGT004: an MXFP4 expert block that no single power-of-two e4m3 scale holds exactly (``--mxfp4-experts
fp8-block``, SEMANTICS §19.7). The condition depends on the values, so this check reads every MXFP4 expert's
packed weights and E8M0 codes once (numpy, at disk speed) and runs convert's own rule on them
(``mocli.plan.mxfp4_fp8block.block_scales``): convert refuses on the finding before it writes anything. The
whole matrix's 128x128 grid is every rank's, since each rank's slice starts on a multiple of 128 (§18.3)."""

from __future__ import annotations

from mocli.census import Census
from mocli.findings import Findings
from mocli.kinds import ModuleKind
from mocli.schemes import MXFP4
from mocli.schemes.mxfp4 import NAN_SCALE
from mocli.tables import WEIGHT, WEIGHT_SCALE
from mocli.targets import Target, layout_of

PROJECTIONS = ("gate", "up", "down")


def check_reencoded(target: Target, census: Census, findings: Findings, mxfp4_experts: str) -> None:
    if mxfp4_experts == "native":
        return
    from mocli.io.safetensors_file import TensorReader
    from mocli.plan.mxfp4_fp8block import SpreadError, block_scales, unpack
    from mocli.plan.mxfp4_fp8block_moe import HINT

    layout = layout_of(target, mxfp4_experts)
    layers = [la for la in census.moe if la.schemes == {MXFP4} and layout.moe_refusal(la) is None
              and layout.kind_for(MXFP4, moe=True) is ModuleKind.FP8_BLOCK_MOE]
    with TensorReader() as reader:
        for layer in layers:
            for e in sorted(layer.experts):
                for proj in PROJECTIONS:
                    m = getattr(layer.experts[e], proj)
                    if m is None or WEIGHT not in m.tensors or WEIGHT_SCALE not in m.tensors:
                        continue
                    codes = reader.array(m.tensors[WEIGHT_SCALE])
                    if bool((codes == NAN_SCALE).any()):  # DAT001's (validate --deep; convert refuses it)
                        continue
                    try:
                        block_scales(unpack(reader.array(m.tensors[WEIGHT])), codes)
                    except SpreadError as err:
                        findings.add("TGT004", m.tensors[WEIGHT].name,
                                     f"expert {e} {proj}: {err}; {target} --mxfp4-experts fp8-block cannot "
                                     "re-encode it losslessly", hint=HINT)
