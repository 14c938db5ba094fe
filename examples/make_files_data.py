"""Write scikit-learn's digits as a LEAF-style data file: one row per sample, naming the writer who drew it.

    python examples/make_files_data.py                       # examples/data/digits_by_writer.csv
    python examples/make_files_data.py --out digits.npz      # the same samples as arrays (x, y, writer)
    python -m flasync run examples/files_by_column.toml      # one client per writer

Digits comes with no writer ids, so this draws them the way LEAF's FEMNIST looks: writers of very different
output (a few write a lot, many write little) whose digits are skewed towards a few classes. For each class, its
samples are shared among the writers by Dirichlet(``--alpha``) proportions over writers whose sizes follow a
log-normal law. The same ``--seed`` writes the same file, byte for byte.

Columns (CSV, Parquet) or arrays (.npz): ``writer`` (``"w007"``), ``label`` (0-9), and the 64 pixels ``p0`` ...
``p63`` scaled to [0, 1] (as one ``x`` array of shape (N, 64) in an .npz).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits

DEFAULT_OUT = Path(__file__).resolve().parent / "data" / "digits_by_writer.csv"


def writers_of(labels: np.ndarray, *, writers: int, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """Return a writer id in ``0..writers-1`` for every sample: per class, Dirichlet shares over writers whose
    output differs (log-normal weights), so sizes and label mixes both vary across writers."""
    output = rng.lognormal(0.0, 1.0, size=writers)
    owner = np.empty(labels.shape[0], dtype=np.int64)
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        shares = rng.dirichlet(alpha * output / output.mean())
        owner[members] = rng.choice(writers, size=members.shape[0], p=shares)
    return owner


def main() -> None:
    """Write the file named by --out (format from its suffix: .csv, .npz or .parquet)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"where to write (default: {DEFAULT_OUT})")
    parser.add_argument("--writers", type=int, default=40, help="number of writers (clients)")
    parser.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration: smaller = more skew")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    features, labels = load_digits(return_X_y=True)
    pixels = (features / 16.0).astype(np.float32)  # 0..16 in steps of 1/16: exact in 4 decimals
    owner = writers_of(labels, writers=args.writers, alpha=args.alpha, rng=np.random.default_rng(args.seed))
    names = np.array([f"w{k:03d}" for k in owner])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    suffix = args.out.suffix.lower()
    if suffix == ".csv":
        with args.out.open("w", newline="") as stream:
            writer = csv.writer(stream)
            writer.writerow(["writer", "label", *(f"p{i}" for i in range(pixels.shape[1]))])
            for name, label, row in zip(names, labels, pixels, strict=True):
                writer.writerow([name, int(label), *(f"{v:.4f}" for v in row)])
    elif suffix == ".npz":
        np.savez_compressed(args.out, x=pixels, label=labels.astype(np.int64), writer=names)
    elif suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        columns = {"writer": names, "label": labels.astype(np.int64)}
        columns.update({f"p{i}": pixels[:, i] for i in range(pixels.shape[1])})
        pq.write_table(pa.table(columns), args.out)
    else:
        parser.error(f"--out must end in .csv, .npz or .parquet, not {suffix!r}")
    drawn = np.bincount(owner, minlength=args.writers)
    sizes = drawn[drawn > 0]  # a writer the draw gave no digit is not in the file
    empty = f"; {args.writers - len(sizes)} of the {args.writers} drew none" if len(sizes) < args.writers else ""
    print(
        f"wrote {args.out}: {len(labels)} samples of {len(sizes)} writers "
        f"({sizes.min()} to {sizes.max()} samples each, median {int(np.median(sizes))}{empty})"
    )


if __name__ == "__main__":
    main()
