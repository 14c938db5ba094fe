"""The aggregation tree: generated and explicit trees, client assignment, and every invalid topology."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from flasync.config import TreeTopology
from flasync.core.errors import ConfigError
from flasync.server.topology import CLOUD, build_tree, parse_clients


def _tree(num_clients: int = 12, attributes: dict[str, np.ndarray] | None = None, **fields: Any) -> Any:
    return build_tree(TreeTopology(**fields), num_clients, attributes)


def test_blocks_assign_contiguous_clients() -> None:
    """fanout [3] with blocks: 12 clients in three runs of four."""
    tree = _tree(fanout=(3,), assign="blocks")
    assert tree.names == ("edge0", "edge1", "edge2")
    assert tree.client_edge.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert [m.tolist() for m in tree.members] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert tree.top == (0, 1, 2)
    assert tree.depth == 1
    assert all(tree.parent_address(e) == CLOUD for e in range(3))


def test_round_robin_deals_clients_in_turn() -> None:
    """Round-robin: client c goes to leaf c mod L."""
    tree = _tree(num_clients=7, fanout=(3,), assign="round_robin")
    assert tree.client_edge.tolist() == [0, 1, 2, 0, 1, 2, 0]


def test_nested_fanout_builds_a_tree_of_any_depth() -> None:
    """fanout [2, 2, 2]: 14 edges, 8 leaves, parents before children, tiers by depth."""
    tree = _tree(num_clients=16, fanout=(2, 2, 2))
    assert tree.num_edges == 2 + 4 + 8
    assert tree.depth == 3
    for edge, parent in enumerate(tree.parents):
        assert parent < edge
        if parent >= 0:
            assert tree.depths[edge] == tree.depths[parent] + 1
            assert tree.parent_address(edge) == tree.names[parent]
    leaves = [e for e in range(tree.num_edges) if tree.is_leaf(e)]
    assert len(leaves) == 8
    assert {tree.tier(e) for e in leaves} == {"edge3"}
    assert sorted(np.concatenate([tree.members[e] for e in leaves]).tolist()) == list(range(16))
    assert tree.names[tree.parents[tree.parents[leaves[0]]]] == "edge0"


def test_attribute_assignment_groups_by_value() -> None:
    """assign = attribute: one leaf per distinct value, in sorted order of the values."""
    regions = np.array(["eu", "us", "eu", "asia", "us", "asia"])
    tree = _tree(num_clients=6, attributes={"region": regions}, fanout=(3,), assign="attribute")
    assert tree.client_edge.tolist() == [1, 2, 1, 0, 2, 0]


def test_explicit_tree_with_ranges() -> None:
    """Explicit edges: ranges and ids, a parent edge, renumbered parents-first."""
    tree = _tree(
        num_clients=10,
        edges=[
            {"name": "eu-west", "parent": "eu", "clients": ["0-3", 9]},
            {"name": "eu", "parent": "cloud"},
            {"name": "us", "clients": ["4-8"]},
        ],
    )
    assert tree.names == ("eu", "us", "eu-west")
    assert tree.top == (0, 1)
    west = tree.names.index("eu-west")
    assert tree.members[west].tolist() == [0, 1, 2, 3, 9]
    assert tree.parent_address(west) == "eu"
    assert tree.depths[west] == 2
    assert not tree.is_leaf(tree.names.index("eu"))


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ([{"name": "a", "clients": ["0-4"]}, {"name": "b"}], "edge 'b' has no clients"),
        (
            [{"name": "a", "parent": "b", "clients": ["0-2"]}, {"name": "b", "parent": "a", "clients": ["3-5"]}],
            "cycle",
        ),
        ([{"name": "a", "clients": ["0-3"]}, {"name": "b", "clients": ["3-5"]}], "client 3 is in edges 'a' and 'b'"),
        ([{"name": "a", "clients": ["0-3"]}], "2 client(s) are in no edge (first: client 4)"),
        ([{"name": "a", "clients": ["0-6"]}], "client 6 is not in 0..5"),
        ([{"name": "a", "clients": ["x"]}], "'x' is not a client id"),
        ([{"name": "a", "clients": ["0-5"]}, {"name": "a", "clients": []}], "defined twice"),
        ([{"name": "a", "parent": "nowhere", "clients": ["0-5"]}], "no edge named 'nowhere'"),
        (
            [{"name": "a", "clients": ["0-2"]}, {"name": "b", "parent": "a", "clients": ["3-5"]}],
            "has both clients and sub-edges",
        ),
        ([{"name": "cloud", "clients": ["0-5"]}], "is the root's name"),
    ],
)
def test_invalid_explicit_trees(edges: list[dict[str, Any]], expected: str) -> None:
    """Each invalid tree is a one-line ConfigError naming the field and the problem."""
    with pytest.raises(ConfigError) as info:
        _tree(num_clients=6, edges=edges)
    message = str(info.value)
    assert expected in message
    assert message.startswith("topology")
    assert "\n" not in message


def test_more_leaves_than_clients_is_an_error() -> None:
    """An edge would be left without clients."""
    with pytest.raises(ConfigError, match=r"topology\.fanout: 12 leaf edges but only 5 clients"):
        _tree(num_clients=5, fanout=(3, 4))


def test_attribute_errors() -> None:
    """A missing attribute, or a leaf count that does not match its values, is named."""
    with pytest.raises(ConfigError, match="no attribute 'region'"):
        _tree(fanout=(2,), assign="attribute")
    with pytest.raises(ConfigError, match="3 distinct values"):
        _tree(num_clients=3, attributes={"region": np.array([0, 1, 2])}, fanout=(2,), assign="attribute")


def test_parse_clients() -> None:
    """Ids, ranges and digit strings expand in order."""
    assert parse_clients([3, "5-7", "9"], 10, "x") == [3, 5, 6, 7, 9]
    with pytest.raises(ConfigError, match="range '7-5' is empty"):
        parse_clients(["7-5"], 10, "x")
