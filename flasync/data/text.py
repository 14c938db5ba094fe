"""A character-level next-token data set from a text file (``task = "language_model"``, ``data.kind = "files"``).

Every character of the file (its line ends included) after the first ``context`` ones is a sample: its features are
the ids of the ``context`` characters before it, its label the id of the character itself. Ids number the distinct
characters of the training file in sorted order. The file's lines are cut into ``num_clients`` blocks of consecutive
lines (as even as can be): a sample belongs to the block of the line its label is in, so each client holds a
contiguous part of the text, as a user holds their own messages.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from flasync.core.errors import DataError
from flasync.data import ArrayData
from flasync.data.files import FileData, missing

__all__ = ["load_text"]


def load_text(train: str | Path, test: str | Path | None, *, context: int, num_clients: int) -> FileData:
    """Read a UTF-8 text file (and a test file) into next-character samples, the training ones in line blocks.

    Args:
        train: The training text.
        test: Held-out text (its characters must all occur in ``train``); None: none.
        context: Characters each sample sees before the one it predicts.
        num_clients: Blocks of consecutive lines the training samples are cut into (the clients).

    Returns:
        The samples (features: float32 character ids ``(N, context)``; labels: int64 ids), each training sample's
        block in ``clients``, the characters (``classes``) and the files' digest.

    Raises:
        DataError: A file is missing, not UTF-8, shorter than ``context + 1`` characters, has fewer lines than
            ``num_clients``, or the test text has a character the training text has not.
    """
    digest = hashlib.sha256()
    text = _read(Path(train), "train", digest)
    lines = text.splitlines(keepends=True)
    if len(lines) < num_clients:
        raise DataError(f"{train}: {len(lines)} lines cannot make {num_clients} clients of consecutive lines")
    vocabulary = sorted(set(text))
    index = {char: i for i, char in enumerate(vocabulary)}
    ids = np.fromiter((index[c] for c in text), dtype=np.int64, count=len(text))
    line_of = np.repeat(np.arange(len(lines), dtype=np.int64), [len(line) for line in lines])
    block_of_line = np.arange(len(lines), dtype=np.int64) * num_clients // len(lines)
    train_data = _samples(ids, context, len(vocabulary), str(train))
    clients = block_of_line[line_of[context:]]
    test_data = None
    if test is not None:
        test_text = _read(Path(test), "test", digest)
        unknown = sorted(set(test_text) - set(index))
        if unknown:
            raise DataError(f"{test}: character {unknown[0]!r} does not occur in {train}")
        test_ids = np.fromiter((index[c] for c in test_text), dtype=np.int64, count=len(test_text))
        test_data = _samples(test_ids, context, len(vocabulary), str(test))
    return FileData(
        train=train_data,
        test=test_data,
        clients=clients,
        client_ids=tuple(range(num_clients)),
        classes=tuple(vocabulary),
        sha256=digest.hexdigest(),
    )


def _read(path: Path, role: str, digest: hashlib._Hash) -> str:
    if not path.is_file():
        raise missing(path, role)
    raw = path.read_bytes()
    digest.update(raw)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text (byte {exc.start}; data.{role})") from None


def _samples(ids: np.ndarray, context: int, vocabulary: int, where: str) -> ArrayData:
    """Return the windows of ``context`` ids before each later position, and the id at it."""
    if ids.shape[0] <= context:
        raise DataError(f"{where}: {ids.shape[0]} characters; data.context = {context} needs at least {context + 1}")
    windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], context)
    x = torch.from_numpy(windows.astype(np.float32))
    return ArrayData(x=x, y=torch.from_numpy(ids[context:].copy()), num_classes=max(vocabulary, 1))
