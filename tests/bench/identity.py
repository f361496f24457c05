"""Outputs against the previous release's (issue 45, "Done when"): every target/tp/ep conversion, repair and
quantize run by both releases on the same inputs, every output file compared byte for byte; then HEAD's
``mocli verify`` and HEAD's loader on what the previous release wrote.

    python tests/bench/identity.py [--base 13b0c36] [--head REV] [--jobs 1] [--only REGEX] [--report FILE]

The base is a ``git worktree`` of REV in a scratch directory (removed afterwards); HEAD is this work tree
(or a worktree of ``--head REV``). Both run as ``python -m mocli`` with this interpreter and
``PYTHONPATH=<tree>``, on the same input paths: every folder of HEAD's ``fixtures/real`` (x each target x tp1,
tp2 and, for MoE, tp2 ep2), a few generated checkpoints for kinds no real export has (HEAD's
``fixtures.generate``) and three real exports with issue 43's planted faults (tests/test_hostile.py), repair on the real ModelOpt exports and on ``tests/test_repair.py``'s repairable
variants, quantize on generated BF16 models. A case is

- ``identical``: every output file the same bytes;
- ``version-only``: the only differences are the fields recording the producer's version (and the digest
  ``mocli-layout.json`` keeps of a file that differs only so) - expected, since the version moved on;
- ``refused``: both releases refuse it (same exit status; a changed message is reported); ``crash-both``:
  both end in the same internal error (exit 3: a bug they share, reported, not a change); ``now-converts``:
  the base refused, HEAD writes (new support: reported, not a failure);
- ``differs`` / ``now-refused`` / ``refusal-changed``: a behaviour change. Unless ``EXPECTED`` names it with
  the commit that meant it, the run exits 1.

Then each output the base wrote must pass HEAD's ``mocli verify`` (exit 0; where HEAD's verify fails HEAD's
own output of the case as well, ``fails-both`` is reported and not counted: a bug both share), and each
converted rank must load through HEAD's ``mocli.loader.load_converted`` with every tensor of its indexes
accounted for. Inputs never change: each release writes into its own scratch output directory.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from identity_diff import DIFFERS, IDENTICAL, VERSION_ONLY, compare_dirs, worst  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BASE = "13b0c36"  # 0.1.0, the last commit before the round of issues 43-46
TARGETS = ("flashinfer-cutlass", "flashinfer-trtllm", "marlin")
# not failures: the same refusal (or the same internal error, a bug both releases share) and new support
OK_STATUSES = {IDENTICAL, VERSION_ONLY, "refused", "crash-both", "now-converts"}
STATUSES = [IDENTICAL, VERSION_ONLY, "refused", "crash-both", "now-converts", DIFFERS, "now-refused", "refusal-changed"]

# Differences a commit since BASE meant (case-id glob -> why); they cover the case's verify/load checks too.
# Anything else that differs fails the run.
EXPECTED: dict[str, str] = {
    "convert/gen/edge-llama-fp8_kv-k_scale_2/*": "84c07d7 (issue 43.5): a k_scale of shape [2] is TNS003, "
    "refused (vLLM loads one value); 0.1.0 copied it as it was",
    "convert/gen/edge-llama-w4a16_nvfp4-weight_scale_2_1e4/marlin/*": "c8aafbb (issue 43.2): SCL006, Marlin's "
    "weight_global_scale would be inf; 0.1.0 wrote the inf with exit 0, and HEAD's verify fails that output",
    # MXFP4 exports (fixtures added this round, c2e9048): 0.1.0 could not read them (CFG005 for the quark and
    # gpt-oss quant_methods, or their packed U8 weights taken for NVFP4: repair relabelled them NVFP4)
    "*/real/*mxfp4*": "issue 46 (0bc7995 reads MXFP4, 2f8de9e VLL002, 5ffd41c marlin converts MXFP4 linears, 175081a flashinfer-trtllm "
    "its experts): "
    "an MXFP4 input 0.1.0 did not read",
}

GEN = r'''
import json, shutil, sys, torch
from pathlib import Path
from fixtures.generate import BROKEN, _both_exclude, _edit_tensors, make_checkpoint
from fixtures.native_fp8 import make_native_fp8_block
root = Path(sys.argv[1])
convert = {"mixtral-fp8": dict(arch="mixtral", algo="FP8"), "qwen3_moe-fp8_pb_wo": dict(arch="qwen3_moe", algo="FP8_PB_WO"),
           "mixtral-fp8_channel": dict(arch="mixtral", algo="FP8_PER_CHANNEL_PER_TOKEN"),
           "qwen3_moe-nvfp4_awq": dict(arch="qwen3_moe", algo="NVFP4_AWQ"),
           "llama-nvfp4-qkv_bias": dict(algo="NVFP4", qkv_bias=True)}
for name, kw in convert.items():
    make_checkpoint(root / "convert" / name, **kw)
make_native_fp8_block(root / "convert" / "qwen3_moe-native_fp8_block", arch="qwen3_moe")
# issue 43's planted faults on real exports (tests/test_hostile.py): where this round meant to change behaviour
edits = {"llama-nvfp4_awq-f32_pre_quant_scale": ("llama-nvfp4_awq", "o_proj.pre_quant_scale", lambda t: t.float()),
         "llama-w4a16_nvfp4-weight_scale_2_1e4": ("llama-w4a16_nvfp4", "o_proj.weight_scale_2", lambda t: t.fill_(1e4)),
         "llama-fp8_kv-k_scale_2": ("llama-fp8_kv", "k_proj.k_scale", lambda t: torch.stack([t, t]))}
for name, (real, tensor, fn) in edits.items():
    d = root / "convert" / f"edge-{name}"
    shutil.copytree(Path("fixtures/real") / real, d)
    key = "model.layers.0.self_attn." + tensor
    _edit_tensors(d, lambda t: t.__setitem__(key, fn(t[key].clone()).contiguous()))
# tests/test_repair.py's VARIANTS (repairable) and two findings repair refuses
repair = {c: BROKEN[c][:2] for c in ("SCL003", "EXC001", "EXC004", "EXC005", "EXC006", "CFG001", "CFG002", "CFG003",
                                    "CFG004", "CFG006", "TNS004", "TNS005", "SCL001", "TNS001")}
repair["SCL005"] = (dict(arch="qwen3_moe", algo="NVFP4", unify_scale_2=False), None)
repair["EXC002"] = (dict(), _both_exclude(lambda ex: ex.append("model.layers.0.self_attn.q_proj")))
repair["EXC003"] = (dict(), _both_exclude(lambda ex: ex.append("model.layers.0.self_attn.o_proj")))
for code, (kw, mutate) in repair.items():
    d = make_checkpoint(root / "repair" / code, **kw)
    if mutate is not None:
        mutate(d)
for arch in ("llama", "mixtral", "qwen3_moe"):
    make_checkpoint(root / "quantize" / f"bf16-{arch}", arch=arch, algo="BF16", kv_cache=False)
make_checkpoint(root / "quantize" / "bf16-qwen3_moe-3shards", arch="qwen3_moe", algo="BF16", kv_cache=False, shards=3)
zero = "model.layers.1.self_attn.o_proj.weight"  # an all-zero tensor (scale 1), as test_quantize plants
_edit_tensors(root / "quantize" / "bf16-llama", lambda t: t.__setitem__(zero, torch.zeros_like(t[zero])))
'''

LOAD = r'''
import json, sys
from dataclasses import fields
from pathlib import Path
import torch
from mocli.loader import load_converted
for out in sys.argv[1:]:
    out = Path(out)
    ranks = json.loads((out / "mocli-layout.json").read_text())["parallel"]["ranks"]
    top = out / "model.safetensors.index.json"
    shared = set(json.loads(top.read_text())["weight_map"]) if top.exists() else set()
    problems, loaded = [], 0
    for r in ([None] if ranks == 1 else range(ranks)):
        idx = out / f"rank-{r}" / "model.safetensors.index.json"
        want = shared | (set(json.loads(idx.read_text())["weight_map"]) if r is not None and idx.exists() else set())
        try:
            ck = load_converted(out, rank=r)
        except Exception as e:
            problems.append(f"rank {r}: {type(e).__name__}: {e}")
            continue
        got = sum(isinstance(getattr(m, f.name), torch.Tensor) for m in ck.modules.values() for f in fields(m))
        got += len(ck.passthrough)
        loaded += got
        if got != len(want):
            problems.append(f"rank {r}: {got} tensors loaded, its indexes list {len(want)}")
    print(json.dumps({"out": str(out), "ok": not problems, "detail": "; ".join(problems) or f"{loaded} tensors"}))
'''


@dataclass
class Case:
    id: str
    argv: list[str]  # mocli arguments, OUT as "{out}"
    kind: str  # convert | repair | quantize
    sides: dict = field(default_factory=dict)  # "base"/"head" -> (rc, last stderr line, out dir)
    status: str = ""
    detail: str = ""
    expected: str = ""


def sh(cmd: list[str], cwd: Path | None = None, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def tree_env(tree: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOCLI_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))
    return env


def worktree(rev: str, where: Path) -> Path:
    r = sh(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), rev])
    if r.returncode:
        sys.exit(f"error: git worktree add {rev}: {r.stderr.strip()}")
    return where


def version_of(tree: Path) -> str:
    r = sh([sys.executable, "-c", "import mocli; print(mocli.__version__, mocli.__file__)"], tree, tree_env(tree))
    v, path = r.stdout.split()
    if not Path(path).resolve().is_relative_to(tree.resolve()):
        sys.exit(f"error: {tree} imports mocli from {path}, not from the tree")
    return v


def is_moe(src: Path) -> bool:
    cfg = json.loads((src / "config.json").read_text())
    cfgs = [cfg, cfg.get("text_config") or {}]
    return any(c.get(k) for c in cfgs for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def build_cases(head_tree: Path, inputs: Path) -> list[Case]:
    real = sorted(d for d in (head_tree / "fixtures" / "real").iterdir() if (d / "config.json").exists())
    gen = sorted((inputs / "convert").iterdir())
    cases = []
    for src in [*real, *gen]:
        tag = ("real/" if src in real else "gen/") + src.name
        layouts = [("tp1", []), ("tp2", ["--tp", "2"])] + ([("tp2ep2", ["--tp", "2", "--ep", "2"])] if is_moe(src) else [])
        for target in TARGETS:
            for lay, extra in layouts:
                cases.append(Case(f"convert/{tag}/{target}/{lay}",
                                  ["convert", str(src), "-o", "{out}", "--target", target, *extra, "-q"], "convert"))
    for src in [*real, *sorted((inputs / "repair").iterdir())]:
        tag = ("real/" if src in real else "gen/") + src.name
        cases.append(Case(f"repair/{tag}", ["repair", str(src), "-o", "{out}", "-q"], "repair"))
    for src in sorted((inputs / "quantize").iterdir()):
        cases.append(Case(f"quantize/gen/{src.name}", ["quantize", str(src), "-o", "{out}", "--device", "cpu", "-q"], "quantize"))
    llama = inputs / "quantize" / "bf16-llama"
    cases.append(Case("quantize/gen/bf16-llama/exclude-o_proj",
                      ["quantize", str(llama), "-o", "{out}", "--device", "cpu", "--exclude", "*o_proj", "-q"], "quantize"))
    return cases


def run_side(case: Case, side: str, tree: Path, outs: Path) -> None:
    out = outs / side / re.sub(r"[^\w.-]+", "__", case.id)
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = [a.replace("{out}", str(out)) for a in case.argv]
    r = sh([sys.executable, "-m", "mocli", *argv], tree, tree_env(tree))
    err = [ln.replace(str(out), "OUT") for ln in r.stderr.splitlines() if ln.strip()]
    case.sides[side] = (r.returncode, err[-1] if err else "", out)


def classify(case: Case, versions: tuple[str, str]) -> None:
    (rb, eb, ob), (rh, eh, oh) = case.sides["base"], case.sides["head"]
    if rb and rh:
        case.status = ("crash-both" if rb == 3 else "refused") if rb == rh else "refusal-changed"
        case.detail = f"rc {rb}: {eb}" if rb == rh else f"rc {rb} -> {rh}: {eb} || head: {eh}"
        if rb == rh and eb != eh:
            case.detail += f" || message changed, head says: {eh}"
    elif rb:
        case.status, case.detail = "now-converts", f"base rc {rb}: {eb}"
    elif rh:
        case.status, case.detail = "now-refused", f"head rc {rh}: {eh}"
    else:
        diffs = compare_dirs(ob, oh, versions)
        case.status = worst(diffs)
        shown = [d for d in diffs if d.status != IDENTICAL]
        case.detail = "; ".join(f"{d.path} [{d.status}] " + ", ".join(d.details[:6]) +
                                (f" (+{len(d.details) - 6})" if len(d.details) > 6 else "") for d in shown)
    hits = [why for pat, why in EXPECTED.items() if fnmatch.fnmatch(case.id, pat)]
    if case.status not in OK_STATUSES and hits:
        case.expected = hits[0]


def check_base_outputs(cases: list[Case], head: Path, jobs: int) -> list[tuple[str, str, str, str]]:
    """HEAD's verify on every output the base wrote, and HEAD's loader on every converted one: (case, check,
    pass | fail | fails-both, detail). fails-both: HEAD's verify fails HEAD's own output of the case too (a bug
    both releases share, not a broken compatibility)."""
    written = [c for c in cases if c.sides["base"][0] == 0]
    env = tree_env(head)

    def verify_one(out: Path) -> tuple[int, str]:
        r = sh([sys.executable, "-m", "mocli", "verify", str(out), "-q"], head, env)
        return r.returncode, ([ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip()] or [""])[-1]

    def verify(c: Case) -> tuple[str, str, str, str]:
        rc, last = verify_one(c.sides["base"][2])
        if rc == 0:
            return c.id, "verify", "pass", "rc 0"
        both = c.sides["head"][0] == 0 and verify_one(c.sides["head"][2])[0] == rc
        return c.id, "verify", "fails-both" if both else "fail", f"rc {rc}: {last}"

    with ThreadPoolExecutor(jobs) as pool:
        results = list(pool.map(verify, written))
    converted = [c for c in written if c.kind == "convert"]
    if converted:
        r = sh([sys.executable, "-c", LOAD, *(str(c.sides["base"][2]) for c in converted)], head, env, timeout=900)
        by_out = {json.loads(ln)["out"]: json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")}
        for c in converted:
            got = by_out.get(str(c.sides["base"][2]))
            results.append((c.id, "load", "pass" if got and got["ok"] else "fail",
                            got["detail"] if got else f"loader process rc {r.returncode}: {r.stderr.strip()[-300:]}"))
    return results


def failed(c: Case) -> bool:
    return c.status not in OK_STATUSES and not c.expected


def summary(cases: list[Case], checks: list) -> list[str]:
    lines = ["| kind | " + " | ".join(STATUSES) + " | expected | refusal message changed | total |",
             "|---" * (len(STATUSES) + 4) + "|"]
    for kind in ("convert", "repair", "quantize"):
        mine = [c for c in cases if c.kind == kind]
        row = [str(sum(c.status == s for c in mine)) for s in STATUSES]
        lines.append(f"| {kind} | " + " | ".join(row) + f" | {sum(bool(c.expected) for c in mine)} | "
                     f"{sum('message changed' in c.detail for c in mine)} | {len(mine)} |")
    for what in ("verify", "load"):
        mine = [x[2] for x in checks if x[1] == what]
        lines.append(f"| HEAD {what} of base outputs | {mine.count('pass')} pass, {mine.count('fail')} fail, "
                     f"{mine.count('fail, expected')} fail as expected, {mine.count('fails-both')} fail on HEAD's "
                     "own output too |" + " |" * (len(STATUSES) + 2))
    return lines


def report(path: Path, cases: list[Case], checks: list, revs: dict, seconds: float) -> None:
    md = [f"# identity check: base {revs['base']} ({revs['base_v']}) vs head {revs['head']} ({revs['head_v']})", "",
          f"{len(cases)} cases, {seconds:.0f} s. Command: `{' '.join(sys.argv)}`", "", *summary(cases, checks), "",
          "## Cases that are not identical", "", "| case | status | detail |", "|---|---|---|"]
    for c in cases:
        if c.status != IDENTICAL:
            st = c.status + (f" (expected: {c.expected})" if c.expected else "")
            md.append(f"| `{c.id}` | {st} | {c.detail.replace('|', '/')} |")
    md += ["", "## HEAD on the base's outputs (failures only)", ""]
    md += [f"- `{cid}` {what} {st}: {detail}" for cid, what, st, detail in checks if st != "pass"] or ["none"]
    path.write_text("\n".join(md) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default=BASE, help="the previous release's commit (default %(default)s)")
    ap.add_argument("--head", default=None, help="a commit to run as HEAD (default: this work tree as it is)")
    ap.add_argument("--jobs", type=int, default=1, help="processes at once (default 1)")
    ap.add_argument("--only", default=None, help="only cases whose id matches this regex")
    ap.add_argument("--report", type=Path, default=None, help="also write a Markdown report here")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory (printed)")
    a = ap.parse_args()
    t0 = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="mocli-identity-"))
    trees = []
    try:
        base = worktree(a.base, scratch / "base")
        trees.append(base)
        head = worktree(a.head, scratch / "head") if a.head else ROOT
        if a.head:
            trees.append(head)
        return run(a, base, head, scratch, t0)
    finally:
        for t in trees:
            sh(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(t)])
        if a.keep:
            print(f"scratch kept: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


def run(a, base: Path, head: Path, scratch: Path, t0: float) -> int:
    versions = (version_of(base), version_of(head))
    revs = {"base": a.base, "head": a.head or f"work tree at {sh(['git', '-C', str(ROOT), 'rev-parse', '--short', 'HEAD']).stdout.strip()}",
            "base_v": versions[0], "head_v": versions[1]}
    print(f"base {revs['base']} (mocli {versions[0]}) vs head {revs['head']} (mocli {versions[1]})", flush=True)
    g = sh([sys.executable, "-c", GEN, str(scratch / "inputs")], head, tree_env(head))
    if g.returncode:
        sys.exit(f"error: generating inputs failed: {g.stderr.strip()[-2000:]}")
    cases = [c for c in build_cases(head, scratch / "inputs") if not a.only or re.search(a.only, c.id)]
    tasks = [(c, side, tree) for c in cases for side, tree in (("base", base), ("head", head))]
    with ThreadPoolExecutor(a.jobs) as pool:
        list(pool.map(lambda t: run_side(t[0], t[1], t[2], scratch / "out"), tasks))
    for c in cases:
        classify(c, versions)
        mark = "FAIL" if failed(c) else "ok  "
        print(f"{mark} {c.status:15} {c.id}" + (f"  -- {c.detail}" if c.status != IDENTICAL else "")
              + (f"  [expected: {c.expected}]" if c.expected else ""), flush=True)
    checks = check_base_outputs(cases, head, a.jobs)
    meant = {c.id: c.expected for c in cases if c.expected}
    checks = [(cid, what, "fail, expected" if st == "fail" and cid in meant else st, detail)
              for cid, what, st, detail in checks]
    for cid, what, st, detail in checks:
        if st != "pass":
            print(f"{'FAIL' if st == 'fail' else 'ok  '} HEAD {what} of the base's output of {cid}: {st}: {detail}"
                  + (f"  [expected: {meant[cid]}]" if st == "fail, expected" else ""))
    print("\n".join(summary(cases, checks)))
    if a.report:
        report(a.report, cases, checks, revs, time.monotonic() - t0)
    bad = [c for c in cases if failed(c)] + [x for x in checks if x[2] == "fail"]
    print(f"{'FAIL' if bad else 'OK'}: {len(cases)} cases, {len(bad)} unexpected difference(s) or failed check(s), "
          f"{time.monotonic() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
