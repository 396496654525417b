"""A small character-level GPT, its corpus, and the ``stratagem demo --task lm`` job.

Shared by ``examples/gpt.py`` (the full training loop), ``benchmarks/lm.py`` and the demo.

**Model.** A decoder-only transformer (Vaswani et al., "Attention is all you need", 2017;
Radford et al., "Language models are unsupervised multitask learners" (GPT-2), 2019): token
and learned position embeddings, ``n_layer`` pre-LayerNorm blocks of causal multi-head
self-attention and a 4x GELU MLP, a final LayerNorm, and an output head whose weight *is* the
token embedding (weight tying, Press & Wolf 2017), so ``head.weight`` and ``tok_emb.weight``
are one parameter. Dropout on embeddings, attention weights and residual branches.

**Corpus** (:func:`load_corpus`): English text that every Python installation carries, so
nothing is downloaded. In this order, each source sorted by name:

1. the Python Language Reference topics shipped for ``help()`` (``pydoc_data.topics``,
   about 0.45 MB), topics sorted by name;
2. the standard library's ``LICENSE.txt`` and IDLE's ``idlelib/*.txt`` (news, history,
   read-me);
3. ``/usr/share/common-licenses/*`` when present (Debian/Ubuntu; each file once, symbolic
   links resolved);
4. the docstrings (``\"\"\"...\"\"\"`` strings) of the standard library's top-level
   modules ``<stdlib>/*.py`` (about 1.1 MB on CPython 3.11).

The text is folded to printable ASCII plus newline (NFKD, other characters dropped), so the
vocabulary is the same fixed 96 characters everywhere and a checkpoint never needs it. Fewer
than :data:`CORPUS_MIN_CHARS` characters is an error naming every place looked at.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import json
import math
import os
import re
import sys
import sysconfig
import time
import unicodedata
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .validation import check_int

__all__ = ["VOCAB", "VOCAB_SIZE", "CORPUS_MIN_CHARS", "encode", "decode", "corpus_sources",
           "load_corpus", "split_corpus", "windows", "GPTConfig", "GPT", "adamw_param_groups",
           "lr_at", "evaluate_loss", "train_worker", "main"]

#: The vocabulary: newline, then the printable ASCII characters (space .. tilde).
VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))
VOCAB_SIZE = len(VOCAB)
#: The corpus must hold at least this many characters (after folding to ``VOCAB``).
CORPUS_MIN_CHARS = 1_000_000

_INDEX = {c: i for i, c in enumerate(VOCAB)}
_DOCSTRING = re.compile(r'"""(.*?)"""', re.S)
_LICENSES = Path("/usr/share/common-licenses")


def _fold(text: str) -> str:
    """Printable ASCII plus newline: accents stripped (NFKD), tabs to spaces, the rest dropped."""
    text = unicodedata.normalize("NFKD", text).replace("\r\n", "\n").replace("\t", "    ")
    return "".join(c for c in text if c in _INDEX)


def encode(text: str) -> torch.Tensor:
    """Token ids (int64) of ``text``; characters outside :data:`VOCAB` are dropped."""
    ids = [_INDEX[c] for c in _fold(text)]
    return torch.tensor(ids, dtype=torch.int64)


def decode(ids: torch.Tensor | list[int]) -> str:
    values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
    return "".join(VOCAB[i] for i in values)


def _stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_sources() -> list[tuple[str, str]]:
    """``(source, text)`` pairs in corpus order (see the module docstring); sources that do
    not exist on this machine are left out."""
    out: list[tuple[str, str]] = []
    try:
        import pydoc_data.topics

        topics: dict[str, str] = dict(pydoc_data.topics.topics)
    except ImportError:
        topics = {}
    if topics:
        out.append(("pydoc_data.topics (Python Language Reference topics)",
                    "\n\n".join(str(topics[k]) for k in sorted(topics))))
    stdlib = _stdlib()
    files = [stdlib / "LICENSE.txt", *sorted((stdlib / "idlelib").glob("*.txt"))]
    if _LICENSES.is_dir():
        seen: set[Path] = set()
        for f in sorted(_LICENSES.iterdir()):
            real = f.resolve()
            if real.is_file() and real not in seen:
                seen.add(real)
                files.append(f)
    for f in files:
        if f.is_file():
            out.append((str(f), f.read_text(encoding="utf-8", errors="replace")))
    docs: list[str] = []
    for f in sorted(stdlib.glob("*.py")):
        source = f.read_text(encoding="utf-8", errors="replace")
        docs += [inspect.cleandoc(m.group(1)) for m in _DOCSTRING.finditer(source)]
    if docs:
        out.append((f"docstrings of {stdlib}/*.py", "\n\n".join(d for d in docs if d)))
    return out


@functools.lru_cache(maxsize=1)
def load_corpus(min_chars: int = CORPUS_MIN_CHARS) -> str:
    """The corpus text (folded to :data:`VOCAB`), deterministic for a given installation.

    Raises ``FileNotFoundError`` naming every source looked at and its size when fewer than
    ``min_chars`` characters are found."""
    parts = [(name, _fold(text)) for name, text in corpus_sources()]
    text = "\n\n".join(t for _, t in parts if t)
    if len(text) < min_chars:
        found = "; ".join(f"{name}: {len(t):,} chars" for name, t in parts) or "nothing"
        raise FileNotFoundError(
            f"the GPT corpus needs >= {min_chars:,} characters of English text, found "
            f"{len(text):,}. Looked for: pydoc_data.topics, {_stdlib()}/LICENSE.txt, "
            f"{_stdlib()}/idlelib/*.txt, {_LICENSES}/*, docstrings of {_stdlib()}/*.py. "
            f"Found: {found}. Fix: use a Python installation with its pydoc_data and "
            "idlelib (e.g. not a stripped one), or pass --text FILE with >= 1 MB of text")
    return text


def split_corpus(data: torch.Tensor, *, chunk: int = 4096, val_every: int = 10
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val) token ids: every ``val_every``-th chunk of ``chunk`` tokens is held out,
    so validation text comes from every source, not only the last one."""
    n = len(data) // chunk
    chunks = data[: n * chunk].view(n, chunk)
    held = torch.zeros(n, dtype=torch.bool)
    held[val_every - 1::val_every] = True
    return chunks[~held].reshape(-1), torch.cat([chunks[held].reshape(-1), data[n * chunk:]])


def windows(data: torch.Tensor, block_size: int, stride: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, one row per window of ``block_size`` tokens starting
    every ``stride`` tokens (views of ``data``: no copy). A tuple of tensors, as
    ``strategy.distribute_dataset`` takes."""
    stride = stride or block_size
    if len(data) < block_size + 1:
        raise ValueError(f"the text holds {len(data)} tokens, fewer than block_size + 1 = "
                         f"{block_size + 1}. Fix: lower block_size or use more text")
    rows = data.unfold(0, block_size + 1, stride)
    return rows[:, :-1], rows[:, 1:]


# ---------------------------------------------------------------------- the model
@dataclasses.dataclass
class GPTConfig:
    """The model's shape; stored as checkpoint extras (``dataclasses.asdict``)."""

    vocab_size: int = VOCAB_SIZE
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.1
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            check_int(f"GPTConfig.{name}", getattr(self, name), minimum=1)
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd must be divisible by n_head (heads split the embedding), "
                             f"got n_embd={self.n_embd}, n_head={self.n_head}. Fix: e.g. "
                             f"n_embd={self.n_head * max(1, self.n_embd // self.n_head)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, heads, T, C / heads)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.out = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """``GPT(GPTConfig(...))``; ``model(idx)`` returns logits ``(B, T, vocab)``,
    ``model(idx, targets)`` returns ``(logits, mean cross-entropy)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one parameter under two names
        self.apply(self._init)
        # GPT-2's scaled init of the projections that add into the residual stream.
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", ".out.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # the tied weight counted once

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size="
                             f"{self.cfg.block_size}. Fix: crop it to the last block_size tokens")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.8,
                 top_k: int | None = 40, generator: torch.Generator | None = None) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` (B, T); eval mode inside."""
        was_training = self.training
        self.eval()
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.cfg.block_size:])[:, -1, :].float() / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, -math.inf)
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        self.train(was_training)
        return idx


def adamw_param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two AdamW groups: weight decay on matrices (linear and embedding weights), none on
    biases and LayerNorm parameters (anything with fewer than 2 dimensions)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Linear warm-up for ``warmup`` steps, then cosine decay to ``min_lr`` at ``total``."""
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if step >= total:
        return min_lr
    progress = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


@torch.no_grad()
def evaluate_loss(strategy: Any, model: nn.Module, X: torch.Tensor, Y: torch.Tensor,
                  *, batch_size: int = 32) -> float:
    """Mean cross-entropy of ``model`` on the windows ``(X, Y)``; each replica scores its own
    stride of them and the sums are reduced, so every replica returns the same number (a
    collective: call it on every replica)."""
    r, n = strategy.replica_id, strategy.num_replicas_in_sync
    xs, ys = X[r::n], Y[r::n]
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(xs), batch_size):
        x, y = xs[i:i + batch_size].to(strategy.device), ys[i:i + batch_size].to(strategy.device)
        _, loss = model(x, y)
        total += float(loss) * y.numel()
        count += y.numel()
    model.train(was_training)
    sums = strategy.reduce("sum", {"total": total, "count": count})
    return float(sums["total"]) / max(1, int(sums["count"]))


# ---------------------------------------------------------------------- the demo job
#: ``stratagem demo --task lm``: (label, registry name, strategy arguments, needs a PS shard).
_DEMO_RUNS: list[tuple[str, str, dict[str, Any], bool]] = [
    ("Mirrored", "mirrored", {}, False),
    ("LocalSGD (period 8)", "local_sgd", {"period": 8}, False),
    ("ElasticAveraging (EASGD, period 4)", "easgd", {"period": 4}, False),
    ("DiLoCo (period 32, outer Nesterov lr 1.0, momentum 0.3)", "diloco",
     {"period": 32, "outer_lr": 1.0, "outer_momentum": 0.3}, False),
]


def train_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """One worker of the LM demo: train the GPT until the consensus model's validation loss
    reaches ``cfg["target"]`` (checked every ``eval_every`` steps) or ``max_steps``.
    Evaluation pauses every worker and is excluded from the wall clock."""
    import stratagem as sg

    torch.set_num_threads(int(cfg.get("threads", 1)))
    strategy = sg.from_name(cfg["strategy"], **cfg.get("strategy_args", {}))
    seed = int(cfg.get("seed", 0))
    gcfg = GPTConfig(**cfg["model"])
    train, val = split_corpus(encode(load_corpus()))
    X, Y = windows(train, gcfg.block_size)
    Xv, Yv = windows(val, gcfg.block_size)
    held_out = int(cfg.get("eval_chars", 4096)) // gcfg.block_size  # the same windows always
    Xv, Yv = Xv[:held_out], Yv[:held_out]
    with strategy.scope():
        torch.manual_seed(seed)
        model = GPT(gcfg)
        optimizer = torch.optim.AdamW(adamw_param_groups(model, 0.1), lr=float(cfg["lr"]),
                                      betas=(0.9, 0.95))
        model, optimizer = strategy.prepare(model, optimizer)
    loader = strategy.distribute_dataset((X, Y), int(cfg["global_batch_size"]), shuffle=True,
                                         seed=seed)
    every, target, max_steps = int(cfg["eval_every"]), float(cfg["target"]), int(cfg["max_steps"])
    curve: list[tuple[float, int, float]] = []
    reached: dict[str, float] | None = None
    paused, step, epoch = 0.0, 0, 0
    start = time.perf_counter()

    eval_bytes = 0.0  # what evaluating moves (LocalSGD's eval_model averages): not training

    def evaluate() -> bool:
        nonlocal paused, reached, eval_bytes
        t0 = time.perf_counter()
        before = strategy.metrics()
        loss = evaluate_loss(strategy, strategy.eval_model(model), Xv, Yv)
        after = strategy.metrics()
        eval_bytes += sum(after[k] - before[k] for k in ("bytes_sent", "bytes_received"))
        wall = t0 - start - paused
        curve.append((wall, step, loss))
        if reached is None and loss <= target:
            reached = {"wall": wall, "step": step, "val_loss": loss}
        paused += time.perf_counter() - t0
        return reached is not None

    done = evaluate()
    while not done and step < max_steps:
        loader.set_epoch(epoch)
        for x, y in loader:
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step, lr=float(cfg["lr"]), min_lr=float(cfg["lr"]) / 10,
                                warmup=int(cfg.get("warmup", 10)), total=max_steps)
            _, loss = model(x, y)
            strategy.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % every == 0 or step == max_steps:
                done = evaluate()
            if done or step >= max_steps:
                break
        epoch += 1
    wall = time.perf_counter() - start - paused
    metrics = strategy.metrics()
    steps = max(1, int(metrics["steps"]))
    strategy.finalize(model)  # the reported final loss is the finalized model's (every step in)
    final = evaluate_loss(strategy, strategy.eval_model(model), Xv, Yv)
    strategy.close()
    return {"strategy": cfg["strategy"], "workers": strategy.num_replicas_in_sync,
            "reached": reached, "final_val_loss": final, "wall_seconds": wall,
            "steps": int(metrics["steps"]), "curve": curve,
            "bytes_per_step": (metrics["bytes_sent"] + metrics["bytes_received"] - eval_bytes)
            / steps}


def demo_worker(cfgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every configuration in turn, in one launch (the process group is set up once)."""
    return [train_worker(cfg) for cfg in cfgs]


def _table(rows: list[dict[str, Any]], target: float) -> str:
    lines = [f"| strategy | workers | steps to val loss {target} | wall s to target | "
             "final val loss (finalized model) | training bytes/step (rank 0) |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        hit = r["reached"]
        lines.append(f"| {r['label']} | {r['workers']} | "
                     f"{hit['step'] if hit else 'not reached'} | "
                     f"{format(hit['wall'], '.1f') if hit else 'not reached'} | "
                     f"{r['final_val_loss']:.3f} | {r['bytes_per_step']:,.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="stratagem demo --task lm",
        description="A tiny character-level GPT under several strategies on this machine: "
                    "time to a fixed validation loss (see benchmarks/lm.py for shaped links).")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--target", type=float, default=2.8, help="validation loss to reach")
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--eval-every", type=int, default=8)
    parser.add_argument("--out", default="stratagem-demo-lm",
                        help="directory for results.json (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    model: dict[str, Any] = {"block_size": 32, "n_layer": 1, "n_head": 4, "n_embd": 64,
                             "dropout": 0.0}
    cfgs = [{"strategy": name, "strategy_args": sargs, "label": label, "model": model,
             "lr": 3e-3, "global_batch_size": 16 * args.workers, "target": args.target,
             "max_steps": args.max_steps, "eval_every": args.eval_every}
            for label, name, sargs, _ in _DEMO_RUNS]
    load_corpus()  # fail here, with the explanation, rather than in every worker
    n_params = GPT(GPTConfig(**model)).num_parameters()
    print(f"training a character-level GPT ({n_params:,} parameters) on {len(load_corpus()):,} "
          f"characters of Python documentation under {len(cfgs)} strategies, {args.workers} "
          f"worker processes, until the validation loss reaches {args.target} ...", flush=True)
    t0 = time.perf_counter()
    if args.workers == 1:
        rows = demo_worker(cfgs)
    else:
        from .launcher import launch

        rows = launch(demo_worker, nprocs=args.workers, args=(cfgs,))[0]
    for cfg, row in zip(cfgs, rows):
        row["label"] = cfg["label"]
    print()
    print(_table(rows, args.target))
    base = rows[0]["reached"]
    for row in rows[1:]:
        if base and row["reached"]:
            print(f"{row['label']}: {row['reached']['wall'] / base['wall']:.2f}x Mirrored's "
                  "wall time to the target")
    print(f"\n(total {time.perf_counter() - t0:.0f} s including process start-up; loopback "
          "links, so communication is cheap here: benchmarks/lm.py measures 100 and 20 Mbit/s)")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
