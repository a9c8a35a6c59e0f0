"""Long-document classification: global tokens carry information across thousands of positions.

    python examples/long_document_classification.py            # ~11 minutes on 2 shared CPU cores

Synthetic task: a 4,096-token document of random filler tokens hides two key phrases of 64
tokens, each a "yes" or a "no" marker repeated: one starts in positions 256..959, the other in the
last quarter, 2,000+ tokens apart. The label is the number of "yes" phrases (0, 1 or 2, uniform:
chance is 33%), read from the [CLS] token, so it depends on both phrases.

A tiny BERT (random init, 512 positions) is stretched to 4,096 positions with ``to_long_model``
(Longformer's recipe: tile the position embeddings, switch attention to sparse_attn) and trained
three times with the same data and seed:

- ``local``: ``Local(64)`` only. Two layers let [CLS] hear from 128 positions: it never sees a phrase.
- ``local+global``: ``Local(64) | Global(first=1)``: [CLS] is global, attends every token.
- ``dense``: every pair, through transformers' own ``sdpa`` attention (a fused kernel that fits
  in memory at this size), for reference.

Results go to ``examples/results/long_document_classification.{md,json}``.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, BertConfig

import sparse_attn as sa
from sparse_attn.backends import availability
from sparse_attn.integrations.transformers import register, to_long_model

CLS, PAD, NO, FIRST_FILLER, VOCAB, PHRASE = 2, 0, 4, 8, 12, 64  # NO + 1 is the "yes" marker
# None: dense attention through the model's own "sdpa" implementation (torch's fused CPU kernel).
PATTERNS = {"local": sa.Local(64), "local+global": sa.Local(64) | sa.Global(first=1), "dense": None}


def make_batch(batch: int, seq_len: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Documents (B, N) with one phrase in [N/16, N/4) and one in [3N/4, N); label = number of "yes" phrases."""
    ids = torch.randint(FIRST_FILLER, VOCAB, (batch, seq_len), generator=generator)       # (B, N)
    ids[:, 0] = CLS
    label = torch.randint(0, 3, (batch,), generator=generator)                          # 0, 1, 2 uniform
    first_is_yes = torch.where(label == 1, torch.randint(0, 2, (batch,), generator=generator), label.clamp(max=1))
    yes = torch.stack([first_is_yes, label - first_is_yes], 1)                           # (B, 2)
    start_a = torch.randint(seq_len // 16, seq_len // 4 - PHRASE, (batch,), generator=generator)
    start_b = torch.randint(3 * seq_len // 4, seq_len - PHRASE, (batch,), generator=generator)
    rows, offsets = torch.arange(batch)[:, None], torch.arange(PHRASE)
    ids[rows, start_a[:, None] + offsets] = (NO + yes[:, :1])
    ids[rows, start_b[:, None] + offsets] = (NO + yes[:, 1:])
    return ids, label


def train_and_evaluate(name: str, pattern: sa.Pattern, args) -> dict:
    torch.manual_seed(args.seed)
    config = BertConfig(vocab_size=VOCAB, hidden_size=args.hidden, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=2 * args.hidden, max_position_embeddings=512, num_labels=3,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=PAD)
    model = AutoModelForSequenceClassification.from_config(config)
    # The dense run is stretched like the others, its pattern Dense() (with none, to_long_model would switch it to
    # the registered name's default pattern, with a warning saying so), then handed to transformers' own sdpa.
    model = to_long_model(model, args.seq_len, sa.Dense() if pattern is None else pattern)
    if pattern is None:
        model.set_attn_implementation("sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / args.steps)  # linear decay
    data = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    model.train()
    for step in range(1, args.steps + 1):
        ids, labels = make_batch(args.batch, args.seq_len, data)
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 25 == 0:
            print(f"  [{name}] step {step:4d}  loss {loss.item():.3f}", flush=True)
    train_s = time.perf_counter() - start
    model.eval()
    test = torch.Generator().manual_seed(10_000 + args.seed)
    correct, per_class = 0, torch.zeros(3, dtype=torch.long)
    with torch.no_grad():
        for _ in range(args.eval_batches):
            ids, labels = make_batch(args.batch, args.seq_len, test)
            correct += int((model(input_ids=ids).logits.argmax(-1) == labels).sum())
            per_class += torch.bincount(labels, minlength=3)
    total = int(per_class.sum())
    return {"pattern": "dense (sdpa)" if pattern is None else repr(pattern), "accuracy": correct / total,
            "eval_examples": total, "majority_class_accuracy": int(per_class.max()) / total,
            "final_train_loss": round(loss.item(), 4), "train_seconds": round(train_s, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=list(PATTERNS))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    backend = "numba" if availability("numba")[0] else "reference"
    register(name="sparse_attn", backend=backend)  # to_long_model stores each run's pattern in the config
    results = {}
    for name in args.patterns:
        print(f"training with {name}", flush=True)
        results[name] = train_and_evaluate(name, PATTERNS[name], args)
        print(f"  -> accuracy {results[name]['accuracy']:.3f}", flush=True)
    report = {"command": "python " + " ".join(sys.argv), "backend": backend, "torch": torch.__version__,
              "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "results": results}
    write_report(report, args.out)


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "long_document_classification.json").write_text(json.dumps(report, indent=2) + "\n")
    args = report["args"]
    lines = ["# Long-document classification (synthetic, key phrases 2,000+ tokens apart)", "",
             f"`{report['command']}` on {report['machine']}, torch {report['torch']}, backend `{report['backend']}`.",
             f"Tiny BERT (hidden {args['hidden']}, 2 layers, 2 heads) stretched from 512 to {args['seq_len']} "
             f"positions with `to_long_model`; {args['steps']} steps of batch {args['batch']}; 3 balanced "
             f"classes: chance is 33%, always answering the test set's most frequent class scores "
             f"{next(iter(report['results'].values()))['majority_class_accuracy']:.1%}.", "",
             "| pattern | test accuracy | final train loss | train time (s) |", "|---|---|---|---|"]
    for name, r in report["results"].items():
        pattern = r["pattern"].replace("|", "\\|")  # a pipe inside a table cell
        lines.append(f"| {name}: `{pattern}` | {r['accuracy']:.1%} ({r['eval_examples']} examples) | "
                     f"{r['final_train_loss']} | {r['train_seconds']} |")
    text = "\n".join(lines) + "\n"
    (out / "long_document_classification.md").write_text(text)
    print("\n" + text)


if __name__ == "__main__":
    main()
