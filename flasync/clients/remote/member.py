"""A remote client's part in secure aggregation: hold the trained update, then the group's four rounds over HTTP.

The client tells the server it holds its update (``POST /v1/tasks/{id}/held``) instead of uploading it, then
long-polls ``GET /v1/secagg`` for what to do next. When its group is complete it gets the group's parameters and
its two weights, encodes ``weight * delta`` and ``example_weight`` into the ring, and runs
:class:`~flasync.secure.SecAggClient` round by round, posting each message's wire form to
``POST /v1/secagg/{group}/{round}``. The delta never leaves the client unmasked.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import torch

from flasync.secure import GroupParams, ProtocolAbort, SecAggClient, SystemRandom, WeightedEncoding
from flasync.secure.messages import decode_message

__all__ = ["take_part"]

Request = Callable[..., Awaitable[httpx.Response]]
"""Sends one request with the client's retries: ``request(method, path, **httpx_kwargs)``."""


async def take_part(
    request: Request, *, client_id: int, task_id: int, delta: torch.Tensor, num_samples: int, poll_s: float
) -> str:
    """Hold a trained update for its secure group and take part in the group's rounds.

    Args:
        request: Sends a request to the server (the client's own, with its token and retries).
        client_id: This client's id.
        task_id: The task the update answers.
        delta: The trained update (flat float32).
        num_samples: Its training samples (the server weights it by them).
        poll_s: Longest wait of one poll.

    Returns:
        ``"summed"`` (its update is in the group's sum), ``"dropped"`` (the group went on or ended without it),
        ``"refused"`` (the server did not take the hold) or ``"ended"`` (the run ended).
    """
    held = await request("POST", f"/v1/tasks/{task_id}/held", json={"num_samples": num_samples})
    if held.status_code != 202:
        return "refused"
    after = ""
    member: SecAggClient | None = None
    encoded: Any = None
    while True:
        response = await request("GET", "/v1/secagg", params={"wait_s": poll_s, "after": after})
        if response.status_code == 204:
            continue
        if response.status_code != 200:
            return "ended" if response.status_code == 410 else "refused"
        step = response.json()
        after, name = f"{step['group']}/{step['round']}", str(step["round"])
        if name == "done":
            return "dropped" if step.get("dropped") else "summed"
        try:
            if name == "advertise":
                member, encoded = _join(client_id, step, delta)
                message = member.advertise()
            elif member is None:
                return "dropped"  # a round of a group this client never joined
            else:
                message = await asyncio.to_thread(_answer, member, name, step, encoded)
        except ProtocolAbort:
            return "dropped"  # too few neighbours went on: this client stops answering
        await request(
            "POST",
            f"/v1/secagg/{step['group']}/{name}",
            content=message.to_bytes(),
            headers={"content-type": "application/octet-stream"},
        )


def _join(client_id: int, step: dict[str, Any], delta: torch.Tensor) -> tuple[SecAggClient, Any]:
    """Return this client's side of the group ``step`` announces and its update, weighted and encoded."""
    params = GroupParams(
        group_id=bytes.fromhex(step["group_id"]),
        bits=int(step["bits"]),
        length=int(step["length"]),
        threshold=int(step["threshold"]),
        neighbours={int(c): frozenset(int(v) for v in vs) for c, vs in step["neighbours"].items()},
    )
    encoding = WeightedEncoding.create(params.bits, float(step["clip"]), int(step["group_size"]))
    encoded = encoding.encode(delta, float(step["weight"]), float(step["example_weight"]))
    return SecAggClient(client_id, params, SystemRandom()), encoded


def _answer(member: SecAggClient, name: str, step: dict[str, Any], encoded: Any) -> Any:
    """Return this client's message of round ``name`` from what the server sent it (worker thread)."""
    incoming: Any = decode_message(base64.b64decode(step["message"]))
    if name == "share":
        return member.share(incoming)
    if name == "mask":
        member.receive_shares(incoming)
        return member.mask(encoded)
    return member.unmask(incoming)
