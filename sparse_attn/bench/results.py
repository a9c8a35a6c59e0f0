"""Benchmark results as files, for ``sparse-attn bench`` and every script in ``benchmarks/``: what a record says
of the machine, one writer (JSON, markdown, figures, each file replaced whole), ``--resume``, and how a row
records a failure.

>>> header(["no-such-package"])["no-such-package"] is None
True
>>> error_text(KeyError())
'KeyError: '
"""
from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from .. import machine


def header(packages) -> dict:
    """What a benchmark's record says of the machine: CPU model and count, platform, the versions of ``packages``,
    and the load average before the run (add ``"loadavg_after"`` when it ends)."""
    return {"cpu": machine.cpu_model(), "cpu_kind": machine.cpu_kind(), "cores": machine.cpus(),
            "platform": platform.platform(),
            **machine.versions(packages), "loadavg_before": machine.load_average()}


def error_text(error: Exception) -> str:
    """How a benchmark's row records a failure: the error's type and the first line of its message.

    >>> error_text(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\\nCUDA kernel errors ..."))
    'RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB'
    """
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"


def write_json(path: Path, record: dict) -> None:
    """``record`` as JSON at ``path`` (its folder created), replaced whole: what a sweep saves after every point."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _replace(path, lambda partial: partial.write_text(json.dumps(record, indent=1) + "\n"))


def write_results(out: Path, stem: str, record: dict, markdown: Callable[[dict], str],
                  figures: Mapping[str, Callable[[dict, Path], None]] | None = None) -> str:
    """``out/stem.json`` (the record), ``out/stem.md`` (``markdown(record)``) and each file ``out/name`` of
    ``figures`` (``draw(record, path)``); returns the markdown. Each file is replaced whole: a run killed while
    writing keeps the previous one (and may leave a hidden ``.name.partial.*`` beside it)."""
    write_json(out / f"{stem}.json", record)
    text = markdown(record)
    _replace(out / f"{stem}.md", lambda path: path.write_text(text))
    for name, draw in (figures or {}).items():
        _replace(out / name, lambda path, draw=draw: draw(record, path))
    return text


def _replace(path: Path, write) -> None:
    """``write(a path beside path)``, then move that file onto ``path`` (one rename: whole or not at all). The
    path beside keeps the suffix, which matplotlib's ``savefig`` reads the format from."""
    partial = path.with_name(f".{path.stem}.partial{path.suffix}")
    write(partial)
    os.replace(partial, path)


def resumed_rows(path: Path, setup: dict) -> list[dict]:
    """The rows of the results json at ``path`` that ``--resume`` keeps ([] if there is none); exits with a
    message naming each difference if its ``meta`` disagrees with ``setup`` on any of ``setup``'s keys.

    >>> resumed_rows(Path("no-such-results.json"), {"gpu": "NVIDIA H100 80GB HBM3"})
    []
    """
    if not path.exists():
        return []
    record = json.loads(path.read_text())
    differ = [f"{key}: {record['meta'].get(key)!r} there, {value!r} here" for key, value in setup.items()
              if record["meta"].get(key) != value]
    if differ:
        sys.exit(f"--resume: {path} was measured on another set-up ({'; '.join(differ)}). Ratios from two set-ups "
                 f"do not mix: drop --resume to start afresh, or give another --out.")
    return record["rows"]
