"""Draw loss and tokens/s from the trainer's metrics.csv (ulysses-mcore pretrain) into a PNG.

ulysses-mcore plot runs/metrics.csv [more.csv ...] --out runs/training.png [--label a --label b]
"""

import argparse
import csv
import os
import sys


def read(path):
    train, valid = [], []
    with open(path) as f:
        for r in csv.DictReader(f):
            (train if r["kind"] == "train" else valid).append(r)
    return train, valid


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", nargs="+", help="metrics.csv files of runs (their lines are drawn side by side)")
    p.add_argument("--out", default="training.png", help="the PNG to write (default: %(default)s)")
    p.add_argument(
        "--label", action="append", help="a run's name in the legend, once per csv in order (default: its folder)"
    )
    return p


def main(argv=None):
    a = build_parser().parse_args(argv)
    try:
        import matplotlib  # optional (the plot extra)
    except ImportError:
        print("error: ulysses-mcore plot needs matplotlib: pip install 'ulysses-mcore[plot]'", file=sys.stderr)
        return 2

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional (the plot extra)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, path in enumerate(a.csv):
        if not os.path.exists(path):
            print(f"error: {path} does not exist", file=sys.stderr)
            return 2
        train, valid = read(path)
        label = a.label[i] if a.label and i < len(a.label) else os.path.basename(os.path.dirname(os.path.abspath(path)))
        it = [int(r["iteration"]) for r in train]
        ax1.plot(it, [float(r["lm_loss"]) for r in train], label=f"{label} train")
        if valid:
            ax1.plot(
                [int(r["iteration"]) for r in valid],
                [float(r["lm_loss"]) for r in valid],
                "o--",
                label=f"{label} valid",
            )
        ax2.plot(it, [float(r["tokens_per_second"]) for r in train], label=label)
    ax1.set(xlabel="iteration", ylabel="lm loss", title="loss")
    ax2.set(xlabel="iteration", ylabel="tokens / s", title="throughput")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
