"""The results of a sweep as files: results.json, results.md (one table per pattern), time.png, memory.png.

>>> results = {"patterns": {"p": "Local(1)"}, "implementations": {"x": ""},
...            "points": [{"pattern_label": "p", "implementation": "x", "n": 1024, "status": "ok",
...                        "time_s": 0.5, "memory_mb": 3.0}]}
>>> print(tables(results).splitlines()[2])
| implementation | 1,024 |
"""
from __future__ import annotations

from pathlib import Path

from .results import write_results

LEGEND = ("Cells: time (s) / memory (MB); `*` = too slow to repeat, the warm-up call was measured (its memory "
          "includes the set-up); `oom` = out of memory, `timeout` = ran past the time limit, `error` = failed, "
          "`-` = skipped after `oom` or `timeout` at a smaller N, `n/a` = cannot run here; `[k]` = the reason, "
          "under the table.")


def write(results: dict, out: Path) -> list[Path]:
    """results.json, results.md, time.png and memory.png under ``out``, each replaced whole; returns their
    paths."""
    from .. import viz

    def draw(metric):
        return lambda record, path: viz.plot_bench(record, metric).savefig(path, dpi=110, bbox_inches="tight")

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
             f"{config['device']}, block {config['block_size']}, {'forward + backward' if config['backward'] else 'forward'}; "
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
                  "| implementation | " + " | ".join(f"{n:,}" for n in lengths) + " |",
                  "|---|" + "---:|" * len(lengths)]
        notes: dict[str, int] = {}  # reason -> its number under this table
        for name in results["implementations"]:
            cells = {p["n"]: _cell(p, notes) for p in points if p["implementation"] == name}
            lines.append(f"| {name} | " + " | ".join(cells.get(n, "") for n in lengths) + " |")
        lines += [""] + [f"- [{number}] {reason}" for reason, number in notes.items()] + ([""] if notes else [])
    return "\n".join(lines + [LEGEND, ""])


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
