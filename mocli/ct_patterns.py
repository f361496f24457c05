"""compressed-tensors ``re:`` patterns judged under Python's ``re`` (issue 43 item 3): CFG009.

Which matcher runs a pattern decides whether it hangs. vLLM 0.33 matches ``ignore`` and ``targets`` with the
``regex`` module (``utils/config_utils.py`` imports ``regex as re``; ``is_equal_or_regex_match`` calls
``re.match(pattern, value)``, reached from ``compressed_tensors/utils.py :: should_ignore_layer,
find_matched_target``): mocli's own matcher is that module, with a time limit, so CFG008 is the engine's
verdict. Python's ``re`` (a plain backtracking engine, no safeguards) is what SGLang's copy of those helpers
(``srt/layers/quantization/compressed_tensors/utils.py :: _is_equal_or_regex_match``, ``import re``) and
compressed-tensors' own matcher (``utils/match.py``: llm-compressor, transformers, vLLM's transform configs)
run: ``re:((\\w+\\.?)+)+Z`` answers in 0.1 ms under ``regex`` and runs for hours under ``re`` on a 30-character
module name. Such a pattern is a CFG009 warning: the checkpoint serves on vLLM, and hangs the others.

Two stages keep ordinary checkpoints cheap: a static rule (a quantified group holding a quantifier or an
alternation, or a back-reference: the shapes that backtrack exponentially) picks the suspicious patterns; only
those run, all in one worker process, under ``re.match`` on the checkpoint's own module names (the names the
engines ask with), each match with a time limit; a worker past it is killed and the next pattern goes on in a
fresh one. A suspicious pattern that answers every name in time is no finding: the names are fixed.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import subprocess
import sys
import time
from dataclasses import dataclass

RE_SECONDS = 0.1  # per re.match: a module name is short; longer means exponential backtracking
_START_SECONDS = 10.0  # the worker's start (a bare interpreter), before its first match

_WORKER = r"""
import json, os, re, sys
job = json.loads(sys.stdin.read())
names = job["names"]
for i, p in enumerate(job["patterns"]):
    rx = re.compile(p)
    for j, n in enumerate(names):
        os.write(1, b"%d %d\n" % (i, j))
        rx.match(n)
os.write(1, b"done\n")
"""


@dataclass(frozen=True)
class SlowPattern:
    pattern: str  # with its "re:" prefix
    reason: str  # the static rule's words, or why Python's re refuses it
    name: str | None  # the module name a match ran past the limit on (None: re does not compile it)


def static_hazard(pattern: str) -> str | None:
    """Why ``pattern`` (without ``re:``) may backtrack exponentially under Python's ``re``, or None."""
    try:
        from re import _constants as c
        from re import _parser
    except ImportError:  # a Python whose re keeps its parser elsewhere: let the worker decide
        return "a pattern this Python's re cannot show its shape"
    try:
        re.compile(pattern)  # a look-behind of variable width, say, fails only here
        tree = _parser.parse(pattern)
    except re.error as e:
        return f"not a Python re pattern ({e})"
    except RecursionError:
        return "nested too deeply for Python's re"

    def walk(items, in_repeat: bool) -> str | None:
        for op, av in items:
            if op in (c.MAX_REPEAT, c.MIN_REPEAT):
                _lo, hi, sub = av
                if hi > 1 and in_repeat:
                    return "a quantified group holding a quantifier"
                found = walk(sub, in_repeat or hi > 1)
            elif op in (c.GROUPREF, c.GROUPREF_EXISTS):
                return "a back-reference"
            elif op is c.BRANCH:
                if in_repeat:
                    return "a quantified alternation"
                found = next((r for b in av[1] if (r := walk(b, in_repeat))), None)
            elif op is c.SUBPATTERN:
                found = walk(av[-1], in_repeat)
            elif op in (c.ASSERT, c.ASSERT_NOT):
                found = walk(av[1], in_repeat)
            else:  # literals, sets; possessive repeats and atomic groups do not backtrack into themselves
                found = None
            if found:
                return found
        return None

    return walk(tree.data, False)


def slow_under_re(patterns: list[str], names: list[str], limit: float = RE_SECONDS) -> list[SlowPattern]:
    """The ``re:`` patterns that Python's ``re`` refuses, or runs past ``limit`` seconds on one of ``names``.
    Only patterns the static rule suspects run, all in one worker (no worker when none is suspect)."""
    found, suspects = [], {}
    for p in dict.fromkeys(patterns):
        if p.startswith("re:") and (why := static_hazard(p[3:])):
            if why.startswith("not a Python") or why.startswith("nested too"):
                found.append(SlowPattern(p, why, None))
            else:
                suspects[p] = why
    todo = list(suspects)
    while todo and names:
        slow = _run_worker([p[3:] for p in todo], names, limit)
        if slow is None:
            break
        i, j = slow
        found.append(SlowPattern(todo[i], suspects[todo[i]], names[j]))
        todo = todo[i + 1:]
    return found


def _run_worker(patterns: list[str], names: list[str], limit: float) -> tuple[int, int] | None:
    """Match every pattern on every name in a fresh interpreter; the (pattern, name) indices of the first
    match that ran past ``limit`` (the worker is then killed), or None when all answered."""
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WORKER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    except OSError:
        return None  # no interpreter to run it in (an embedded Python): no verdict rather than a hang
    try:
        try:
            proc.stdin.write(json.dumps({"patterns": patterns, "names": names}).encode())
            proc.stdin.close()
        except BrokenPipeError:
            return None  # the worker died before reading: no verdict
        return _watch(proc, limit)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()


def _watch(proc: subprocess.Popen, limit: float) -> tuple[int, int] | None:
    fd, buf, last = proc.stdout.fileno(), b"", None
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    try:
        deadline = time.monotonic() + _START_SECONDS
        while True:
            wait = deadline - time.monotonic()
            if wait <= 0 or not sel.select(wait):
                return _indices(last) if last else None  # never started: nothing to blame
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # the worker ended without "done": it failed, nothing to blame on a pattern
                return None
            buf += chunk
            *lines, buf = buf.split(b"\n")
            if lines:
                if lines[-1] == b"done":
                    return None
                last = lines[-1]
                deadline = time.monotonic() + limit
    finally:
        sel.close()


def _indices(line: bytes) -> tuple[int, int]:
    i, j = line.split()
    return int(i), int(j)
