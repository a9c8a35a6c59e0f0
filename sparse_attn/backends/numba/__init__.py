"""The Numba CPU backend (``backend="numba"``): block-sparse flash attention on CPU tensors, forward and backward.

>>> import torch, sparse_attn as sa
>>> from sparse_attn.api import sparse_attention
>>> q = k = v = torch.randn(1, 2, 1000, 32)
>>> sparse_attention(q, k, v, sa.Local(64) | sa.Global(first=4), backend="numba").shape
torch.Size([1, 2, 1000, 32])

Algorithm
---------
Work is cut into *tasks*, one per (example, head, query block) in the forward and one per
(example of k and v, kv head, key block) in the backward.

Forward task (query block ``r`` of head ``h``, ``forward._forward_block``), FlashAttention's online softmax:

1. Walk the row's key blocks (full and partial CSR lists merged in key order) in *panels* of up
   to ``panels.PANEL_KEYS`` keys. A panel is made of *runs* of consecutive key blocks, each run one
   matmul into its columns of the panel's score tile: a Longformer row (band plus global column)
   is one panel of two runs, so its softmax is one pass and its matmuls are few and large.
2. Per panel: ``S = (scale log2(e)) q[r] @ k[run].T`` per run (BLAS sgemm/dgemm, scores in base 2
   so ``exp2`` is used), ``-inf`` where a partial block's tile is False, then per row: new max
   ``m'`` (running vectors of 16 lanes, reduced in vectors) and the key holding it, ``P = exp2(S - m')``,
   ``l = l * exp2(m - m') + sum(P)``, ``acc = acc * exp2(m - m') + P @ v[run]`` per run (the gemm
   accumulates into acc: beta = 1). A partial block alone in its run is computed only on its
   tile's span of allowed keys (a Longformer band row's global-column block: 16 of 64 keys); the
   mask sets the rest of its columns to ``-inf``.
3. ``out = acc / l``, ``lse = (m + log2 l) * ln 2`` (in float64, rounded once); the backward also
   gets ``m``, ``log2 l`` and the key of ``m``. A row with no allowed key keeps ``l = 0`` and
   returns 0 and ``lse = -inf``.

The last block may be shorter than ``block_size``: panels are clipped to ``n_k`` and the query
block to ``n_q``, so full blocks need no mask; partial tiles are already False outside.

Backward (FlashAttention-2, recomputing ``P = exp2(min(S - m, 0) - log2 l)`` from q, k and the
forward's ``m`` and ``log2 l``; ``m = +inf`` for empty rows, so their ``P`` is exactly 0): one pass
over key blocks, 5 matmuls per computed block. A parallel prologue computes, per query row,
``delta = rowsum(dO * O) - dlse`` (0 for empty rows). A task (key block ``c`` of kv head ``g``)
walks, for every query example that reads it (every example when k and v have batch 1) and every
query head of its GQA group (``backward._backward_head``), its query blocks (transposed CSR) in panels of
runs, as the forward does, and computes ``S.T = (scale log2(e)) k[c] @ q[run].T``
and ``dP.T = v[c] @ dO[run].T`` per run, ``P.T`` and ``dS.T = P.T * (dP.T - delta)`` over the panel,
then per run ``dV[c] += P.T @ dO[run]``, ``dK[c] += scale dS.T @ q[run]`` (rows the task owns) and
``dQ[run] += scale dS @ k[c]``; a partial block alone in its run is computed only on its tile's
span of allowed queries (the global rows' block: 16 of 64 queries).

Scheduling and determinism:

- Forward: ``prange`` over one worker per thread; workers take tasks from a shared counter (an
  atomic fetch-add: Numba's OpenMP ``prange`` splits iterations statically, which would give one
  thread all the heavy global rows), in heaviest-first order (rows by block count). A task owns
  its output rows, so the result does not depend on which worker ran it.
- Backward: dK and dV rows are owned by their task (k and v of batch 1: the task sums the terms
  of every example into them, so a shared k, v needs no per-example dK/dV buffer and has no
  race), but dQ rows get terms from many key blocks.
  The tasks are dealt *statically* to the workers (heaviest first, each to the least-loaded
  worker so far: a function of the layout and the thread count only), and each worker runs its
  tasks in task-id order (head by head, so a head's q, dO and dQ rows stay in cache); worker ``w``
  adds its dQ terms, in that fixed order, into its own dQ-sized buffer (``dq`` itself for worker 0), and
  the buffers are summed in worker order at the end. No atomics on data, no races, and two runs
  with the same thread count are bitwise identical (but for the process that compiles the kernels,
  whose results differ from the cached kernels' in the last bit: docs/backend-numba.md, Determinism).

Memory beyond inputs, outputs and gradients: O(N) (lse, m, log2 l and the key of m per row, delta,
task lists), per-worker scratch of two panels of ``min(block, n)`` x ``min(panels.PANEL_KEYS, n)`` (sized by
what a block and a panel can hold in this sequence, however large ``block_size`` is), and
``threads - 1`` dQ-sized buffers in the backward: O(threads x N x D). dq and the dQ buffers are
zeroed inside the kernel by the worker that owns them; a key block's dk and dv are summed in the worker's
(block, D) sums and stored once (rounded once for bf16), so bf16's dk, dv are never made in float32. The dQ
buffers and brgemm's operand copies (``bf16``) stay in a per-thread ``workspace`` between calls: rewritten every
call, they are faulted in only once. The results (out; dq, dk, dv) come from the workspace's spare result
buffers, memory of results nothing refers to any more, when one of their size is there.

Matmuls call BLAS ?gemm directly (MKL where torch exports it, else scipy's BLAS: ``lowlevel.matmul_blas``),
with alpha, beta and transposes, so there are no temporary products or extra additions; for bf16 inputs, oneDNN's brgemm
through torch (``bf16``: the kernels call its functions, which are these gemm calls when
their first argument, the bf16 operands, is None).

Precision: float32 and float64 are computed in their own dtype (float32 with a vectorisable
degree-6 ``exp2``, relative error ~1e-7, since Numba has no vector exp without SVML). bfloat16
inputs, where ``backend.bf16_matmuls`` (a CPU with native bf16 dot products, even head dim and block
size), run every matmul above on bf16 operands with float32 accumulation: q, k, v and dO as given,
P and scale * dS rounded to bf16 just before their matmuls (as torch's bf16 attention rounds them);
scores, m, l, acc, lse, delta and the gradient sums stay float32, and out, dq, dk, dv are rounded
to bf16 once, at the end. float16 inputs, and bfloat16 ones elsewhere, are computed in float32
and returned in the input dtype. Recomputing P is what
large logits punish: BLAS rounds a score a few ulps differently in the backward's matmul shapes
than in the forward's (float32; float64 agrees here), and ``exp2`` turns an absolute error of the
score into a relative error of P (with scale=1e10, 3 ulps turned P = 1 into 0). So the backward
computes S with the forward's alpha, takes ``S - m`` against the forward's exact ``m`` and
``log2 l`` separately (no rounded lse in between), sets the score of each row's maximum to ``m``
exactly (``backward._pin_maxima``: that P is then the forward's ``1 / l``), caps ``P`` at ``1 / l``, and,
for rows whose softmax is one-hot in the dtype (``l = 1``), forms that pair's ``dP - delta`` as
``dO . (v - out) + dlse`` (``backward._max_pair_grads``: exactly ``dlse``, where two large dot products
would cancel to a rounding error that dq and dk multiply by ``scale |k|``). In float32 rows with
large logits (base-2 max ``|m| >= 32``, scores of 22 and more), the pairs within 12 (base 2) of the
max get *exact* scores in both passes (``near_max.exact_near_max``, ``near_max.exact_near_max_t``: the products summed
in float64, rounded once): BLAS's few ulps of a score of 1000 differ between the forward's and the
backward's matmul shapes, so the backward's P disagreed with the forward's ``out``, ``l`` and delta,
and dq, dk, dv carried both errors (up to 4x torch's against float64 at logits of std 100-500, and
over 2x at std 5-25). Exact scores are also more accurate than torch's float32 ones. Pairs further
below the max weigh under ``2 ** -12`` of it and keep BLAS's scores; rows of ordinary logits never
look (one comparison per row).

Non-finite inputs: the result is the reference's restricted to the allowed pairs: a NaN or inf in
q, k or v reaches exactly the outputs and gradients of the pairs that meet it; an empty row stays 0,
-inf and zero gradients. The fast path cannot guarantee that alone (a masked pair inside a
computed tile multiplies 0 by the NaN in a matmul), so rows whose fast result is not finite are
recomputed by an exact path (``exact``): the reference's formulas over the row's (or key's)
allowed pairs in float64, with scores rounded to the inputs' dtype so they overflow where torch's
do. Finite inputs never take it unless a value overflows.

Score modifiers (``mods``: softcap, then ALiBi; ``mods``): each run's base-2 scores are modified
in place right after their matmul, before the mask, ``x <- c log2(e) tanh(x ln2 / c) - log2(e) slope
|i' - j|``, so the row max, its key, ``m`` and ``log2 l`` are the modified scores', and the large-logit
exact scores are modified the same way. The backward recomputes the modified ``S.T`` so, keeps
``1 - tanh^2`` per pair, and multiplies ``dS`` by it once ``backward._max_pair_grads`` is done; the exact path
applies them in float64. Without modifiers the Config's softcap is 0 and its slopes empty, and the panel loops
skip them (one test per run of scores): one compiled forward and backward per dtype serve every combination.

Code
----
``backend`` (what ``sparse_attn.backends.load("numba")`` returns: ``BLOCK_SIZE``, ``available``,
``check``, ``attention`` and the two torch custom ops), ``forward`` and ``backward`` (the kernels in
the order above), ``panels`` (walking a Segment in panels of runs, shared by both), ``near_max``
(the large-logit exact scores), ``schedule`` (task costs, heaviest-first order, the static deal),
``bundles`` (the namedtuples the kernels pass: the layout's index as they walk it, sizes and scales,
results, gradients, scratch), ``bf16`` (the bf16 matmuls and operands), ``exact`` (the exact path),
``mods`` (softcap and ALiBi on score panels and single scores), ``workspace`` (buffers reused between
calls), ``cache`` (where the compiled kernels are kept), ``notice`` (the line said when one compiles) and
``lowlevel`` (BLAS ``gemm``, ``exp2``, ``tanh``, the atomic counter, fastmath flags, BLAS threads).
"""
from . import cache

cache.install()                 # before the kernel modules: Numba picks a function's cache when it decorates it
