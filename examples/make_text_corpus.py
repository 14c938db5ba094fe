"""Write a small English-like text for the character-level language model (``task = "language_model"``).

    python examples/make_text_corpus.py                          # examples/data/corpus.txt
    python -m flasync run examples/language_model.toml           # one block of lines per client

The text is made here, nothing is downloaded: sentences from a small grammar (``the quick fox sees a red hill.``),
one a line. Consecutive lines share a theme (a few nouns drawn more often), so the clients that ``line_blocks``
gives a block of consecutive lines each hold text of their own flavour, as users each write their own. The same
``--seed`` writes the same file, byte for byte.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

DEFAULT_OUT = Path(__file__).resolve().parent / "data" / "corpus.txt"

ADJECTIVES = ("quick", "small", "old", "red", "quiet", "bright", "cold", "green")
NOUNS = ("fox", "dog", "cat", "bird", "hill", "river", "tree", "house", "sun", "boat", "child", "road")
VERBS = ("sees", "finds", "follows", "leaves", "watches", "crosses", "loves", "meets")
PLACES = ("near the river", "on the hill", "by the road", "under the tree", "at the house", "in the rain")


def sentence(rng: np.random.Generator, theme: np.ndarray) -> str:
    """Return one sentence: ``the ADJ NOUN VERB a ADJ NOUN`` and, one time in two, a place; nouns drawn from
    ``theme`` (weights over :data:`NOUNS`)."""
    first, second = rng.choice(NOUNS, size=2, p=theme)
    words = ["the", rng.choice(ADJECTIVES), first, rng.choice(VERBS), "a", rng.choice(ADJECTIVES), second]
    if rng.random() < 0.5:
        words.append(rng.choice(PLACES))
    return " ".join(str(word) for word in words) + "."


def corpus(lines: int, *, block: int, seed: int) -> str:
    """Return ``lines`` sentences, one a line; every ``block`` lines draw their nouns with a new theme (Dirichlet
    weights over the nouns)."""
    rng = np.random.default_rng(seed)
    text = []
    theme = rng.dirichlet(np.full(len(NOUNS), 0.5))
    for line in range(lines):
        if line and line % block == 0:
            theme = rng.dirichlet(np.full(len(NOUNS), 0.5))
        text.append(sentence(rng, theme))
    return "\n".join(text) + "\n"


def main() -> None:
    """Write the text to --out."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"where to write (default: {DEFAULT_OUT})")
    parser.add_argument("--lines", type=int, default=600, help="sentences, one a line")
    parser.add_argument("--block", type=int, default=30, help="lines that share a theme")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.lines < 1 or args.block < 1:
        parser.error("--lines and --block must be at least 1")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(corpus(args.lines, block=args.block, seed=args.seed), encoding="utf-8")
    print(f"wrote {args.lines} lines to {args.out}")


if __name__ == "__main__":
    main()
