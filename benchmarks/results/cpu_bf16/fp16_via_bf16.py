"""Could float16 inputs use the bf16 matmuls? Their error against float64, N=1000, H=2, D=64,
``Local(256) | Global(first=16)``, next to torch's own float16 attention (the DESIGN rule allows 2x).

    python benchmarks/results/cpu_bf16/fp16_via_bf16.py          # prints one line (fp16_via_bf16.md)
"""
import torch

import sparse_attn as sa
from sparse_attn.api import sparse_attention

gen = torch.Generator().manual_seed(0)
n = 1000
layout = (sa.Local(256) | sa.Global(first=16)).layout(n, heads=2)
q, k, v = (torch.randn(1, 2, n, 64, generator=gen, dtype=torch.float64).half() for _ in range(3))  # (B, H, N, D)
oracle = sparse_attention(q.double(), k.double(), v.double(), layout, backend="reference")


def error(out):
    return (out.double() - oracle).abs().max().item()


torch_fp16 = error(sparse_attention(q, k, v, layout, backend="reference"))
numba_fp16 = error(sparse_attention(q, k, v, layout, backend="numba"))                        # in float32
via_bf16 = error(sparse_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), layout, backend="numba").half())
print(f"max error vs float64: torch float16 {torch_fp16:.2e} (rule: <= {2 * torch_fp16:.2e}); numba float16 "
      f"(computed in float32) {numba_fp16:.2e}; float16 converted to bf16 for the matmuls {via_bf16:.2e} "
      f"({via_bf16 / torch_fp16:.0f}x torch's)")
