"""The sweep: every (pattern, implementation, N) point, each in a fresh process, into one results dict.

A point that is out of memory or past its time limit stops its line: the larger N of the same
(pattern, implementation) are recorded as skipped. An implementation that cannot run here is
recorded as unavailable with its reason, decided once before any point runs. An implementation that compiles
and caches its kernels (``WARM_FIRST``) runs one small point first, without a time limit: the points then load the
cache and time the kernels, and a warm-up that fails makes the implementation unavailable with its error. An
implementation that never reads the pattern (``PATTERN_FREE``: dense SDPA) runs once per N; the other patterns' rows
repeat that point, with ``"same_as"`` naming the pattern it ran under.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import machine
from ..pattern import Pattern
from . import harness
from .config import IMPLEMENTATIONS, OWN, PATTERN_FREE, WARM_FIRST
from .implementations import unavailable_reasons
from .results import write_json


def sweep(patterns: dict[str, Pattern], lengths: Sequence[int], implementations: Sequence[str], *, batch: int = 1,
          heads: int = 8, head_dim: int = 64, block_size: int = 64, backward: bool = False, repeats: int = 3,
          timeout: float = 120, memory_limit_gb: float | None = None, device: str = "cpu",
          command: str = "", progress: bool = True, out: Path | None = None,
          unavailable: dict[tuple[str, str], str] | None = None) -> dict:
    """Run every (pattern, implementation, N) point; returns (and, with ``out``, keeps saving) the results.

    ``unavailable`` is what ``unavailable_reasons`` returned, when the caller already asked.
    """
    if unavailable is None:
        unavailable = unavailable_reasons(patterns, implementations, device, backward)
    shape = {"batch": batch, "heads": heads, "head_dim": head_dim, "block_size": block_size, "backward": backward,
             "device": device, "memory_limit_gb": memory_limit_gb}
    unavailable = {**unavailable, **_warm_up(patterns, implementations, unavailable, shape, progress)}
    results: dict[str, Any]
    results = {"command": command, "machine": machine.describe(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
               "load_average_start": machine.load_average(),
               "config": {"batch": batch, "heads": heads, "head_dim": head_dim, "block_size": block_size,
                          "dtype": "float32", "device": device, "backward": backward, "repeats": repeats,
                          "timeout_s": timeout, "memory_limit_gb": memory_limit_gb},
               "patterns": {label: repr(p) for label, p in patterns.items()},
               "implementations": {name: IMPLEMENTATIONS[name] for name in implementations}, "points": []}
    planned = [(label, name, n) for label in patterns for name in implementations for n in sorted(lengths)]
    stopped: dict[tuple[str, str], str] = {}
    pattern_free: dict[tuple[str, int], dict] = {}  # (implementation, N) -> its point, under the first pattern
    for label, name, n in _progress(planned, progress):
        point = {"pattern_label": label, "implementation": name, "n": n}
        if (label, name) in unavailable:
            result = {"status": "unavailable", "error": unavailable[(label, name)]}
        elif (label, name) in stopped:
            result = {"status": "skipped", "error": stopped[(label, name)]}
        elif (name, n) in pattern_free:
            result = pattern_free[(name, n)]
        else:
            result = harness.run_point({**point, **shape, "pattern": patterns[label].to_dict(), "repeats": repeats,
                                        "timeout": timeout})
            if name in PATTERN_FREE:
                pattern_free[(name, n)] = {**result, "same_as": label}
        if result["status"] in ("oom", "timeout"):
            stopped[(label, name)] = f"{result['status']} at N={n}"
        results["points"].append({**point, **result})
        if out is not None:
            write_json(out / "results.json", results)
    results["load_average_end"] = machine.load_average()
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    if out is not None:
        write_json(out / "results.json", results)
    return results


def own_lines_missing(results: dict) -> list[str]:
    """For each pattern of the sweep where this library's implementations ran no point (every one timed out,
    crashed or was unavailable), why, one line per implementation; [] when each pattern has at least one
    measured point of the library, or when the sweep asked for none of its implementations.

    >>> own_lines_missing({"points": [{"pattern_label": "longformer", "implementation": "sparse_attn-numba", "n": 1024,
    ...                                "status": "timeout", "error": "did not finish within the 60 s limit"}]})
    ['longformer: sparse_attn-numba: timeout at N=1024: did not finish within the 60 s limit']
    """
    points = [p for p in results["points"] if p["implementation"] in OWN]
    missing = []
    for label in dict.fromkeys(p["pattern_label"] for p in points):
        own = [p for p in points if p["pattern_label"] == label]
        if not any(p["status"] == "ok" for p in own):
            first = {p["implementation"]: p for p in reversed(own) if p["status"] != "skipped"}
            missing += [f"{label}: {name}: {p['status']} at N={p['n']}: {p['error']}" for name, p in first.items()]
    return missing


def _warm_up(patterns: dict[str, Pattern], implementations: Sequence[str], unavailable: dict[tuple[str, str], str],
             shape: dict, progress: bool) -> dict[tuple[str, str], str]:
    """Run each available implementation of ``WARM_FIRST`` once at N = 256 under the first pattern it runs, with no
    time limit, so that its kernels compile and cache before the points; (pattern label, implementation) -> why,
    for each one whose warm-up failed."""
    failed = {}
    for name in implementations:
        labels = [label for label in patterns if (label, name) not in unavailable]
        if name not in WARM_FIRST or not labels:
            continue
        if progress:
            print(f"{name}: compiling its kernels before the sweep, once (cached for later runs) ...", file=sys.stderr,
                  flush=True)
        result = harness.run_point({"pattern_label": labels[0], "implementation": name, "n": 256, **shape,
                                    "pattern": patterns[labels[0]].to_dict(), "repeats": 1, "timeout": None})
        if result["status"] != "ok":
            why = f"its warm-up before the sweep failed: {result['error']}"
            failed.update({(label, name): why for label in labels})
        elif progress:
            print(f"{name}: ready ({result['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    return failed


def _progress(planned: list[tuple[str, str, int]], show: bool):
    """The planned points, with a tqdm bar on stderr when ``show`` (tqdm is only needed then)."""
    if not show:
        yield from planned
        return
    from tqdm import tqdm

    bar = tqdm(planned, desc="bench", unit="point", file=sys.stderr)
    for label, name, n in bar:
        bar.set_postfix_str(f"{label} {name} N={n}")
        yield label, name, n
