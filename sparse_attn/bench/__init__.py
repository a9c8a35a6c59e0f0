"""The benchmark of time and peak memory of attention versus sequence length (`sparse-attn bench`).

>>> from pathlib import Path
>>> from sparse_attn import bench
>>> from sparse_attn.expression import parse_pattern
>>> patterns = {"longformer": parse_pattern(bench.PATTERNS["longformer"])[0]}
>>> results = bench.sweep(patterns, [1024, 2048], ["sparse_attn-numba", "sdpa-dense"])  # doctest: +SKIP
>>> bench.write(results, Path("bench-out"))  # results.json, results.md, time.png, memory.png  # doctest: +SKIP

The one benchmark harness: ``sparse-attn bench`` runs on it, and so does every script in ``benchmarks/``.
One module per job:

- ``config``: the patterns and implementations by name, the default and ``--quick`` settings;
- ``peers``: every implementation a benchmark compares (this library, FlexAttention, dense and masked SDPA,
  HF Longformer), each built once and returned as the call a benchmark times;
- ``implementations``: whether each of the sweep's implementations runs here, and its peer;
- ``harness``: a point in a fresh process (``run_json``; the sweep's child, which measures time and memory
  as its docstring says), and whether CUDA survived a point;
- ``runner``: the sweep over every (pattern, implementation, N) point;
- ``results``: the files of any benchmark (JSON, markdown, figures, each replaced whole), ``--resume``, the
  machine header of a record, a failure as a row records it;
- ``report``: the sweep's results.json, results.md and figures.

What the machine is (versions, CPUs, GPU, load average, memory readings) comes from ``sparse_attn.machine``.
torch is imported inside the functions that use it, so ``sparse-attn --help`` reads ``config`` without paying
for it.
"""
from .config import DEFAULT, IMPLEMENTATIONS, PATTERNS, QUICK, Settings, settings
from .implementations import availability, unavailable_reasons
from .report import markdown, tables, write
from .runner import own_lines_missing, sweep

__all__ = ["DEFAULT", "IMPLEMENTATIONS", "PATTERNS", "QUICK", "Settings", "settings", "availability",
           "unavailable_reasons", "markdown", "tables", "write", "own_lines_missing", "sweep"]
