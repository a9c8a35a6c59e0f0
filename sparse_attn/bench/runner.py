"""The sweep: every (pattern, implementation, N) point, each in a fresh process, into one results dict.

A point that is out of memory or past its time limit stops its line: the larger N of the same
(pattern, implementation) are recorded as skipped. An implementation that cannot run here is
recorded as unavailable with its reason, decided once before any point runs. An implementation that
never reads the pattern (``PATTERN_FREE``: dense SDPA) runs once per N; the other patterns' rows
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
from .config import IMPLEMENTATIONS, PATTERN_FREE
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
            result = harness.run_point({**point, "pattern": patterns[label].to_dict(), "batch": batch,
                                        "heads": heads, "head_dim": head_dim, "block_size": block_size,
                                        "backward": backward, "repeats": repeats, "timeout": timeout,
                                        "device": device, "memory_limit_gb": memory_limit_gb})
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
