"""ListOps from the Long Range Arena (Tay et al., ICLR 2021, Table 1), trained with this library's patterns.

    python benchmarks/listops.py [--recipe cpu|lra | --quick] [--patterns NAME ...] [--seeds 0 1 2]
                                 [--steps N] [--train N] [--device auto|cpu|cuda] [--resume | --overwrite]
                                 [--out benchmarks/results]

**Data**, generated here from the task's definition (no download): an expression of the operators MIN,
MAX, MED (the median, rounded down) and SM (the sum modulo 10) over the digits 0-9, written in prefix form
with a closing bracket, e.g. ``[MAX 2 9 [MIN 4 7 ] 0 ]`` (value 9). As LRA's generator: a node below depth
10 is an operator with probability 0.25 (LRA's ``VALUE_P = 0.25``: its code makes a node a value when a
uniform draw exceeds 0.25; read the other way, nearly every tree outgrows 2,000 tokens), else a digit;
an operator has 2-10 arguments; an expression is kept when 500 < tokens < 2000; the label is its value (10
classes). Splits of 96,000 / 2,000 / 2,000 examples in LRA; every split comes from its own seeded streams
of 1,000 examples each, so a smaller split is a prefix of a larger one (a reduced recipe trains on the
first examples of the full training set and tests on the first of its test set).

**Model**, the same for every pattern: token and learned position embeddings, pre-norm encoder layers
whose attention is :class:`sparse_attn.nn.SparseSelfAttention` with the pattern, a final LayerNorm, the
mean over each example's tokens, and a two-layer classifier; AdamW, linear warm-up and decay, gradient
clipping. Batches hold examples of similar length (sorted within pools of 50 batches), padded; each row
is passed as one document (``documents=``, -1 = padding), so that every pattern sees each example as a
sequence by itself: ``Global(last=...)`` is the example's last tokens, not the padding's.

**Patterns** (``PATTERNS``): dense attention, a local window, the Sparse Transformer's strided pattern, the
same window with the first token global (Longformer), BigBird ITC, and one of ours. For each: test accuracy
per seed, attention FLOPs per example (forward, all layers; of the allowed pairs, and of the 64 x 64 blocks
the kernels compute), training and evaluation wall time, and peak memory beyond what was held before
training (the resident set on CPU, ``max_memory_allocated`` on CUDA).

Every (pattern, seed) is written to ``listops.json``, ``listops.md`` and ``listops.png`` in ``--out`` as it
finishes; ``--resume`` keeps the rows already there (for the same recipe, device and machine) and runs the rest.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
import time
import multiprocessing
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np
import torch
from torch import nn

import sparse_attn as sa
from sparse_attn import machine
from sparse_attn.bench.results import error_text, header, resumed_rows, write_results
from sparse_attn.nn import SparseSelfAttention

# ------------------------------------------------------------------------------------------------- the data

DIGITS = tuple(range(10))
OPERATORS = ("MIN", "MAX", "MED", "SM")
PAD, CLOSE = 0, 15                     # token ids: PAD 0, digit d -> d + 1, operators 11..14, "]" 15
VOCAB = 16
CLASSES = 10
OPERATOR_P = 0.25                      # LRA's VALUE_P: a node below MAX_DEPTH is an operator with this probability
MAX_DEPTH, MAX_ARGS = 10, 10
MIN_LENGTH, MAX_LENGTH = 500, 2000     # kept when MIN_LENGTH < tokens < MAX_LENGTH
CHUNK = 1000                           # examples per seeded stream
LRA_SIZES = {"train": 96_000, "validation": 2_000, "test": 2_000}


def digit_token(digit: int) -> int:
    return digit + 1


def operator_token(index: int) -> int:
    return 11 + index


def apply(operator: str, values: list[int]) -> int:
    """An operator's value on its arguments' values.

    >>> [apply(op, [3, 8, 1, 6]) for op in OPERATORS]
    [1, 8, 4, 8]
    """
    if operator == "MIN":
        return min(values)
    if operator == "MAX":
        return max(values)
    if operator == "MED":                                       # LRA: int(np.median(values)), rounded down
        ordered, middle = sorted(values), len(values) // 2
        return ordered[middle] if len(values) % 2 else (ordered[middle - 1] + ordered[middle]) // 2
    return sum(values) % 10


class _TooLong(Exception):
    """An expression reached MAX_LENGTH tokens: it will be rejected, so its generation stops there."""


def _expression(rng: random.Random, depth: int, tokens: list[int]) -> int:
    """Append one random (sub)expression at ``depth`` (the root is depth 1) to ``tokens``; return its value."""
    if depth < MAX_DEPTH and rng.random() <= OPERATOR_P:
        count, index = rng.randint(2, MAX_ARGS), rng.randrange(len(OPERATORS))
        tokens.append(operator_token(index))
        values = [_expression(rng, depth + 1, tokens) for _ in range(count)]
        tokens.append(CLOSE)
        value = apply(OPERATORS[index], values)
    else:
        value = rng.choice(DIGITS)
        tokens.append(digit_token(value))
    if len(tokens) >= MAX_LENGTH:
        raise _TooLong
    return value


def example(rng: random.Random) -> tuple[list[int], int]:
    """One expression of MIN_LENGTH < tokens < MAX_LENGTH from ``rng`` (others are drawn and rejected), and its
    value.

    >>> tokens, label = example(random.Random(0))
    >>> MIN_LENGTH < len(tokens) < MAX_LENGTH and 0 <= label < 10
    True
    """
    while True:
        tokens = []
        try:
            value = _expression(rng, 1, tokens)
        except _TooLong:
            continue
        if len(tokens) > MIN_LENGTH:
            return tokens, value


def text(tokens) -> str:
    """Token ids as ListOps text.

    >>> text([operator_token(1), digit_token(2), digit_token(9), CLOSE])
    '[MAX 2 9 ]'
    """
    words = {digit_token(d): str(d) for d in DIGITS} | {operator_token(i): f"[{op}" for i, op in enumerate(OPERATORS)}
    return " ".join(words.get(int(t), "]") for t in tokens)


def _chunk(seed: int, split: str, index: int, count: int) -> list[tuple[list[int], int]]:
    """Examples ``index * CHUNK ..`` of a split: its own stream, seeded by (seed, split, index)."""
    rng = random.Random(f"listops/{seed}/{split}/{index}")  # str seeds hash with sha512: the same in every process
    return [example(rng) for _ in range(count)]


@dataclasses.dataclass(frozen=True)
class Split:
    """A split's examples: token ids (uint8, one array per example) and labels."""

    tokens: list[np.ndarray]
    labels: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(t) for t in self.tokens])


def generate(split: str, size: int, seed: int = 0, workers: int = 1) -> Split:
    """The first ``size`` examples of ``split`` ("train", "validation" or "test") for ``seed``.

    >>> small = generate("test", 3)
    >>> len(small.tokens), bool((small.lengths > MIN_LENGTH).all())
    (3, True)
    >>> bool((generate("test", 2).labels == small.labels[:2]).all())     # a prefix of the larger split
    True
    """
    if split not in LRA_SIZES:
        raise ValueError(f"split must be one of {', '.join(LRA_SIZES)}, got {split!r}")
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be an int >= 1, got {size!r}")
    jobs = [(seed, split, i, min(CHUNK, size - i * CHUNK)) for i in range(math.ceil(size / CHUNK))]
    if workers > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(min(workers, len(jobs))) as pool:
            chunks = list(pool.map(_chunk, *zip(*jobs)))
    else:
        chunks = [_chunk(*job) for job in jobs]
    pairs = [pair for chunk in chunks for pair in chunk]
    return Split([np.array(tokens, dtype=np.uint8) for tokens, _ in pairs],
                 np.array([label for _, label in pairs], dtype=np.int64))


def distribution(split: Split) -> dict:
    """Lengths (mean, min, median, max, counts per 250 tokens) and the labels' counts of a split."""
    lengths = split.lengths
    edges = list(range(MIN_LENGTH, MAX_LENGTH + 1, 250))
    counts, _ = np.histogram(lengths, bins=edges)
    return {"examples": len(lengths), "mean": float(lengths.mean()),
            **{name: int(np.quantile(lengths, q)) for name, q in (("min", 0), ("median", 0.5), ("max", 1))},
            "histogram": {f"{lo}-{hi}": int(c) for lo, hi, c in zip(edges, edges[1:], counts)},
            "labels": np.bincount(split.labels, minlength=CLASSES).tolist()}


def root_operator_rule(train: Split, test: Split) -> float:
    """The test accuracy of a rule that reads one token: answer, for the expression's root operator, the label
    most common under that operator in training (MIN -> 0, MAX -> 9, ...). A model that learned only this
    much scores about the same, whatever its attention reaches.

    >>> train = Split([np.array([11, 1, 15]), np.array([12, 9, 15])], np.array([0, 9]))   # [MIN 0 ], [MAX 8 ]
    >>> root_operator_rule(train, train)
    1.0
    """
    rule = {}
    for root in np.unique([t[0] for t in train.tokens]):
        under = train.labels[[t[0] == root for t in train.tokens]]
        rule[root] = np.bincount(under, minlength=CLASSES).argmax()
    answers = np.array([rule.get(t[0], 0) for t in test.tokens])
    return float((answers == test.labels).mean())


def distribution_text(name: str, info: dict) -> str:
    bars = "  ".join(f"{span}: {count}" for span, count in info["histogram"].items())
    return (f"{name}: {info['examples']:,} examples, length mean {info['mean']:.0f}, min {info['min']}, median "
            f"{info['median']}, max {info['max']}; per 250 tokens {bars}; labels 0-9 {info['labels']}")


# ------------------------------------------------------------------------------------------------ the model

PATTERNS = {                # name: (pattern, its name in LRA Table 1, LRA's ListOps accuracy)
    "transformer": (sa.Dense(), "Transformer", 36.37),
    "local": (sa.Local(128), "Local Attention", 15.82),
    "sparse-transformer": (sa.sparse_transformer(32), "Sparse Trans.", 17.07),
    "longformer": (sa.Local(128) | sa.Global(first=1), "Longformer", 35.63),
    "bigbird": (sa.bigbird(block=32, window_blocks=3, global_blocks=2, random_blocks=2), "BigBird", 36.05),
    "ours": (sa.PerHead([sa.Local(64), sa.Dilated(32, 8)]) | sa.Global(first=1), None, None),
}


class EncoderLayer(nn.Module):
    """Pre-norm: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, pattern: sa.Pattern, width: int, heads: int, mlp: int, dropout: float, backend: str):
        super().__init__()
        self.attention_norm, self.mlp_norm = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = SparseSelfAttention(width, heads, pattern, backend=backend)
        self.mlp = nn.Sequential(nn.Linear(width, mlp), nn.GELU(), nn.Dropout(dropout), nn.Linear(mlp, width))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.attention_norm(x), documents=documents))       # (B, N, E)
        return x + self.dropout(self.mlp(self.mlp_norm(x)))                                    # (B, N, E)


class ListOpsEncoder(nn.Module):
    """Tokens (B, N) and documents (B, N), one per row, -1 = padding -> logits (B, 10).

    >>> model = ListOpsEncoder(sa.Local(4), layers=1, width=16, heads=2, mlp=32, dropout=0.0, backend="reference")
    >>> tokens, documents = batch([np.array([11, 3, 4, 15]), np.array([2])])
    >>> model(tokens, documents).shape
    torch.Size([2, 10])
    """

    def __init__(self, pattern: sa.Pattern, *, layers: int, width: int, heads: int, mlp: int, dropout: float,
                 backend: str):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, width, padding_idx=PAD)
        self.positions = nn.Embedding(MAX_LENGTH, width)
        self.layers = nn.ModuleList(EncoderLayer(pattern, width, heads, mlp, dropout, backend) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.classifier = nn.Sequential(nn.Linear(width, mlp), nn.ReLU(), nn.Linear(mlp, CLASSES))

    def forward(self, tokens: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)                      # (N,)
        x = self.tokens(tokens) + self.positions(positions)                                  # (B, N, E)
        for layer in self.layers:
            x = layer(x, documents)
        real = (documents >= 0).unsqueeze(-1).to(x.dtype)                                    # (B, N, 1)
        pooled = (self.norm(x) * real).sum(1) / real.sum(1)                                  # (B, E)
        return self.classifier(pooled)                                                       # (B, 10)


def batch(examples: list[np.ndarray], device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (B, N) padded with PAD to the longest, and documents (B, N): 0 on tokens, -1 on padding."""
    lengths = [len(e) for e in examples]
    tokens = torch.full((len(examples), max(lengths)), PAD, dtype=torch.long)                # (B, N)
    for row, e in enumerate(examples):
        tokens[row, :len(e)] = torch.from_numpy(e.astype(np.int64))
    documents = sa.documents_from_lengths([[n] for n in lengths], n=max(lengths))            # (B, N)
    return tokens.to(device), documents.to(device)


def pooled_batches(lengths: np.ndarray, size: int, rng: np.random.Generator, pool: int = 50) -> list[np.ndarray]:
    """One pass over the examples in batches of ``size`` of similar length: shuffled, sorted by length within
    pools of ``pool`` batches, and the batches shuffled.

    >>> [len(b) for b in pooled_batches(np.arange(10), 4, np.random.default_rng(0))]
    [4, 2, 4]
    """
    order = rng.permutation(len(lengths))
    batches = []
    for start in range(0, len(order), size * pool):
        members = order[start:start + size * pool]
        members = members[np.argsort(lengths[members], kind="stable")]
        batches += [members[i:i + size] for i in range(0, len(members), size)]
    return [batches[i] for i in rng.permutation(len(batches))]


# --------------------------------------------------------------------------------------------- the recipe

@dataclasses.dataclass(frozen=True)
class Recipe:
    """Everything a run's numbers depend on besides the pattern and the seed."""

    train: int
    validation: int
    test: int
    steps: int
    batch: int
    lr: float = 1e-3
    warmup: float = 0.1               # fraction of the steps
    weight_decay: float = 0.01
    clip: float = 1.0
    layers: int = 2
    width: int = 64
    heads: int = 2
    mlp: int = 128
    dropout: float = 0.1
    data_seed: int = 0


RECIPES = {
    "lra": Recipe(train=96_000, validation=2_000, test=2_000, steps=5_000, batch=32),
    "cpu": Recipe(train=9_600, validation=200, test=2_000, steps=600, batch=16),
    "quick": Recipe(train=16, validation=8, test=16, steps=2, batch=8),
}
FLOPS_EXAMPLES = 200        # attention FLOPs are averaged over the first test examples (a layout per length)


def progress(iterable, total: int, label: str):
    """tqdm when it is installed, else a line at every tenth."""
    try:
        from tqdm import tqdm
    except ImportError:
        def lines():
            for i, item in enumerate(iterable, 1):
                yield item
                if i % max(1, total // 10) == 0 or i == total:
                    print(f"{label}: {i}/{total}", flush=True)
        return lines()
    return tqdm(iterable, total=total, desc=label, leave=False, dynamic_ncols=True)


def schedule(recipe: Recipe):
    """The learning-rate factor at each step: linear warm-up over ``warmup`` of the steps, then linear decay."""
    warmup = max(1, round(recipe.warmup * recipe.steps))
    return lambda step: min((step + 1) / warmup, max(0.0, (recipe.steps - step) / max(1, recipe.steps - warmup)))


def train(model: nn.Module, data: Split, recipe: Recipe, seed: int, device: str, label: str) -> list[float]:
    """``recipe.steps`` AdamW steps on ``data``; the loss of every step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(recipe))
    rng, lengths, batches, losses = np.random.default_rng(seed), data.lengths, [], []
    model.train()
    bar = progress(range(recipe.steps), recipe.steps, label)
    for _ in bar:
        if not batches:
            batches = pooled_batches(lengths, recipe.batch, rng)
        members = batches.pop()
        tokens, documents = batch([data.tokens[i] for i in members], device)
        labels = torch.from_numpy(data.labels[members]).to(device)
        loss = nn.functional.cross_entropy(model(tokens, documents), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), recipe.clip)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{statistics.fmean(losses[-20:]):.3f}")
    return losses


@torch.no_grad()
def accuracy(model: nn.Module, data: Split, size: int, device: str) -> float:
    """The fraction of ``data`` the model labels right, in batches of ``size`` examples sorted by length."""
    model.eval()
    order = np.argsort(data.lengths, kind="stable")
    right = 0
    for start in range(0, len(order), size):
        members = order[start:start + size]
        tokens, documents = batch([data.tokens[i] for i in members], device)
        right += int((model(tokens, documents).argmax(-1).cpu().numpy() == data.labels[members]).sum())
    return right / len(order)


def attention_flops(pattern: sa.Pattern, lengths: np.ndarray, recipe: Recipe) -> dict:
    """Attention FLOPs of one forward pass per example (all layers), averaged over ``lengths``: of the pairs the
    pattern allows (4 x head_dim per pair and head: QK^T and PV), and of the 64 x 64 blocks the kernels compute;
    and the density (allowed pairs / n^2).

    >>> flops = attention_flops(sa.Dense(), np.array([600, 1000]), RECIPES["quick"])   # 2 layers, 2 heads of 32
    >>> flops["allowed_flops"] == 2 * 4 * 32 * 2 * (600**2 + 1000**2) / 2, flops["density"]
    (True, 1.0)
    """
    head_dim = recipe.width // recipe.heads
    allowed, computed, density = [], [], []
    for n, count in zip(*np.unique(lengths, return_counts=True)):
        layout = pattern.layout(int(n), heads=recipe.heads)
        pairs = layout.allowed_pairs()
        allowed += [4 * head_dim * pairs * recipe.layers] * count
        computed += [layout.flops(head_dim) * recipe.layers] * count
        density += [pairs / (recipe.heads * int(n) ** 2)] * count
    return {"allowed_flops": float(np.mean(allowed)), "computed_flops": float(np.mean(computed)),
            "density": float(np.mean(density))}


# --------------------------------------------------------------------------------------------------- a run

def encoder(name: str, recipe: Recipe, device: str) -> ListOpsEncoder:
    return ListOpsEncoder(PATTERNS[name][0], layers=recipe.layers, width=recipe.width, heads=recipe.heads,
                          mlp=recipe.mlp, dropout=recipe.dropout, backend="auto").to(device)


def warm_up(name: str, recipe: Recipe, device: str) -> None:
    """A training step of a throwaway model on two short random sequences: numba's JIT compilation or triton's
    happens here, outside the time and memory of the run."""
    rng = np.random.default_rng(0)
    tokens, documents = batch([rng.integers(1, VOCAB, n).astype(np.uint8) for n in (130, 200)], device)
    encoder(name, recipe, device)(tokens, documents).sum().backward()


def run_one(name: str, seed: int, data: dict[str, Split], recipe: Recipe, device: str) -> dict:
    """Train and test one (pattern, seed): its row of the results."""
    warm_up(name, recipe, device)
    torch.manual_seed(seed)
    model = encoder(name, recipe, device)
    cuda = device == "cuda"
    before = torch.cuda.memory_allocated() if cuda else machine.status_bytes("VmRSS")
    torch.cuda.reset_peak_memory_stats() if cuda else machine.reset_peak_rss()
    start = time.perf_counter()
    losses = train(model, data["train"], recipe, seed, device, f"{name} seed {seed}")
    trained = time.perf_counter()
    test = accuracy(model, data["test"], 2 * recipe.batch, device)
    validation = accuracy(model, data["validation"], 2 * recipe.batch, device)
    tested = time.perf_counter()
    peak = torch.cuda.max_memory_allocated() if cuda else machine.status_bytes("VmHWM")
    return {"pattern": name, "seed": seed, "test_accuracy": test, "validation_accuracy": validation,
            "final_loss": statistics.fmean(losses[-max(1, len(losses) // 10):]), "train_s": trained - start,
            "eval_s": tested - trained, "peak_memory_mb": (peak - before) / 2**20}


def summary(rows: list[dict]) -> dict[str, dict]:
    """Per pattern: the mean and spread of its seeds' test accuracies (in %)."""
    by_pattern = {}
    for row in rows:
        by_pattern.setdefault(row["pattern"], []).append(row)
    out = {}
    for name, runs in by_pattern.items():
        accs = [100 * r["test_accuracy"] for r in runs]
        out[name] = {"mean": statistics.fmean(accs), "std": statistics.stdev(accs) if len(accs) > 1 else None,
                     "seeds": [r["seed"] for r in runs], "accuracies": accs, **runs[0]["flops"],
                     "train_s": statistics.fmean(r["train_s"] for r in runs),
                     "eval_s": statistics.fmean(r["eval_s"] for r in runs),
                     "peak_memory_mb": max(r["peak_memory_mb"] for r in runs)}
    return out


def targets(record: dict) -> list[str]:
    """Issue 28's targets, each met or missed, from the patterns this run has."""
    s = summary([r for r in record["rows"] if "error" not in r])
    lines = []
    for name in ("local", "sparse-transformer"):
        if name in s:
            verdict = "met" if s[name]["mean"] <= 25 else "missed"
            lines.append(f"- `{name}` <= 25%: {s[name]['mean']:.2f}%: **{verdict}**")
    for name in ("longformer", "bigbird"):
        if name in s and "transformer" in s:
            ok = s[name]["mean"] >= 30 and s[name]["mean"] >= s["transformer"]["mean"] - 2
            lines.append(f"- `{name}` >= 30% and within 2 points of dense ({s['transformer']['mean']:.2f}%): "
                         f"{s[name]['mean']:.2f}%: **{'met' if ok else 'missed'}**")
    if "ours" in s and "bigbird" in s:
        ok = s["ours"]["mean"] >= s["bigbird"]["mean"] and s["ours"]["allowed_flops"] <= s["bigbird"]["allowed_flops"]
        lines.append(f"- `ours` at least as accurate as `bigbird` at no more attention FLOPs: {s['ours']['mean']:.2f}% "
                     f"at {s['ours']['allowed_flops'] / 1e9:.3g} GFLOPs vs {s['bigbird']['mean']:.2f}% at "
                     f"{s['bigbird']['allowed_flops'] / 1e9:.3g} GFLOPs: **{'met' if ok else 'missed'}**")
    return lines or ["- not enough patterns in this run to judge"]


def setup_lines(record: dict) -> list[str]:
    """Where it ran, the recipe and the data, for ``listops.md``."""
    m, r = record["machine"], record["recipe"]
    where = m.get("gpu") or f"{m['cpu']}, {m['cores']} cores"
    return [
        f"`{record['command']}`", "",
        f"Machine: {where}; torch {m['torch']}, numba {m['numba']}, triton {m['triton']}; device `{record['device']}`, "
        f"backend `auto` ({'triton' if record['device'] == 'cuda' else 'numba'}), float32; load average (1 min) "
        f"{m['loadavg_before'][0]} before, {m['loadavg_after'][0]} after the last run. Recipe "
        f"`{record['recipe_name']}`.", "",
        f"Recipe: {r['train']:,} training examples, {r['validation']:,} validation, {r['test']:,} test; {r['steps']:,} "
        f"steps of batch {r['batch']} (AdamW, lr {r['lr']:g}, {r['warmup']:.0%} linear warm-up then linear decay, "
        f"weight decay {r['weight_decay']:g}, gradient clipping {r['clip']:g}); {r['layers']} pre-norm layers, width "
        f"{r['width']}, {r['heads']} heads, MLP {r['mlp']}, dropout {r['dropout']:g}, learned positions, mean pooling; "
        f"data seed {r['data_seed']}.", "",
        "Data (lengths in tokens, labels 0-9):", "",
        *[f"- {distribution_text(split, info)}" for split, info in record["data"].items()],
    ]


def table_lines(record: dict) -> list[str]:
    """One row per pattern beside LRA Table 1, then the runs that failed."""
    lines = ["| pattern | expression | LRA Table 1 | test accuracy % (mean ± std) | per seed | attention "
             "GFLOPs/example (allowed / computed) | density | train s | test s | peak MB |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    s = summary([row for row in record["rows"] if "error" not in row])
    for name, (pattern, lra_name, lra) in PATTERNS.items():
        if name in s:
            p = s[name]
            spread = f" ± {p['std']:.2f}" if p["std"] is not None else ""
            expression = repr(pattern).replace("|", "\\|")                    # a pipe ends a table cell
            lines.append(f"| {name} | `{expression}` | {f'{lra:.2f} ({lra_name})' if lra else 'not in LRA'} | "
                         f"{p['mean']:.2f}{spread} | {', '.join(f'{a:.1f}' for a in p['accuracies'])} | "
                         f"{p['allowed_flops'] / 1e9:.3g} / {p['computed_flops'] / 1e9:.3g} | {p['density']:.1%} | "
                         f"{p['train_s']:.0f} | {p['eval_s']:.0f} | {p['peak_memory_mb']:.0f} |")
    failed = [f"- `{row['pattern']}` seed {row['seed']} failed: {row['error']}" for row in record["rows"]
              if "error" in row]
    return lines + ([""] + failed if failed else [])


def markdown(record: dict) -> str:
    test = record["data"]["test"]
    spent = sum(row["train_s"] + row["eval_s"] for row in record["rows"] if "error" not in row)
    notes = (f"Training and testing took {spent / 60:.1f} min in all (train s, test s: the mean over seeds; test s "
             f"includes the validation set). Always answering the test set's most common label scores "
             f"{max(test['labels']) / test['examples']:.1%}; answering each root operator's most common training "
             f"label (a rule that reads the first token alone) scores {record['root_operator_rule']:.2%}. GFLOPs: one forward pass over one test example, all "
             f"layers, averaged over the lengths of the first {min(FLOPS_EXAMPLES, test['examples'])} test examples; "
             f"allowed = 4 x head_dim per allowed pair and head, computed = the same over every pair of the 64 x 64 "
             f"blocks the kernels compute. Peak MB: beyond what the process held before training.")
    shared = max((row.get("concurrent_runs", 1) for row in record["rows"]), default=1)
    if shared > 1:
        notes += (f" Up to {shared} runs went at a time, each in its own process on the same device with its share "
                  f"of the CPUs, so train s and test s are wall times under that sharing.")
    lines = ["# ListOps (Long Range Arena) with sparse_attn's patterns", "", *setup_lines(record), "",
             *table_lines(record), "", notes, "", "## Targets (issue 28)", "", *targets(record), "",
             "![accuracy against attention FLOPs](listops.png)"]
    return "\n".join(lines) + "\n"


def figure(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    s = summary([row for row in record["rows"] if "error" not in row])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, p in s.items():
        x = p["allowed_flops"] / 1e9
        drawn = ax.errorbar(x, p["mean"], yerr=p["std"] or 0, fmt="o", capsize=3, label=name)
        if PATTERNS[name][2]:
            ax.plot(x, PATTERNS[name][2], "x", color=drawn.lines[0].get_color())
    ax.plot([], [], "x", color="gray", label="LRA Table 1, at this run's FLOPs")
    majority = 100 * max(record["data"]["test"]["labels"]) / record["data"]["test"]["examples"]
    ax.axhline(majority, color="gray", linestyle=":", label="most common label")
    ax.axhline(100 * record["root_operator_rule"], color="gray", linestyle="--",
               label="root operator's most common label")
    ax.set(xscale="log", xlabel="attention GFLOPs per example (forward, allowed pairs)", ylabel="test accuracy %",
           title=f"ListOps, recipe {record['recipe_name']} ({record['device']})")
    ax.xaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
    ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_data(recipe: Recipe) -> dict[str, Split]:
    """The recipe's splits, generated on every CPU, with their distributions printed."""
    start = time.perf_counter()
    data = {split: generate(split, getattr(recipe, split), recipe.data_seed, machine.cpus()) for split in LRA_SIZES}
    print(f"generated {sum(len(d.tokens) for d in data.values()):,} examples in {time.perf_counter() - start:.1f} s",
          flush=True)
    for split, d in data.items():
        print(distribution_text(split, distribution(d)), flush=True)
    first = data["test"]
    print(f"the first test example: {text(first.tokens[0][:24])} ... (label {first.labels[0]})", flush=True)
    return data


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--recipe", choices=("cpu", "lra"), help="default: lra on CUDA, cpu otherwise")
    size.add_argument("--quick", action="store_true", help="a smoke run of about a minute (tiny sizes, 2 steps)")
    parser.add_argument("--patterns", nargs="+", choices=list(PATTERNS), default=list(PATTERNS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--steps", type=int, help="replace the recipe's steps")
    parser.add_argument("--train", type=int, help="replace the recipe's training examples")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--jobs", type=int, default=1,
                        help="(pattern, seed) runs at a time, each in its own process with its share of the CPUs "
                             "(on a GPU the tiny model leaves it mostly idle; wall times are then shared)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    again = parser.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="keep the rows in --out's listops.json, run the rest")
    again.add_argument("--overwrite", action="store_true", help="replace an existing listops.json")
    return parser.parse_args()


def main() -> None:
    args = arguments()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    name = "quick" if args.quick else args.recipe or ("lra" if device == "cuda" else "cpu")
    changes = {field: getattr(args, field) for field in ("steps", "train") if getattr(args, field) is not None}
    recipe = dataclasses.replace(RECIPES[name], **changes)
    path = args.out / "listops.json"
    if path.exists() and not (args.resume or args.overwrite):
        sys.exit(f"{path} exists: add --resume to keep its rows and run the rest, --overwrite to replace it, or give "
                 f"another --out")
    where = header(("torch", "numba", "triton")) | (machine.gpu() if device == "cuda" else {})
    setup = {"recipe": dataclasses.asdict(recipe), "device": device, "on": where.get("gpu", where["cpu"])}
    rows = [row for row in resumed_rows(path, setup) if "error" not in row] if args.resume else []
    torch.set_num_threads(machine.cpus())
    data = load_data(recipe)
    record = {"command": " ".join(["python benchmarks/listops.py", *sys.argv[1:]]), "machine": where,
              "recipe_name": name, "recipe": setup["recipe"], "device": device, "meta": setup,
              "data": {split: distribution(d) for split, d in data.items()},
              "root_operator_rule": root_operator_rule(data["train"], data["test"]), "rows": rows}
    done = {(row["pattern"], row["seed"]) for row in rows}
    todo = [(pattern, seed) for pattern in args.patterns for seed in args.seeds if (pattern, seed) not in done]
    for pattern, seed in sorted(done):
        print(f"{pattern} seed {seed} is in {path} already", flush=True)
    flops = {pattern: attention_flops(PATTERNS[pattern][0], data["test"].lengths[:FLOPS_EXAMPLES], recipe)
             for pattern in {pattern for pattern, _ in todo}}
    for row in finished_runs(todo, data, recipe, device, args.jobs):
        row = row if "error" in row else row | {"flops": flops[row["pattern"]], "concurrent_runs": args.jobs}
        print(json.dumps(row), flush=True)
        rows.append(row)
        where["loadavg_after"] = machine.load_average()
        write_results(args.out, "listops", record, markdown, {"listops.png": figure})
    print(markdown(record))


def finished_runs(todo: list[tuple[str, int]], data: dict[str, Split], recipe: Recipe, device: str, jobs: int):
    """Each (pattern, seed)'s row as it finishes (an ``error`` row for one that raised): in this process one
    after another, or ``jobs`` at a time in processes of their own, each given ``cpus() // jobs`` threads."""
    if jobs <= 1:
        for pattern, seed in todo:
            yield guarded_run(pattern, seed, data, recipe, device, machine.cpus())
        return
    threads = max(1, machine.cpus() // jobs)
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(guarded_run, pattern, seed, data, recipe, device, threads) for pattern, seed in todo]
        for future in as_completed(futures):
            yield future.result()


def guarded_run(pattern: str, seed: int, data: dict[str, Split], recipe: Recipe, device: str, threads: int) -> dict:
    """``run_one`` with ``threads`` torch threads; a run that raises gives a row naming its error."""
    torch.set_num_threads(threads)
    try:
        return run_one(pattern, seed, data, recipe, device)
    except (RuntimeError, ValueError) as error:
        return {"pattern": pattern, "seed": seed, "error": error_text(error)}


if __name__ == "__main__":
    main()
