"""The next task in an upload's answer (``POST /v1/tasks/{id}/update?next=inline&have=V``) over a real uvicorn server
on loopback: the task with its model, an empty body for a device that holds the version, no offer when none is
posted, today's answer for a client that does not ask, the counters counting each task and upload once, and the
remote client against a server that carries the next task and one that ignores ``next``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.remote_load import precomputed_update
from flasync.clients.remote.client import Client
from flasync.runtime.serve import INCARNATION_HEADER, OFFER_HEADER, REPORT_HEADER
from tests.conftest import NUM_CLIENTS
from tests.integration.remote.test_downloads import _App, counting_paths, device_headers, offer_of, served

pytestmark = pytest.mark.timeout(120)

# No aggregation while a test runs: every update goes to the buffer and the freed device is handed its next task.
_BUFFERED = {"server": {"kind": "fedbuff", "buffer_size": 1000, "concurrency": NUM_CLIENTS}}
# One task at a time, to the device least recently given one: an answered device's next task goes to another.
_ROUND_ROBIN = {
    "server": {"kind": "fedbuff", "buffer_size": 1000, "concurrency": 1},
    "population": {"num_clients": NUM_CLIENTS, "sampling": "lru"},
}


async def _upload(
    http: httpx.AsyncClient, headers: dict[str, str], offer: dict[str, Any], update: bytes, **params: Any
) -> httpx.Response:
    """Upload ``update`` for ``offer`` (with ``params``: ``next``, ``have``)."""
    return await http.post(
        f"/v1/tasks/{offer['task_id']}/update",
        params=params,
        content=update,
        headers={
            **headers,
            REPORT_HEADER: json.dumps({"num_samples": 10, "train_loss": 1.0}),
            INCARNATION_HEADER: str(offer["incarnation"]),
        },
    )


async def _update(http: httpx.AsyncClient, headers: dict[str, str]) -> bytes:
    """Return an update of the served model's size, encoded as a client encodes it (once the run started)."""
    for _ in range(500):
        hello = await http.get("/v1/hello", headers=headers)
        if hello.status_code == 200:
            return precomputed_update(hello.json())
        await asyncio.sleep(0.01)
    raise AssertionError("the run did not start")


async def test_the_upload_answer_carries_the_next_task_and_its_model(tmp_path: Path, tokens: dict[int, str]) -> None:
    """Asked with ``next=inline``, the 202 holds the device's next task in the offer header and the model of its
    version as the body (the very bytes of the model endpoint); naming that version as held, the body is empty; the
    task is handed once and may still be asked for by ``GET /v1/task`` (an answer lost on the way); each task and
    upload is counted once."""
    async with served(tmp_path, **_BUFFERED) as (url, federation), httpx.AsyncClient(base_url=url, timeout=30) as http:
        transport = federation.transport
        assert transport is not None
        headers = device_headers(tokens[0])
        update = await _update(http, headers)
        offer = json.loads((await offer_of(http, headers, model="inline", have=-1)).headers[OFFER_HEADER])
        version = offer["base_version"]
        first = await _upload(http, headers, offer, update, next="inline", have=-1)
        assert first.status_code == 202 and first.headers["content-type"] == "application/octet-stream"
        following = json.loads(first.headers[OFFER_HEADER])
        assert following["task_id"] != offer["task_id"] and following["base_version"] == version
        model = await http.get(f"/v1/models/{version}", headers=headers)
        assert first.content == model.content and first.headers["etag"] == model.headers["etag"]
        again = await offer_of(http, headers, model="inline", have=version)  # the answer was lost: the same task
        assert json.loads(again.headers[OFFER_HEADER]) == following and again.content == b""
        second = await _upload(http, headers, following, update, next="inline", have=version)
        assert second.status_code == 202 and second.content == b""
        last = json.loads(second.headers[OFFER_HEADER])
        assert last["task_id"] not in (offer["task_id"], following["task_id"])
        statistics = transport.statistics()
        assert (statistics["handed"], statistics["uploads"], transport.uploads) == (3, 2, 2)
        # the model inline with the first offer and with the upload's answer, and the endpoint's: nothing counted twice
        assert transport.wire_download_bytes == 3 * len(model.content)
        assert transport.refusals == {}


@pytest.mark.slow
async def test_without_a_posted_task_the_answer_has_no_offer(tmp_path: Path, tokens: dict[int, str]) -> None:
    """When the device's next task goes elsewhere, the upload's answer is today's 202 with no offer; the device then
    long-polls ``GET /v1/task`` as before and is handed its next task there once its turn comes."""
    round_robin = served(tmp_path, **_ROUND_ROBIN)
    async with round_robin as (url, federation), httpx.AsyncClient(base_url=url, timeout=30) as http:
        transport = federation.transport
        assert transport is not None
        everyone = {client_id: device_headers(token) for client_id, token in tokens.items()}
        update = await _update(http, everyone[0])
        for headers in everyone.values():  # every device says hello: each is known, each gets its turn
            assert (await http.get("/v1/hello", headers=headers)).status_code == 200
        holder, offer = await _holder(http, everyone)
        answer = await _upload(http, everyone[holder], offer, update, next="inline", have=offer["base_version"])
        assert answer.status_code == 202 and OFFER_HEADER not in answer.headers
        assert answer.json() == {"status": "received", "task_id": offer["task_id"]}
        asked = await http.get("/v1/task", params={"wait_s": 0}, headers=everyone[holder])
        assert asked.status_code == 204
        for _ in range(10 * NUM_CLIENTS):  # the others answer their tasks (without next) until it is its turn again
            other, task = await _holder(http, everyone)
            if other == holder:
                break
            assert (await _upload(http, everyone[other], task, update)).status_code == 202
        else:
            raise AssertionError(f"device {holder} was never handed a task again")
        assert task["task_id"] > offer["task_id"]
        assert transport.statistics()["handed"] == transport.uploads + 1  # its task now is not answered yet


async def _holder(http: httpx.AsyncClient, everyone: dict[int, dict[str, str]]) -> tuple[int, dict[str, Any]]:
    """Return the device holding the one task of the run and the task (asking each device until one has it)."""
    for _ in range(200):
        for client_id, headers in everyone.items():
            response = await http.get("/v1/task", params={"wait_s": 0.05}, headers=headers)
            if response.status_code == 200:
                task: dict[str, Any] = response.json()
                return client_id, task
    raise AssertionError("no device was handed a task")


async def test_a_client_that_does_not_ask_gets_todays_answer(tmp_path: Path, tokens: dict[int, str]) -> None:
    """An upload without ``next`` is answered 202 with the JSON it always was, even when the device's next task is
    posted; that task is handed by ``GET /v1/task``."""
    async with served(tmp_path, **_BUFFERED) as (url, federation), httpx.AsyncClient(base_url=url, timeout=30) as http:
        transport = federation.transport
        assert transport is not None
        headers = device_headers(tokens[1])
        update = await _update(http, headers)
        offer = (await offer_of(http, headers)).json()
        answer = await _upload(http, headers, offer, update)
        assert answer.status_code == 202 and OFFER_HEADER not in answer.headers
        assert answer.headers["content-type"] == "application/json"
        assert answer.json() == {"status": "received", "task_id": offer["task_id"]}
        following = (await offer_of(http, headers)).json()
        assert following["task_id"] != offer["task_id"]
        assert (transport.statistics()["handed"], transport.uploads) == (2, 1)
        bad = await _upload(http, headers, following, update, next="inline", have="v1")
        assert (bad.status_code, bad.json()["error"]) == (400, "bad_request")
        assert transport.uploads == 1  # refused before the update was taken


def _ignoring_next(app: _App) -> _App:
    """Return ``app`` behind a server that knows no ``next``: an upload's query is dropped."""

    async def older(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].endswith("/update"):
            scope = {**scope, "query_string": b""}
        await app(scope, receive, send)

    return older


@pytest.mark.slow
@pytest.mark.parametrize("carries", [True, False], ids=["server-carries", "older-server"])
async def test_the_remote_client_trains_against_either_server(
    tmp_path: Path, tokens: dict[int, str], carries: bool
) -> None:
    """flasync's client takes its next task from an upload's answer when the server carries it (asking for a task
    only once) and long-polls for each when the server ignores ``next``; either way every task it was handed is
    answered or left at the end, and the server counts each upload once."""
    paths: list[str] = []
    wrap = counting_paths(paths, None if carries else _ignoring_next)
    async with served(tmp_path, wrap, **_BUFFERED) as (url, federation):
        client = Client(url, tokens[3], poll_s=2.0, backoff_s=0.05)
        stats = await client.run(max_tasks=3)
        transport = federation.transport
        assert transport is not None
        assert stats.uploads == 3 == transport.uploads and stats.dropped == 0 and stats.tasks == 3
        assert stats.download_bytes == transport.wire_download_bytes > 0
        assert transport.statistics()["handed"] == 3
    asked = sum(path == "/v1/task" for path in paths)
    assert asked == (1 if carries else 3)


async def test_hello_answers_each_device_its_id_with_the_runs_setup(tmp_path: Path, tokens: dict[int, str]) -> None:
    """``GET /v1/hello`` is a JSON object: the device's own id, the upload limit and the run's setup (its config
    without the server's sections, the model's size and shape), the same setup for every device."""
    async with served(tmp_path, **_BUFFERED) as (url, federation), httpx.AsyncClient(base_url=url, timeout=30) as http:
        transport = federation.transport
        assert transport is not None
        await _update(http, device_headers(tokens[0]))  # once the run started
        answers = [(await http.get("/v1/hello", headers=device_headers(tokens[c]))) for c in (0, 1)]
    assert all(a.status_code == 200 and a.headers["content-type"] == "application/json" for a in answers)
    first, second = (a.json() for a in answers)
    assert (first["client_id"], second["client_id"]) == (0, 1)
    assert first["max_upload_bytes"] == transport.max_upload_bytes
    assert first["num_params"] == transport.num_params and first["num_classes"] > 1 and first["feature_shape"]
    assert "tracking" not in first["config"] and "remote" not in first["config"]
    assert {k: v for k, v in first.items() if k != "client_id"} == {k: v for k, v in second.items() if k != "client_id"}
