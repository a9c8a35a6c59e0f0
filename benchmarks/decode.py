"""Decoding in bounded memory: one token at 4K..1M tokens of context, and generate() end to end.

    python benchmarks/decode.py [--quick] [--n 4K 8K ... 1M] [--dtypes float32 bfloat16] [--rounds 2]
                                [--steps 24] [--generate-tokens 64K] [--equality-tokens 2000]
                                [--out benchmarks/results]

Decode step (B=1, 8 query heads, 2 key/value heads, D=64, float32 and bfloat16, one layer's attention, CPU):
pattern ``Local(4095, 0) | Sink(first=4)`` (StreamingLLM: 4 sinks and a 4,096-token window, the
current token included). For each context length N the cache is first filled with N random
keys/values, then ``--steps`` tokens are decoded one at a time (3 more before them, untimed);
the time of a step is the cache's update with the new token's key/value plus the attention of
its query. Implementations:

- ``SparseKVCache``: ``sparse_attn.kv_cache.SparseKVCache(pattern, backend="numba")``; filled by
  chunked updates of 65,536 tokens (it evicts as it goes: filling 1M tokens never holds them all);
  a step is ``cache.attend(q, k, v)``;
- ``held keys + sdpa``: the floor for one step: exactly the 4,100 keys the pattern lets the token see
  (4 sinks and the 4,096-token window) in a preallocated buffer, the new token written into its ring slot,
  then ``scaled_dot_product_attention`` over the whole buffer, its 8 query heads grouped as 4 rows of each
  key/value head (``(1, 8, 1, D) -> (1, 2, 4, D)``: the same GQA, and faster on a CPU than ``enable_gqa=True``,
  which took 0.87 ms instead of 0.38 ms in float32 and 6.3 ms instead of 0.59 ms in bfloat16 here). It runs
  in the SparseKVCache point's process, step by step alternating which of the two goes first, so their
  ratio compares steps taken under the same load;
- ``full cache``: every past key kept, in transformers' ``DynamicLayer`` (what ``DynamicCache``
  holds per layer: what ``attn_implementation="sparse_attn"`` decodes with today), a step is
  ``sparse_attention(q, keys, values, pattern, causal=True, backend="numba")`` over all of them:
  the same outputs, memory growing with N (and a copy of the whole cache per step: ``update``
  concatenates);
- ``DynamicCache + sdpa``: the same ``DynamicLayer`` and dense ``scaled_dot_product_attention`` over
  all its keys (no pattern: the usual dense model);
- ``sliding window + sdpa``: transformers' ``DynamicSlidingWindowLayer(sliding_window=4096)``
  (Mistral's cache), dense sdpa over what it returns: the window without the sinks (a different,
  cheaper model: the comparison for memory and speed only).

transformers' layers are filled by one ``update`` with the whole prefix (their state built directly:
one copy instead of N appends).

``--dtypes``: float32 runs every implementation; bfloat16 runs SparseKVCache (with its held keys + sdpa)
and the sliding window (transformers' dense baselines over 1M bfloat16 keys take seconds a step).

Every (implementation, dtype, N) point runs in a fresh process with one thread (``OMP_NUM_THREADS`` and
``NUMBA_NUM_THREADS`` = 1: one token's attention is too small to split, and on a shared 2-core machine
two thread pools waiting for each other turned 2 ms steps into 16 ms ones); ``--rounds`` rounds run
every point once before the next round starts (interleaved), a point's time is the median over its
steps and rounds.
Cache memory = the bytes of the tensors the cache holds after the last step. A point that fails
reports n/a with the reason.

End to end: a tiny random Llama (2 layers, hidden 64, 4 query / 2 key-value heads, the pattern
registered as ``attn_implementation``) generates ``--generate-tokens`` tokens greedily from a 16-token
prompt with ``cache=SparseCache(model)`` (``past_key_values=`` before transformers 5.24), its cache
memory recorded every 256 tokens; and
the equality check: ``--equality-tokens`` greedy tokens with ``SparseCache`` equal those with a full
``DynamicCache`` (same model, pattern ``Local(255, 0) | Sink(first=4)`` so that eviction starts
after 260 tokens).

Writes ``decode.json``, ``decode.md`` and ``decode.png`` into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import sparse_attn as sa
from sparse_attn import machine
from sparse_attn.backends.numba.lowlevel import matmul_blas
from sparse_attn.bench.harness import run_json
from sparse_attn.bench.results import header, write_results

PATTERN = sa.Local(4095, 0) | sa.Sink(first=4)
PATTERN_NAME = "Local(4095, 0) | Sink(first=4)"
EQUALITY_PATTERN = sa.Local(255, 0) | sa.Sink(first=4)
EQUALITY_PATTERN_NAME = "Local(255, 0) | Sink(first=4)"
WINDOW = 4096
Q_HEADS, KV_HEADS, DIM = 8, 2, 64
FILL_CHUNK = 65_536
WARMUP_STEPS = 3
PROMPT = 16  # tokens of the generate() prompt
# one thread per point: one token's attention is too small to split, and on a shared 2-core machine two
# spinning thread pools (torch's and numba's) wait for scheduler ticks (8 ms quanta: 16 ms steps that take 2 ms)
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
IMPLS = ("SparseKVCache", "held keys + sdpa", "full cache", "DynamicCache + sdpa", "sliding window + sdpa")
PEER = "held keys + sdpa"      # timed inside the SparseKVCache point's process, interleaved step by step
DTYPES = {"float32": IMPLS, "bfloat16": ("SparseKVCache", PEER, "sliding window + sdpa")}
TARGET_RATIO = 1.5             # issue 24: a SparseKVCache step at most 1.5x the held keys + sdpa step
SIZES = (4096, 8192, 16_384, 65_536, 262_144, 1_048_576)


def token_count(text: str) -> int:
    """``"64K"`` -> 65536, ``"1M"`` -> 1048576, ``"300"`` -> 300.

    >>> [token_count(s) for s in ("4K", "1M", "300")]
    [4096, 1048576, 300]
    """
    scale = {"K": 2**10, "M": 2**20}.get(text[-1:].upper(), 1)
    return int(text[:-1] if scale > 1 else text) * scale


def short(n: int) -> str:
    """4096 -> "4K", 1048576 -> "1M", 300 -> "300".

    >>> [short(n) for n in (4096, 1048576, 300)]
    ['4K', '1M', '300']
    """
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


# ---------------------------------------------------------------------------------------- decode-step points

def _chunks(n: int, gen: torch.Generator, dtype=torch.float32):
    """The random prefix's keys and values, (1, Hkv, c, D) each, in chunks of FILL_CHUNK tokens."""
    for start in range(0, n, FILL_CHUNK):
        size = min(FILL_CHUNK, n - start)
        yield (torch.randn(1, KV_HEADS, size, DIM, generator=gen).to(dtype),
               torch.randn(1, KV_HEADS, size, DIM, generator=gen).to(dtype))    # (1, Hkv, c, D)


def _prefix(n: int, gen: torch.Generator, dtype=torch.float32):
    keys, values = zip(*_chunks(n, gen, dtype))
    return torch.cat(keys, 2), torch.cat(values, 2)                               # (1, Hkv, N, D)


def _sparse_kv_cache(n: int, gen: torch.Generator, dtype=torch.float32):
    from sparse_attn.kv_cache import SparseKVCache

    cache = SparseKVCache(PATTERN, backend="numba")
    for k, v in _chunks(n, gen, dtype):
        cache.update(k, v)
    return lambda q, k, v: cache.attend(q, k, v), lambda: cache.nbytes


def _held_keys_sdpa(n: int, gen: torch.Generator, dtype=torch.float32):
    """The held keys in a buffer of 4 sink slots and a ring of WINDOW slots (the token at position p in slot
    4 + p % WINDOW), filled from the prefix; a step writes the new token, then sdpa over the whole buffer."""
    keys, values = _prefix(n, gen, dtype)                                          # (1, Hkv, N, D)
    sinks, recent = list(range(min(n, 4))), list(range(max(4, n - WINDOW + 1), n))
    buffer_k, buffer_v = (t.new_zeros(1, KV_HEADS, 4 + WINDOW, DIM) for t in (keys, values))
    slots = torch.tensor(sinks + [4 + p % WINDOW for p in recent])
    buffer_k[:, :, slots], buffer_v[:, :, slots] = keys[:, :, sinks + recent], values[:, :, sinks + recent]
    position = n

    def step(q, k, v):
        nonlocal position
        slot = 4 + position % WINDOW
        buffer_k[:, :, slot:slot + 1], buffer_v[:, :, slot:slot + 1] = k, v
        position += 1
        rows = q.view(1, KV_HEADS, Q_HEADS // KV_HEADS, DIM)                        # (1, Hkv, G, D): GQA as rows
        return F.scaled_dot_product_attention(rows, buffer_k, buffer_v).view(q.shape)

    return step, lambda: buffer_k.nbytes + buffer_v.nbytes


def _sdpa(q, keys, values):
    return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)


def _pattern_attention(q, keys, values):
    return sa.sparse_attention(q, keys, values, PATTERN, causal=True, backend="numba")


def _transformers_layer(layer, n: int, gen: torch.Generator, attention, dtype=torch.float32):
    layer.update(*_prefix(n, gen, dtype))

    def step(q, k, v):
        keys, values = layer.update(k, v)                                         # (1, Hkv, n_k, D)
        return attention(q, keys, values)

    return step, lambda: layer.keys.nbytes + layer.values.nbytes


def _full_cache(n: int, gen: torch.Generator, dtype=torch.float32):
    from transformers.cache_utils import DynamicLayer

    return _transformers_layer(DynamicLayer(), n, gen, _pattern_attention, dtype)


def _dynamic_cache(n: int, gen: torch.Generator, dtype=torch.float32):
    from transformers.cache_utils import DynamicLayer

    return _transformers_layer(DynamicLayer(), n, gen, _sdpa, dtype)


def _sliding_window(n: int, gen: torch.Generator, dtype=torch.float32):
    from transformers.cache_utils import DynamicSlidingWindowLayer

    return _transformers_layer(DynamicSlidingWindowLayer(sliding_window=WINDOW), n, gen, _sdpa, dtype)


BUILDERS = dict(zip(IMPLS, (_sparse_kv_cache, _held_keys_sdpa, _full_cache, _dynamic_cache, _sliding_window)))


def decode_point(impl: str, n: int, steps: int, dtype_name: str = "float32") -> dict:
    """Fill ``impl``'s cache with ``n`` tokens, then time ``steps`` decode steps, in this (fresh) process; the
    SparseKVCache point times the held keys + sdpa step beside each of its steps (``peer_samples_s``)."""
    gen, dtype = torch.Generator().manual_seed(0), getattr(torch, dtype_name)
    if impl != "SparseKVCache":
        import transformers.cache_utils  # noqa: F401  (imported before the fill is timed)
    start = time.perf_counter()
    step, nbytes = BUILDERS[impl](n, gen, dtype)
    fill_s = time.perf_counter() - start
    steps_of = {impl: step}
    if impl == "SparseKVCache":
        steps_of[PEER], peer_bytes = BUILDERS[PEER](n, torch.Generator().manual_seed(0), dtype)
    times = {name: [] for name in steps_of}
    for i in range(WARMUP_STEPS + steps):
        q = torch.randn(1, Q_HEADS, 1, DIM, generator=gen).to(dtype)                          # (1, Hq, 1, D)
        k, v = (torch.randn(1, KV_HEADS, 1, DIM, generator=gen).to(dtype) for _ in range(2))  # (1, Hkv, 1, D)
        for name in (list(steps_of) if i % 2 else list(steps_of)[::-1]):                   # alternate who goes first
            begin = time.perf_counter()
            steps_of[name](q, k, v)
            if i >= WARMUP_STEPS:
                times[name].append(time.perf_counter() - begin)
    point = {"samples_s": times[impl], "cache_bytes": nbytes(), "fill_s": fill_s,
             "peak_rss_gib": machine.status_bytes("VmHWM") / 2**30}
    if PEER in times:
        point |= {"peer_samples_s": times[PEER], "peer_cache_bytes": peer_bytes()}
    return point


# ------------------------------------------------------------------------------------------- generate points

def tiny_llama(pattern: sa.Pattern, name: str):
    """A tiny random Llama (GQA) that runs ``pattern`` as ``attn_implementation=name``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from sparse_attn.integrations.transformers import register

    register(pattern, name=name, backend="numba")
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=256, max_position_embeddings=2**20, pad_token_id=0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=name).eval()


def _prompt():
    return torch.randint(1, 256, (1, PROMPT), generator=torch.Generator().manual_seed(0))  # (1, PROMPT)


def generate_point(tokens: int) -> dict:
    """Generate ``tokens`` tokens with SparseCache, recording its memory every 256 tokens."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from sparse_attn.integrations.transformers import CACHE_KEYWORD, SparseCache

    model = tiny_llama(PATTERN, "sparse_attn_decode_benchmark")
    cache = SparseCache(model)
    memory = []

    class RecordMemory(LogitsProcessor):
        def __call__(self, input_ids, scores):
            generated = input_ids.shape[1] - PROMPT
            if generated % 256 == 0:
                memory.append((int(input_ids.shape[1]), cache.nbytes))
            return scores

    start = time.perf_counter()
    out = model.generate(_prompt(), **{CACHE_KEYWORD: cache}, max_new_tokens=tokens, min_new_tokens=tokens,
                         do_sample=False, logits_processor=LogitsProcessorList([RecordMemory()]))
    wall = time.perf_counter() - start
    memory.append((int(out.shape[1]), cache.nbytes))
    return {"tokens": int(out.shape[1]) - PROMPT, "wall_s": wall, "memory": memory}


def equality_point(tokens: int) -> dict:
    """Greedy tokens with SparseCache and with a full DynamicCache, same model and pattern."""
    from transformers import DynamicCache

    from sparse_attn.integrations.transformers import CACHE_KEYWORD, SparseCache

    model = tiny_llama(EQUALITY_PATTERN, "sparse_attn_decode_equality")
    options = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    runs = {}
    for cache in (SparseCache(model), DynamicCache()):
        start = time.perf_counter()
        out = model.generate(_prompt(), **{CACHE_KEYWORD: cache}, **options)
        runs[type(cache).__name__] = {"tokens": out[0, PROMPT:].tolist(), "wall_s": time.perf_counter() - start}
    sparse, full = runs["SparseCache"]["tokens"], runs["DynamicCache"]["tokens"]
    differ = next((i for i, (a, b) in enumerate(zip(sparse, full)) if a != b), None)
    return {"tokens": len(sparse), "identical": sparse == full, "first_difference": differ,
            "distinct_tokens": len(set(sparse)),
            "wall_s": {name: run["wall_s"] for name, run in runs.items()}}


# ----------------------------------------------------------------------------------------------------- driver

def _child(args: list[str], limit_s: float) -> dict:
    """Run ``--point ...`` in a fresh process with one thread: its JSON, or {"status": ..., "error": why}."""
    return run_json([sys.executable, __file__, "--point", *args], limit_s, env=ONE_THREAD)


def run_decode(sizes, dtypes, rounds: int, steps: int, limit_s: float) -> list[dict]:
    rows = {(dtype, impl, n): {"impl": impl, "n": n, "dtype": dtype, "samples_s": []}
            for dtype in dtypes for n in sizes for impl in DTYPES[dtype]}
    for r in range(rounds):
        for (dtype, impl, n), row in rows.items():
            if "error" in row or impl == PEER:
                continue
            point = _child(["decode", impl, str(n), str(steps), dtype], limit_s)
            peer = rows.get((dtype, PEER, n)) if impl == "SparseKVCache" else None
            if "error" in point:
                row["error"] = point["error"]
                if peer is not None:
                    peer["error"] = point["error"]
            else:
                if peer is not None:
                    peer["samples_s"] += point.pop("peer_samples_s")
                    peer |= {"cache_bytes": point.pop("peer_cache_bytes"), "fill_s": None}
                row["samples_s"] += point.pop("samples_s")
                row |= point
            print(f"round {r + 1} {dtype:>8} {impl:>22} N={short(n):>5}: " +
                  (row.get("error") or f"{statistics.median(row['samples_s']) * 1e3:8.2f} ms/token, cache "
                                       f"{row['cache_bytes'] / 2**20:8.1f} MiB, fill {row['fill_s']:.2f} s") +
                  (f"; held keys + sdpa {statistics.median(peer['samples_s']) * 1e3:8.2f} ms/token"
                   if peer is not None and peer["samples_s"] else ""),
                  flush=True)
    for row in rows.values():
        row["per_token_s"] = statistics.median(row["samples_s"]) if row["samples_s"] and "error" not in row else None
    return list(rows.values())


def _ms(seconds) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:,.2f}"


def _mib(nbytes) -> str:
    return f"{nbytes / 2**20:,.2f}"


def _rows(record: dict) -> dict:
    return {(r.get("dtype", "float32"), r["impl"], r["n"]): r for r in record["decode"]}


def _ratio(rows: dict, dtype: str, n: int) -> float | None:
    """SparseKVCache's step over the held keys + sdpa step measured beside it (same process, same steps)."""
    ours, peer = rows.get((dtype, "SparseKVCache", n)), rows.get((dtype, PEER, n))
    if ours and peer and ours.get("per_token_s") and peer.get("per_token_s"):
        return ours["per_token_s"] / peer["per_token_s"]
    return None


def _target_lines(record: dict) -> list[str]:
    rows, lines = _rows(record), []
    for dtype in record.get("dtypes", ["float32"]):
        measured = {n: _ratio(rows, dtype, n) for n in record["sizes"] if n >= 8192}
        ratios = {n: r for n, r in measured.items() if r is not None}
        if ratios:
            worst = max(ratios.values())
            lines.append(f"- {dtype}: SparseKVCache step / held keys + sdpa step, "
                         f"{', '.join(f'{short(n)} {r:.2f}x' for n, r in ratios.items())} (target <= "
                         f"{TARGET_RATIO}x at every N from 8K): **{'met' if worst <= TARGET_RATIO else 'missed'}**")
        small, large = rows.get((dtype, "SparseKVCache", 8192)), rows.get((dtype, "SparseKVCache", 1_048_576))
        if small and large and small.get("per_token_s") and large.get("per_token_s"):
            memory = large["cache_bytes"] / small["cache_bytes"]
            lines.append(f"- {dtype}: cache memory at 1M vs 8K: {_mib(large['cache_bytes'])} MiB vs "
                         f"{_mib(small['cache_bytes'])} MiB = {memory:.3f}x (target <= 1.01x): "
                         f"**{'met' if memory <= 1.01 else 'missed'}**")
            time_ratio = large["per_token_s"] / small["per_token_s"]
            lines.append(f"- {dtype}: per-token decode time at 1M vs 8K: {_ms(large['per_token_s'])} ms vs "
                         f"{_ms(small['per_token_s'])} ms = {time_ratio:.2f}x (target <= 1.2x): "
                         f"**{'met' if time_ratio <= 1.2 else 'missed'}**")
        else:
            lines.append(f"- {dtype}: memory and time at 1M vs 8K: not measured in this run (SparseKVCache n/a at "
                         f"8K or 1M)")
    eq = record.get("equality")
    if eq and "identical" in eq:
        lines.append(f"- Greedy tokens with SparseCache vs a full DynamicCache over {eq['tokens']:,} generated tokens "
                     f"({EQUALITY_PATTERN_NAME}): **{'met' if eq['identical'] else 'missed'}** ("
                     + ("identical" if eq["identical"] else f"first difference at token {eq['first_difference']}")
                     + ")")
    else:
        lines.append(f"- Greedy equality: n/a ({(eq or {}).get('error', 'not run')})")
    return lines


def _step_table(record: dict, dtype: str) -> list[str]:
    impls, rows = DTYPES[dtype], _rows(record)
    lines = [f"### {dtype}", "",
             "| N | " + " | ".join(f"{impl} ms/token | {impl} cache MiB" for impl in impls) + " | SparseKVCache / "
             "held keys + sdpa |", "|---:|" + "---:|" * (2 * len(impls) + 1)]
    for n in record["sizes"]:
        cells = []
        for impl in impls:
            row = rows[(dtype, impl, n)]
            cells += [f"n/a ({row['error']})", ""] if "error" in row else \
                     [_ms(row["per_token_s"]), _mib(row["cache_bytes"])]
        ratio = _ratio(rows, dtype, n)
        lines.append(f"| {short(n)} | " + " | ".join(cells) + f" | {'n/a' if ratio is None else f'{ratio:.2f}x'} |")
    return lines


def _fill_table(record: dict, rows: dict) -> list[str]:
    lines = ["Filling the cache with N random tokens (chunked updates of 65,536 tokens for SparseKVCache, one "
             "update with the whole prefix for transformers' layers), seconds, float32:", "",
             "| N | " + " | ".join(i for i in IMPLS if i != PEER) + " |", "|---:|" + "---:|" * (len(IMPLS) - 1)]
    for n in record["sizes"]:
        cells = ["n/a" if "error" in rows[("float32", impl, n)] else f"{rows[('float32', impl, n)]['fill_s']:.2f}"
                 for impl in IMPLS if impl != PEER]
        lines.append(f"| {short(n)} | " + " | ".join(cells) + " |")
    return lines


def markdown(record: dict) -> str:
    m, dtypes = record["machine"], record.get("dtypes", ["float32"])
    lines = [
        "# Decoding in bounded memory", "",
        f"`{record['command']}`", "",
        f"Machine: {m['cpu']}" + (f" ({m['cpu_kind']})" if m.get("cpu_kind") else "")
        + f", {m['cores']} cores, torch {m['torch']}, numba {m['numba']}"
        + (f" (float32 matmuls on {m['numba_blas']})" if "numba_blas" in m else "") + ", transformers "
        f"{m['transformers']}; load average {m['loadavg_before']} before, {m['loadavg_after']} after (the machine "
        f"is shared: compare within this run). Wall time {record['wall_s']:.0f} s.", "",
        "## One decode step", "",
        f"B=1, {Q_HEADS} query heads, {KV_HEADS} key/value heads, D={DIM}, {' and '.join(dtypes)}, one layer, one "
        f"thread; pattern `{PATTERN_NAME}`. Time of one step = the cache's update with the new token plus the "
        f"attention of its query: median over {record['steps']} steps x {record['rounds']} rounds (every point in a "
        f"fresh process, rounds interleaved). `held keys + sdpa` is the floor: sdpa over exactly the "
        f"{4 + WINDOW:,} keys the token may see, in a preallocated buffer, timed in the SparseKVCache point's "
        f"process with its steps interleaved (the ratio column compares the two). Cache = bytes of the keys and "
        f"values held after the last step. `DynamicCache + sdpa` is dense attention (no pattern); `sliding window + "
        f"sdpa` keeps a {WINDOW}-token window without the sinks.", "",
    ]
    for dtype in dtypes:
        lines += [*_step_table(record, dtype), ""]
    rows = _rows(record)
    sparse, peer = rows.get(("float32", "SparseKVCache", max(record["sizes"]))), rows.get(
        ("float32", PEER, max(record["sizes"])))
    if sparse and peer and sparse.get("per_token_s") and peer.get("per_token_s"):
        lines += [f"At N={short(max(record['sizes']))} (float32) SparseKVCache's step takes "
                  f"{_ms(sparse['per_token_s'])} ms against {_ms(peer['per_token_s'])} ms for sdpa over the held "
                  f"keys: the attention itself is that sdpa call, with no mask (the pattern's retention says that "
                  f"one new query attends every key the cache holds, so nothing is evaluated at the held positions); "
                  f"the rest is the step's Python: the update (eviction, ring slot, write), the argument checks and "
                  f"the pattern resolved for the new length (what depends on it is checked every step).", ""]
    if "float32" in dtypes:
        lines += _fill_table(record, rows)
    gen = record.get("generate") or {}
    lines += ["", "## generate() end to end", ""]
    if "memory" in gen:
        first, last = gen["memory"][0], gen["memory"][-1]
        lines.append(f"Tiny random Llama (2 layers, 4 query / 2 key-value heads, head dim 16), `{PATTERN_NAME}`, "
                     f"`cache=SparseCache(model)`: {gen['tokens']:,} tokens generated greedily in "
                     f"{gen['wall_s']:.0f} s ({gen['wall_s'] / gen['tokens'] * 1e3:.1f} ms/token, generate() "
                     f"included). Cache memory (both layers) at {first[0]:,} tokens: {_mib(first[1])} MiB; at "
                     f"{last[0]:,} tokens: {_mib(last[1])} MiB; largest {_mib(max(b for _, b in gen['memory']))} MiB "
                     f"(decode.png).")
    else:
        lines.append(f"n/a ({gen.get('error', 'not run')})")
    lines += ["", "## Targets", "", *_target_lines(record)]
    return "\n".join(lines) + "\n"


def figure(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    styles = dict(zip(IMPLS, ("o-", "D-", "s--", "^:", "v-.")))
    for dtype in record.get("dtypes", ["float32"]):
        for impl in DTYPES[dtype]:
            points = [(r["n"], r["per_token_s"] * 1e3, r["cache_bytes"] / 2**20) for r in record["decode"]
                      if r["impl"] == impl and r.get("dtype", "float32") == dtype and "error" not in r]
            if points:
                n, ms, mib = zip(*points)
                axes[0].plot(n, ms, styles[impl], label=f"{impl} ({dtype})", alpha=1.0 if dtype == "float32" else 0.5)
                if dtype == "float32":
                    axes[1].plot(n, mib, styles[impl], label=impl)
    axes[0].set(ylabel="ms per decoded token", title="decode step")
    axes[1].set(ylabel="cache MiB", title="cache memory (float32)")
    for ax in axes[:2]:
        ax.set(xscale="log", yscale="log", xlabel="context tokens")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=6)
    gen = record.get("generate") or {}
    if "memory" in gen:
        tokens, nbytes = zip(*gen["memory"])
        axes[2].plot(tokens, [b / 2**20 for b in nbytes], "-")
    axes[2].set(xlabel="tokens (prompt + generated)", ylabel="SparseCache MiB (2 layers)",
                title="generate(): cache memory over time", ylim=(0, None))
    axes[2].grid(True, alpha=0.3)
    fig.suptitle(f"{PATTERN_NAME}: B=1, {Q_HEADS}/{KV_HEADS} heads, D={DIM}, CPU (n/a points missing, "
                 f"see decode.md)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_point(argv: list[str]) -> dict:
    if argv[0] == "decode":
        return decode_point(argv[1], int(argv[2]), int(argv[3]), argv[4])
    if argv[0] == "generate":
        return generate_point(int(argv[1]))
    return equality_point(int(argv[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="N=4K and 8K, 1 round, 8 steps, short generations")
    parser.add_argument("--n", type=token_count, nargs="+", default=list(SIZES), help="context lengths (4K, 1M)")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=list(DTYPES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--generate-tokens", type=token_count, default=65_536)
    parser.add_argument("--equality-tokens", type=int, default=2000)
    parser.add_argument("--limit", type=float, default=300.0, help="seconds per point (default 300)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--point", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.point:
        print(json.dumps(run_point(args.point)))
        return
    if args.quick:
        args.n, args.rounds, args.steps, args.generate_tokens, args.equality_tokens = [4096, 8192], 1, 8, 512, 400
    where = {**header(("torch", "numba", "transformers")), "numba_blas": matmul_blas().name}
    started = time.perf_counter()
    decode = run_decode(sorted(args.n), args.dtypes, args.rounds, args.steps, args.limit)
    equality = _child(["equality", str(args.equality_tokens)], args.limit)
    print(f"equality over {args.equality_tokens} tokens: {equality}", flush=True)
    generate = _child(["generate", str(args.generate_tokens)], 2 * args.limit)
    print(f"generate {args.generate_tokens} tokens: " + (generate.get("error") or f"{generate['wall_s']:.0f} s"),
          flush=True)
    where["loadavg_after"] = machine.load_average()
    record = {"command": " ".join(["python benchmarks/decode.py", *sys.argv[1:]]), "machine": where,
              "pattern": PATTERN_NAME, "heads": [Q_HEADS, KV_HEADS], "head_dim": DIM, "dtypes": args.dtypes,
              "sizes": sorted(args.n), "rounds": args.rounds, "steps": args.steps,
              "wall_s": time.perf_counter() - started, "decode": decode, "equality": equality, "generate": generate}
    print(write_results(args.out, "decode", record, markdown, {"decode.png": figure}))


if __name__ == "__main__":
    main()
