"""Next-character samples from a text file, cut into clients by blocks of lines."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flasync.core.errors import DataError
from flasync.data.text import load_text


def test_each_character_after_the_context_is_a_sample_of_its_lines_block(tmp_path: Path) -> None:
    """Windows of ``context`` ids predict the next id; a sample belongs to the block of its label's line."""
    path = tmp_path / "t.txt"
    path.write_text("ab\ncd\nef\nab\n", encoding="utf-8")
    data = load_text(path, None, context=2, num_clients=2)
    assert data.classes == ("\n", "a", "b", "c", "d", "e", "f")
    train = data.train
    assert train.num_classes == 7 and len(train) == 12 - 2 and train.x.shape == (10, 2)
    ids = [data.classes.index(c) for c in "ab\ncd\nef\nab\n"]
    assert train.x[0].tolist() == [float(ids[0]), float(ids[1])] and int(train.y[0]) == ids[2]
    assert torch.equal(train.y, torch.tensor(ids[2:]))
    # lines 0-1 (characters 0..5) are client 0, lines 2-3 (6..11) client 1; labels start at character 2
    assert data.clients is not None and data.clients.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]


def test_bad_text_is_one_line(tmp_path: Path) -> None:
    """Too few lines for the clients, too short for the context, a test character unseen in training, not UTF-8."""
    path = tmp_path / "t.txt"
    path.write_text("abc\nabd\n", encoding="utf-8")
    with pytest.raises(DataError, match="2 lines cannot make 3 clients"):
        load_text(path, None, context=2, num_clients=3)
    with pytest.raises(DataError, match="needs at least 9"):
        load_text(path, None, context=8, num_clients=2)
    other = tmp_path / "test.txt"
    other.write_text("abz\n", encoding="utf-8")
    with pytest.raises(DataError, match="character 'z' does not occur"):
        load_text(path, other, context=2, num_clients=2)
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(DataError, match="not UTF-8"):
        load_text(tmp_path / "bin.txt", None, context=1, num_clients=1)
