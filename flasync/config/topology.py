"""Flat runs, and trees of edges between the clients and the cloud."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from flasync.config._base import _FieldError, _Section
from flasync.config.codec import _VALUE_ENCODERS, CodecStage


class FlatTopology(_Section):
    """Every client talks to the server (the cloud) directly."""

    kind: Literal["flat"] = "flat"


class EdgeLinkConfig(_Section):
    """The simulated link between an edge and its parent: ``latency + bytes / bandwidth`` each way."""

    latency_s: float = Field(0.01, ge=0.0, description="One-way latency.")
    upload_bytes_per_s: float = Field(1.25e8, gt=0.0, allow_inf_nan=True, description="Edge uplink (default 1 Gbit/s).")
    download_bytes_per_s: float = Field(
        1.25e8, gt=0.0, allow_inf_nan=True, description="Edge downlink (default 1 Gbit/s)."
    )


class EdgeSpec(_Section):
    """One edge of an explicit tree: its name, its parent, and the clients attached to it."""

    name: str = Field(
        min_length=1,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="The edge's name: its address on the bus and in per-edge metrics.",
    )
    parent: str = Field("cloud", min_length=1, description="'cloud' or the name of another edge.")
    clients: tuple[int | str, ...] = Field((), description="Client ids and inclusive ranges such as '0-99'.")


class TreeTopology(_Section):
    """Clients -> edges -> ... -> cloud (Liu et al., "Client-Edge-Cloud Hierarchical Federated Learning", 2020).

    The tree is either generated (``fanout``, top-down: ``[10]`` is 10 edges under the cloud, ``[10, 10]`` 10 edges
    with 10 sub-edges each) with clients assigned to the leaf edges by ``assign``, or given explicitly in ``edges``.
    With a ``fedavg`` server the edges run synchronous HierFAVG (``kappa2`` edge rounds per cloud round); with
    ``fedbuff`` or ``fedasync`` they aggregate asynchronously and forward every ``buffer_size`` updates or
    ``max_wait_s``.
    """

    kind: Literal["tree"] = "tree"
    fanout: tuple[Annotated[int, Field(ge=1)], ...] = Field((10,), description="Edges per level, top-down.")
    assign: Literal["blocks", "round_robin", "attribute"] = Field(
        "blocks", description="Clients to leaf edges: contiguous blocks, round-robin, or one edge per attribute value."
    )
    attribute: str = Field("region", min_length=1, description="The client attribute 'attribute' assignment uses.")
    edges: tuple[EdgeSpec, ...] = Field((), description="An explicit tree (overrides fanout and assign).")
    buffer_size: int = Field(10, ge=1, description="K_e: updates an async edge folds before forwarding.")
    max_wait_s: float | None = Field(
        None, gt=0.0, description="An async edge forwards what it holds this long after its first update."
    )
    kappa2: int = Field(1, ge=1, description="Sync HierFAVG: edge aggregations per cloud aggregation.")
    link: EdgeLinkConfig = EdgeLinkConfig()
    codec: tuple[CodecStage, ...] = Field(
        (), description="How edges encode the partials they send up: one fp16, bf16 or int8 stage (empty: float32)."
    )
    per_edge_metrics: bool = Field(False, description="Also log figures per edge name (at most 32 edges).")

    @model_validator(mode="after")
    def _edge_codec(self) -> TreeTopology:
        if len(self.codec) > 1 or any(not isinstance(stage, _VALUE_ENCODERS) for stage in self.codec):
            raise _FieldError(("topology", "codec"), "one fp16, bf16 or int8 stage at most (partials keep no residual)")
        return self


TopologyConfig = Annotated[FlatTopology | TreeTopology, Field(discriminator="kind")]
