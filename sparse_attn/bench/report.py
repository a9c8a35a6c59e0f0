"""The results of a sweep as files: results.json, results.md (one table per pattern), time.png, memory.png.

>>> results = {"patterns": {"p": "Local(1)"}, "implementations": {"x": ""},
...            "points": [{"pattern_label": "p", "implementation": "x", "n": n, "status": "ok",
...                        "time_s": n / 2048, "memory_mb": n / 256} for n in (1024, 2048)]}
>>> for line in tables(results).splitlines()[2:5]:
...     print(line)
| implementation | 1,024 | 2,048 | memory grows as | time grows as |
|---|---:|---:|---:|---:|
| x | 0.5 / 4 | 1 / 8 | N^1.0 | N^1.0 |

The last two columns say at a glance how each implementation scales: the exponent k of N^k between the two
largest N it ran (an N x N mask's memory grows as N^2; the memory of a sparse kernel, and of dense flash
attention, as N^1; dense attention's time as N^2).
"""
from __future__ import annotations

import math
from pathlib import Path

from .results import write_results

LEGEND = ("Cells: time (s) / memory (MB); `*` = too slow to repeat, the warm-up call was measured (its memory "
          "includes the set-up); `oom` = out of memory, `timeout` = ran past the time limit, `error` = failed, "
          "`-` = skipped after `oom` or `timeout` at a smaller N, `n/a` = cannot run here; `[k]` = the reason, "
          "under the table. `N^k`: how memory and time grow between the two largest N the row ran, k = "
          "log(ratio of the values) / log(ratio of the N): N^1 is linear (a sparse pattern's memory, and dense "
          "flash attention's), N^2 quadratic (an N x N mask's memory, dense attention's time).")


def write(results: dict, out: Path) -> list[Path]:
    """results.json, results.md, time.png and memory.png under ``out``, each replaced whole; returns their
    paths."""
    from .. import viz

    def draw(metric):
        return lambda record, path: viz.save(viz.plot_bench(record, metric), path, dpi=110, bbox_inches="tight")

    figures = {f"{metric}.png": draw(metric) for metric in ("time", "memory")}
    write_results(out, "results", results, markdown, figures)
    return [out / name for name in ("results.json", "results.md", *figures)]


def markdown(results: dict) -> str:
    """The results as a markdown page: config, machine, then one table per pattern."""
    config, info = results["config"], results["machine"]
    load = results.get("load_average_end", results["load_average_start"])
    lines = ["# Attention time and memory versus sequence length", "",
             f"Command: `{results['command']}`  ",
             f"Machine: {info['machine']}, {info['cpus']} CPUs, {info['platform']}, Python {info['python']}, "
             + ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v)
             + (f", GPU {info['gpu']}" if "gpu" in info else "") + f" (load average {load[0]:.1f} at the end).", "",
             f"B={config['batch']}, H={config['heads']}, D={config['head_dim']}, {config['dtype']} on "
             f"{config['device']}, block {config['block_size']}, "
             f"{'forward + backward' if config['backward'] else 'forward'}; "
             f"time = median of up to {config['repeats']} calls after a warm-up call; memory = peak resident memory "
             f"during the calls minus the resident memory before setting the implementation up (beyond q, k, v; "
             f"its mask or layout, output and working memory included). Each point ran in a fresh process.", ""]
    lines += [tables(results), "## Implementations", ""]
    lines += [f"- `{k}`: {v}" for k, v in results["implementations"].items()]
    return "\n".join(lines) + "\n"


def tables(results: dict) -> str:
    """One markdown table per pattern (implementations x sequence lengths), the reasons for its
    n/a, oom, timeout and error cells under it, then the legend of the cells.
    """
    lines = []
    for label, expression in results["patterns"].items():
        points = [p for p in results["points"] if p["pattern_label"] == label]
        lengths = sorted({p["n"] for p in points})
        lines += [f"## {label}: `{expression.replace('|', chr(92) + '|')}`", "",
                  "| implementation | " + " | ".join(f"{n:,}" for n in lengths)
                  + " | memory grows as | time grows as |",
                  "|---|" + "---:|" * (len(lengths) + 2)]
        notes: dict[str, int] = {}  # reason -> its number under this table
        for name in results["implementations"]:
            row = [p for p in points if p["implementation"] == name]
            cells = {p["n"]: _cell(p, notes) for p in row}
            lines.append(f"| {name} | " + " | ".join(cells.get(n, "") for n in lengths)
                         + f" | {_growth(row, 'memory_mb')} | {_growth(row, 'time_s')} |")
        lines += [""] + [f"- [{number}] {reason}" for reason, number in notes.items()] + ([""] if notes else [])
        lines += [f"`{name}` does not read the pattern: its row is the one measured under {first}.\n"
                  for name, first in _repeated_rows(points).items()]
    return "\n".join(lines + [LEGEND, ""])


def _growth(row: list[dict], key: str) -> str:
    """``N^k`` between the two largest N of ``row`` that ran, k to one decimal; '' with fewer than two."""
    done = sorted((p["n"], p[key]) for p in row if p["status"] == "ok" and p[key] > 0)
    if len(done) < 2:
        return ""
    (n0, v0), (n1, v1) = done[-2:]
    return f"N^{math.log(v1 / v0) / math.log(n1 / n0):.1f}"


def _repeated_rows(points: list[dict]) -> dict[str, str]:
    """implementation -> the pattern it ran under, for the rows of ``points`` that repeat another pattern's."""
    return {p["implementation"]: p["same_as"] for p in points if p.get("same_as") not in (None, p["pattern_label"])}


def _cell(point: dict, notes: dict[str, int]) -> str:
    """The table cell of one point; a failure's reason goes into ``notes`` and the cell points at it."""
    status = point["status"]
    if status == "ok":
        single = point.get("measured", "").startswith("warm-up")
        return f"{point['time_s']:.3g} / {point['memory_mb']:,.0f}" + ("*" if single else "")
    if status == "skipped":
        return "-"
    shown = "n/a" if status == "unavailable" else status
    reason = f"`{point['implementation']}` {shown}: {point.get('error') or 'no reason recorded'}"
    return f"{shown} [{notes.setdefault(reason, len(notes) + 1)}]"
