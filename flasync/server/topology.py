"""The aggregation tree: which edge each client reports to, and which parent each edge reports to.

Pure data built from a :class:`~flasync.config.TreeTopology`: a tree of any depth whose leaves are edges holding
clients. Every check a tree must pass (no empty edge, no cycle, no client in two edges or in none) is made here,
with a one-line :class:`~flasync.core.errors.ConfigError` naming the config field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from flasync.config import EdgeSpec, TreeTopology
from flasync.core.errors import ConfigError
from flasync.core.events import CLOUD

__all__ = ["CLOUD", "Tree", "build_tree", "parse_clients"]

_RANGE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")


@dataclass(frozen=True, slots=True, eq=False)
class Tree:
    """An aggregation tree over ``num_clients`` clients.

    Edges are numbered ``0..num_edges-1`` so that a parent always comes before its children.

    Attributes:
        names: Edge names (each also the edge's bus address).
        parents: Parent edge of each edge, ``-1`` for the cloud.
        depths: Depth of each edge: 1 under the cloud, 2 under a depth-1 edge, ...
        children: Sub-edges of each edge.
        members: Clients of each edge, sorted (empty for an edge with sub-edges).
        client_edge: The edge each client reports to, shape ``(num_clients,)``.
    """

    names: tuple[str, ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...]
    children: tuple[tuple[int, ...], ...]
    members: tuple[np.ndarray, ...]
    client_edge: np.ndarray

    @property
    def num_edges(self) -> int:
        """Number of edges (the cloud not counted)."""
        return len(self.names)

    @property
    def depth(self) -> int:
        """Depth of the tree: edges on the longest path from a client to the cloud."""
        return max(self.depths)

    @property
    def top(self) -> tuple[int, ...]:
        """Edges whose parent is the cloud."""
        return tuple(i for i, parent in enumerate(self.parents) if parent < 0)

    def parent_address(self, edge: int) -> str:
        """Return the bus address ``edge`` forwards to: its parent's name or :data:`CLOUD`."""
        parent = self.parents[edge]
        return CLOUD if parent < 0 else self.names[parent]

    def tier(self, edge: int) -> str:
        """Return the tier name of ``edge`` (``edge1`` under the cloud, ``edge2`` below, ...)."""
        return f"edge{self.depths[edge]}"

    def is_leaf(self, edge: int) -> bool:
        """Tell whether ``edge`` holds clients (rather than sub-edges)."""
        return not self.children[edge]


def parse_clients(items: Sequence[int | str], num_clients: int, where: str) -> list[int]:
    """Expand client ids and inclusive ``"a-b"`` ranges into a list of ids.

    Raises:
        ConfigError: An item is not an id or a range, or an id is outside ``0..num_clients-1``.
    """
    ids: list[int] = []
    for item in items:
        if isinstance(item, int):
            lo = hi = item
        else:
            match = _RANGE.match(item)
            if match is None:
                if not item.strip().isdigit():
                    raise ConfigError(f"{where}: {item!r} is not a client id or a range such as '0-99'")
                lo = hi = int(item)
            else:
                lo, hi = int(match.group(1)), int(match.group(2))
        if lo > hi:
            raise ConfigError(f"{where}: range {item!r} is empty")
        if lo < 0 or hi >= num_clients:
            raise ConfigError(f"{where}: client {hi if hi >= num_clients else lo} is not in 0..{num_clients - 1}")
        ids.extend(range(lo, hi + 1))
    return ids


def build_tree(config: TreeTopology, num_clients: int, attributes: Mapping[str, np.ndarray] | None = None) -> Tree:
    """Build and check the tree a config describes.

    Args:
        config: The topology section.
        num_clients: Size of the population.
        attributes: Per-client attribute arrays (``assign = "attribute"`` groups clients by ``config.attribute``).

    Raises:
        ConfigError: The tree is invalid (an edge with no clients, a cycle, a client in two edges or in none, ...).
    """
    if config.edges:
        return _explicit(config.edges, num_clients)
    return _generated(config, num_clients, attributes or {})


def _generated(config: TreeTopology, num_clients: int, attributes: Mapping[str, np.ndarray]) -> Tree:
    names: list[str] = []
    parents: list[int] = []
    depths: list[int] = []
    level = [(-1, "")]
    for depth, fanout in enumerate(config.fanout, start=1):
        next_level = []
        for parent, prefix in level:
            for i in range(fanout):
                name = f"{prefix}.{i}" if prefix else f"edge{i}"
                next_level.append((len(names), name))
                names.append(name)
                parents.append(parent)
                depths.append(depth)
        level = next_level
    leaves = [index for index, _ in level]
    client_ids = np.arange(num_clients)
    if config.assign == "attribute":
        values = attributes.get(config.attribute)
        if values is None:
            raise ConfigError(
                f"topology.attribute: clients have no attribute {config.attribute!r} "
                f"(set population.regions or pass client_attributes)"
            )
        values = np.asarray(values)
        if values.shape != (num_clients,):
            raise ConfigError(
                f"topology.attribute: {config.attribute!r} has {values.size} values for {num_clients} clients"
            )
        distinct, slot = np.unique(values, return_inverse=True)
        if len(distinct) != len(leaves):
            raise ConfigError(
                f"topology.fanout: {len(leaves)} leaf edges but attribute {config.attribute!r} has "
                f"{len(distinct)} distinct values"
            )
    elif config.assign == "round_robin":
        slot = client_ids % len(leaves)
    else:
        slot = client_ids * len(leaves) // num_clients
    if num_clients < len(leaves):
        raise ConfigError(f"topology.fanout: {len(leaves)} leaf edges but only {num_clients} clients")
    client_edge = np.asarray(leaves, dtype=np.int64)[slot]
    return _assemble(names, parents, depths, client_edge)


def _explicit(specs: Sequence[EdgeSpec], num_clients: int) -> Tree:
    index: dict[str, int] = {}
    for i, spec in enumerate(specs):
        if spec.name == CLOUD:
            raise ConfigError(f"topology.edges.{i}.name: {CLOUD!r} is the root's name")
        if spec.name in index:
            raise ConfigError(f"topology.edges.{i}.name: edge {spec.name!r} is defined twice")
        index[spec.name] = i
    for i, spec in enumerate(specs):
        if spec.parent != CLOUD and spec.parent not in index:
            raise ConfigError(f"topology.edges.{i}.parent: no edge named {spec.parent!r}")
    # Every chain of parents must reach the cloud within len(specs) steps, or it loops.
    for i, spec in enumerate(specs):
        seen = [spec.name]
        parent = spec.parent
        while parent != CLOUD:
            if parent in seen:
                cycle = " -> ".join([*seen[seen.index(parent) :], parent])
                raise ConfigError(f"topology.edges.{i}.parent: the edges form a cycle ({cycle})")
            seen.append(parent)
            parent = specs[index[parent]].parent
    has_children = {spec.parent for spec in specs}
    owner = np.full(num_clients, -1, dtype=np.int64)
    for i, spec in enumerate(specs):
        ids = parse_clients(spec.clients, num_clients, f"topology.edges.{i}.clients")
        if spec.name in has_children and ids:
            raise ConfigError(f"topology.edges.{i}: edge {spec.name!r} has both clients and sub-edges")
        if spec.name not in has_children and not ids:
            raise ConfigError(f"topology.edges.{i}: edge {spec.name!r} has no clients")
        for client in ids:
            if owner[client] >= 0:
                raise ConfigError(
                    f"topology.edges.{i}.clients: client {client} is in edges "
                    f"{specs[owner[client]].name!r} and {spec.name!r}"
                )
            owner[client] = i
    orphans = np.flatnonzero(owner < 0)
    if len(orphans):
        raise ConfigError(f"topology.edges: {len(orphans)} client(s) are in no edge (first: client {int(orphans[0])})")
    # Renumber parents-first (breadth-first from the cloud) so every edge comes after its parent.
    order: list[int] = []
    frontier = [CLOUD]
    while frontier:
        nxt = [i for parent in frontier for i, spec in enumerate(specs) if spec.parent == parent]
        order.extend(nxt)
        frontier = [specs[i].name for i in nxt]
    position = {old: new for new, old in enumerate(order)}
    names = [specs[i].name for i in order]
    parents = [-1 if specs[i].parent == CLOUD else position[index[specs[i].parent]] for i in order]
    depths: list[int] = []
    for up in parents:
        depths.append(1 if up < 0 else depths[up] + 1)
    client_edge = np.asarray([position[int(i)] for i in owner], dtype=np.int64)
    return _assemble(names, parents, depths, client_edge)


def _assemble(names: list[str], parents: list[int], depths: list[int], client_edge: np.ndarray) -> Tree:
    children: list[list[int]] = [[] for _ in names]
    for edge, parent in enumerate(parents):
        if parent >= 0:
            children[parent].append(edge)
    order = np.argsort(client_edge, kind="stable")
    bounds = np.searchsorted(client_edge[order], np.arange(len(names) + 1))
    members = tuple(np.sort(order[bounds[e] : bounds[e + 1]]) for e in range(len(names)))
    for edge, kids in enumerate(children):
        if not kids and len(members[edge]) == 0:
            raise ConfigError(f"topology: edge {names[edge]!r} has no clients")
    return Tree(
        names=tuple(names),
        parents=tuple(parents),
        depths=tuple(depths),
        children=tuple(tuple(k) for k in children),
        members=members,
        client_edge=client_edge,
    )
