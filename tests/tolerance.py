"""DESIGN's tolerance rule (FlashAttention's): a kernel's error against the float64 reference may
be at most twice the error of the same computation done by torch in the kernel's dtype, plus a
small floor."""
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
