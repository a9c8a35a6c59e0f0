"""Context parallelism: one attention layer run sequence-parallel across 2 local processes.

    python examples/context_parallel.py            # a few seconds on 2 CPU cores

A ``SparseSelfAttention`` layer (E=64, 4 query heads, 2 key/value heads, pattern
``Local(64) | Global(first=4)``) over a 1,000-token sequence, split into two unequal shards (600 and
400 tokens). Each process (gloo on 127.0.0.1, started with torch.multiprocessing) holds its shard of
the input: the projections are per token, so they run on the shard as they are; only the attention
needs other tokens, and ``sparse_attn.distributed.sparse_attention`` fetches exactly those (the
window's halo from the neighbour, and the four global tokens' rows combined across ranks). Forward
and backward; the parameter gradients are summed over the ranks (as data or context parallel training
does), and every rank checks its output shard, its input gradient and the summed parameter gradients
against the same layer run in one process, in float64.

On GPUs, the same code runs under ``torchrun --nproc-per-node 8 train.py`` with
``init_process_group("nccl")``, each rank slicing its shard of the sequence (see docs/distributed.md).
"""
from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from einops import rearrange

import sparse_attn as sa
from sparse_attn.distributed import sparse_attention
from sparse_attn.nn import SparseSelfAttention

WORLD = 2
SHARDS = (600, 400)                        # tokens per rank, in rank order (unequal is fine)
EMBED, HEADS, KV_HEADS = 64, 4, 2
PATTERN = sa.Local(64) | sa.Global(first=4)
TOLERANCE = 1e-8                           # float64: any wrong pair is off by far more


def make_layer_and_data():
    """The layer, an input (1, N, E) and a loss weight (1, N, E), the same in every process (seeded)."""
    torch.manual_seed(0)
    layer = SparseSelfAttention(EMBED, HEADS, PATTERN, num_kv_heads=KV_HEADS).double()
    x = torch.randn(1, sum(SHARDS), EMBED, dtype=torch.float64)                  # (B, N, E)
    weight = torch.randn(1, sum(SHARDS), EMBED, dtype=torch.float64)             # (B, N, E)
    return layer, x, weight


def sequence_parallel_forward(layer: SparseSelfAttention, x_shard: torch.Tensor) -> torch.Tensor:
    """The layer on this rank's shard (B, n_rank, E) -> (B, n_rank, E): projections here, attention across ranks."""
    q = rearrange(layer.q_proj(x_shard), "b n (h d) -> b h n d", h=layer.num_heads)        # (B, H, n_rank, D)
    k = rearrange(layer.k_proj(x_shard), "b n (h d) -> b h n d", h=layer.num_kv_heads)     # (B, Hkv, n_rank, D)
    v = rearrange(layer.v_proj(x_shard), "b n (h d) -> b h n d", h=layer.num_kv_heads)     # (B, Hkv, n_rank, D)
    out = sparse_attention(q, k, v, layer.pattern)                                          # (B, H, n_rank, D)
    return layer.out_proj(rearrange(out, "b h n d -> b n (h d)"))                         # (B, n_rank, E)


def single_process_reference(layer, x, weight):
    """Output (B, N, E), input gradient (B, N, E) and parameter gradients of the whole layer in one process."""
    x = x.clone().requires_grad_()
    out = layer(x)
    grads = torch.autograd.grad((out * weight).sum(), [x, *layer.parameters()])
    return out.detach(), grads[0], grads[1:]


def worker(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        layer, x, weight = make_layer_and_data()
        lo, hi = sum(SHARDS[:rank]), sum(SHARDS[:rank + 1])
        x_shard = x[:, lo:hi].clone().requires_grad_()                             # (B, n_rank, E)
        out_shard = sequence_parallel_forward(layer, x_shard)
        (out_shard * weight[:, lo:hi]).sum().backward()   # this rank's part of the loss: sum of the parts = loss
        for p in layer.parameters():
            dist.all_reduce(p.grad)                                                 # every rank's contribution

        out, grad_x, grad_params = single_process_reference(layer, x, weight)
        errors = torch.tensor([(out_shard.detach() - out[:, lo:hi]).abs().max(),
                               (x_shard.grad - grad_x[:, lo:hi]).abs().max(),
                               max((p.grad - g).abs().max() for p, g in zip(layer.parameters(), grad_params))])
        dist.all_reduce(errors, op=dist.ReduceOp.MAX)
        if rank == 0:
            results.put(errors.tolist())
        dist.barrier()            # both ranks are done with gloo before either tears it down (else, at times: SIGABRT)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(free_port(), results), nprocs=WORLD)
    out_error, input_grad_error, param_grad_error = results.get()
    equal = max(out_error, input_grad_error, param_grad_error) <= TOLERANCE
    print(f"sequence-parallel attention layer on {WORLD} processes (shards {SHARDS[0]} + {SHARDS[1]} tokens, "
          f"{PATTERN!r}) {'equals' if equal else 'DIFFERS FROM'} the single-process layer: max |difference| "
          f"output {out_error:.1e}, input gradient {input_grad_error:.1e}, parameter gradients {param_grad_error:.1e}")
    if not equal:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
