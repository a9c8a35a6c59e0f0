"""DESIGN's tolerance rule (FlashAttention's): a kernel's error against the float64 reference may
be at most twice the error of the same computation done by torch in the kernel's dtype, plus a
small floor.

Importing this module also warms float64 ``torch.exp`` up (``warm_up_float64_exp``): tests/conftest.py
imports it before any test module, and the processes the tests start that compare in float64 (the gloo
ranks of tests/test_distributed.py) import it too.
"""
from __future__ import annotations

import torch

FLOORS = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}  # the rule's floor per kernel dtype


def assert_within_rule(name: str, actual: torch.Tensor, oracle: torch.Tensor, baseline: torch.Tensor,
                       floor: float = 1e-5) -> None:
    """``actual``: the kernel; ``oracle``: float64 reference; ``baseline``: torch in the kernel's dtype."""
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    oracle = oracle.double()
    error = (actual.double() - oracle).abs().max().item()
    allowed = 2 * (baseline.double() - oracle).abs().max().item() + floor
    assert error <= allowed, f"{name}: max error {error:.3e} > allowed {allowed:.3e} (2 x torch's error + {floor:g})"


def warm_up_float64_exp() -> None:
    """One float64 ``torch.exp`` call, before any float64 comparison runs in this process.

    On some Intel Xeons with torch 2.13's CPU build, the first float64 ``torch.exp`` call of a process is
    sometimes less accurate than later ones: a relative error of 3.3e-9 against numpy's exp in about half of
    fresh processes, exact afterwards (issue 23; seen as a reference-backend output 1.76e-9 off on its first
    call). The float64 comparisons (1e-9 to 1e-12) would then fail at random, so the first call is spent here,
    on 65,537 values: past torch's parallel grain size (32,768) and with a tail after the vectorised loop, so
    each of those paths has run once. tests/test_fp64_first_exp.py records whether this CPU shows it.
    """
    torch.exp(torch.linspace(-30.0, 30.0, 65_537, dtype=torch.float64))


warm_up_float64_exp()  # on import: see the module docstring
