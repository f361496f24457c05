"""MXFP4 findings beyond the scheme's tensor table (SEMANTICS §19): gpt-oss's fused expert tensors that do not
fit its layout (TNS001, TNS003, naming the tensor), experts blocked along the output features (TNS009: ModelOpt
0.47's gpt-oss export), experts whose projections do not chain (TNS006: gate/up [I, H], down [H, I]; the
model_free gpt-oss export cuts transformers' [E, H, 2I] as if it were [E, out, in]), a bias whose shape is not
the module's rows (TNS003), and ModelOpt ``mxfp4``, which vLLM 0.33 refuses (VLL002)."""

from __future__ import annotations

from mocli.census import Census, Kind, MoELayer
from mocli.findings import Findings
from mocli.quant_config import QuantConfig
from mocli.schemes import MXFP4
from mocli.schemes.gpt_oss import BIASES, BLOCKS, PROJECTIONS, SCALES, layout_fault
from mocli.schemes.mxfp4 import BIAS

_REEXPORT = "the export is broken; re-export the checkpoint"
MODELOPT_REFUSAL = ("vLLM 0.33 refuses ModelOpt's quant_algo \"mxfp4\" (modelopt.py :: ModelOptQuantConfigBase."
                    "from_config upper-cases it to MXFP4, which is not in QUANT_ALGOS), and mocli converts only "
                    "llm-compressor's, Quark's and gpt-oss's MXFP4")
MODELOPT_HINT = "re-export with llm-compressor's MXFP4 preset (compressed-tensors) or AMD Quark, which vLLM reads"


def modelopt_refuses(method: str | None, algos) -> bool:
    """Whether a ModelOpt config naming these algorithms is one vLLM 0.33 refuses (MXFP4: VLL002); repair asks
    it too before it relabels a config after its tensors."""
    return method == "modelopt" and MXFP4.algo in algos


def check_mxfp4(quant: QuantConfig, census: Census, engines: frozenset[str], findings: Findings) -> None:
    if "vllm" in engines and modelopt_refuses(quant.method, (quant.algo, *quant.quantized_layers)):
        findings.add("VLL002", "quant_algo", MODELOPT_REFUSAL, hint=MODELOPT_HINT)
    if "vllm" in engines and quant.method == "compressed-tensors" and quant.weight_only:
        dense = [n for n, _, scheme in census.dense_units() if scheme is MXFP4]
        if dense:
            findings.add("VLL003", "config_groups", f"MXFP4 weight-only (no input_activations), but vLLM 0.33 builds "
                         f"its {len(dense)} dense MXFP4 layer(s) with MXFP4 activations (CompressedTensorsW4A4Mxfp4's "
                         "default kMxfp4Dynamic): W4A4 on sm_100 (FlashInfer) and sm_90 (Humming), W4A16 only on Marlin",
                         hint="expect W4A4 accuracy on Hopper and Blackwell, or serve with --linear-backend marlin")
    for m in census.modules.values():
        if m.kind is Kind.OTHER and m.name.endswith(".experts"):
            _check_fused_experts(m.tensors, findings)
        elif m.scheme is MXFP4 and BIAS in m.tensors and m.out_in and tuple(m.tensors[BIAS].shape) != (m.out_in[0],):
            findings.add("TNS003", m.tensors[BIAS].name, f"bias {list(m.tensors[BIAS].shape)}, expected "
                         f"[{m.out_in[0]}] for weight {list(m.weight.shape)}", hint=_REEXPORT)
    for layer in census.moe:
        if MXFP4 in layer.schemes:
            _check_chain(layer, findings)


def _check_fused_experts(tensors: dict, findings: Findings) -> None:
    """All experts in one tensor per projection the census could not split per expert."""
    for proj in PROJECTIONS:
        blocks = tensors.get(proj + BLOCKS)
        if blocks is not None:
            fault = layout_fault(blocks, tensors.get(proj + SCALES), tensors.get(proj + BIASES))
            code = "TNS001" if "has no" in fault else "TNS003"
            findings.add(code, blocks.name, fault, hint=_REEXPORT)
            continue
        packed, scale = tensors.get(proj), tensors.get(f"{proj}_weight_scale")
        if packed is not None and scale is not None and packed.dtype == scale.dtype == "U8" and len(packed.shape) == 3:
            e, k, nb = packed.shape
            findings.add("TNS009", packed.name, f"U8 {list(packed.shape)} with scales {list(scale.shape)}: each "
                         f"expert's [in {k}, out {nb * 2}] weight is blocked along the output features (transformers' "
                         "[E, in, out] layout, ModelOpt 0.47's gpt-oss export); the engines' MXFP4 GEMMs take 32-value "
                         "blocks along the input features, so no engine can serve it", hint="re-export the experts "
                         "in gpt-oss's own layout (*_blocks [E, out, in/32, 16]) or with llm-compressor or AMD Quark")


def _check_chain(layer: MoELayer, findings: Findings) -> None:
    """Every expert's gate/up is [I, H] and its down [H, I] (gpt-oss's fused gate_up: [2I, H])."""
    for e in sorted(layer.experts):
        ex = layer.experts[e]
        first = ex.gate_up if ex.gate_up is not None else ex.gate
        if first is None or ex.down is None or not first.out_in or not ex.down.out_in:
            continue
        (n, k), (dn, dk) = first.out_in, ex.down.out_in
        i = n // 2 if ex.gate_up is not None else n
        if (k, i) != (dn, dk):
            what = "gate_up" if ex.gate_up is not None else "gate"
            findings.add("TNS006", f"{layer.name}.{e}", f"{what} [{n}, {k}] and down [{dn}, {dk}] do not chain: "
                         f"down must be [H, I] = [{k}, {i}]", hint="the experts were cut from the wrong axis (an "
                         "[E, in, out] tensor read as [E, out, in]); re-export the checkpoint")
            return
