"""Accounting: every outcome counted once, genuine error streaks fail the run, per-version figures start afresh."""

from __future__ import annotations

import pytest

from flasync.core.client_table import ClientTable
from flasync.core.errors import TrainingError
from flasync.server import Accounting
from flasync.testing import ScriptedClients, ServerHarness

pytestmark = pytest.mark.timeout(30)


def test_outcomes_and_bytes_are_counted() -> None:
    """Accepted, rejected, failed, timed out and abandoned tasks each land in their own counter."""
    accounting = Accounting(failure_limit=10)
    accounting.accepted(2)
    accounting.accepted(0)
    accounting.rejected("norm")
    accounting.failed("crash", "injected")
    accounting.timed_out()
    accounting.abandoned(3)
    accounting.uploaded(100)
    stats = accounting.stats
    assert (stats.updates_accepted, stats.updates_dropped, stats.updates_failed) == (2, 1, 1)
    assert (stats.tasks_timed_out, stats.tasks_abandoned, stats.upload_bytes) == (1, 3, 100)
    assert (stats.staleness_sum, stats.staleness_max, stats.staleness_mean) == (2, 2, 1.0)
    assert stats.drop_reasons == {"norm": 1} and stats.failure_kinds == {"crash": 1}


def test_a_streak_of_genuine_errors_fails_the_run_and_injected_faults_never_do() -> None:
    """failure_limit consecutive 'error' failures raise; crashes, dropouts and an accepted update break no streak."""
    accounting = Accounting(failure_limit=3)
    for _ in range(10):
        accounting.failed("crash", "injected")
        accounting.failed("dropout", "left")
    accounting.failed("error", "boom")
    accounting.failed("error", "boom")
    accounting.accepted(0)  # a success resets the streak
    accounting.failed("error", "boom")
    accounting.failed("error", "boom")
    with pytest.raises(TrainingError, match="the last 3 client tasks all failed; the last error: boom"):
        accounting.failed("error", "boom")


def test_version_figures_cover_what_came_since_the_last_version() -> None:
    """close_version returns the updates, mean staleness and cloud bytes since the previous one, then resets."""
    accounting = Accounting(failure_limit=3)
    accounting.accepted(1)
    accounting.accepted(3)
    accounting.ingress(10)
    accounting.dispatched(7, from_cloud=True)
    accounting.dispatched(5, from_cloud=False)  # an edge's client downloads from its edge
    figures = accounting.close_version(1)
    assert (figures.updates, figures.staleness_mean, figures.ingress_bytes, figures.egress_bytes) == (2, 2.0, 10, 7)
    assert accounting.stats.versions == 1 and accounting.stats.download_bytes == 12
    empty = accounting.close_version(2)
    assert (empty.updates, empty.ingress_bytes, empty.egress_bytes) == (0, 0, 0)


def test_state_round_trip() -> None:
    """Counters, the streak and the open version's figures survive a checkpoint."""
    accounting = Accounting(failure_limit=2)
    accounting.accepted(4)
    accounting.failed("error", "x")
    accounting.ingress(9)
    restored = Accounting(failure_limit=2)
    restored.load_state_dict(accounting.state_dict())
    assert restored.stats == accounting.stats
    with pytest.raises(TrainingError):
        restored.failed("error", "x")  # the streak of one came along
    assert restored.close_version(1).ingress_bytes == 9


async def test_a_server_counts_failures_once_and_refills_their_slots() -> None:
    """Every third client crashes: the run still makes its versions, and each failure is counted once."""
    harness = ServerHarness(
        max_versions=4,
        clients=lambda bus, clock: ScriptedClients(
            bus, clock, 4, fail=lambda task: "crash" if int(task.client_id) % 3 == 0 else None
        ),
    )
    stats = await harness.run()
    crashed = [t for t in harness.clients.started if int(t.client_id) % 3 == 0 and t.task_id < stats.tasks_dispatched]
    assert stats.versions == 4 and stats.updates_accepted == 8
    assert stats.updates_failed == len(harness.log.events("server.failure"))
    assert stats.updates_failed <= len(crashed)
    assert stats.failure_kinds == {"crash": stats.updates_failed}


def test_a_streak_of_refusals_ends_the_run_with_the_reasons() -> None:
    """rejection_limit refusals in a row (no accepted update between) raise, naming the reasons; one accept resets."""
    accounting = Accounting(failure_limit=3, rejection_limit=4)
    for _ in range(3):
        accounting.rejected("zscore")
    accounting.accepted(0)
    accounting.rejected("zscore")
    accounting.rejected("norm")
    accounting.rejected("zscore")
    with pytest.raises(TrainingError, match=r"the last 4 updates were all refused \(zscore x3, norm x1\)"):
        accounting.rejected("zscore")


async def test_a_server_that_refuses_everything_ends_instead_of_spinning() -> None:
    """Every update over the norm bound: the run ends with a clear reason after the refusal limit, not never."""
    harness = ServerHarness(
        max_versions=3,
        max_update_norm=0.001,  # the scripted deltas have norm 0.02
        clients=lambda bus, clock: ScriptedClients(bus, clock, 4),
    )
    harness.accounting.rejection_limit = 25
    with pytest.raises(ExceptionGroup) as caught:
        await harness.run()
    assert caught.group_contains(TrainingError, match=r"the last 25 updates were all refused \(norm x25\)", depth=2)
    assert harness.accounting.stats.updates_accepted == 0


def test_outcomes_of_known_clients_go_to_the_client_table() -> None:
    """With a client table, each outcome and byte of a known client is counted in its row too, and the table is part
    of the accounting's checkpoint state."""
    accounting = Accounting(failure_limit=10, clients=ClientTable(rows=10, top=10))
    accounting.dispatched(7, from_cloud=True, client_id=3)
    accounting.uploaded(5, client_id=3)
    accounting.accepted(2, client_id=3)
    accounting.rejected("norm", client_id=4)
    accounting.failed("crash", "injected", client_id=4)
    accounting.timed_out(client_id=5)
    accounting.accepted(1)  # no client id (e.g. a partial aggregate): counted in the totals only
    restored = Accounting(failure_limit=10, clients=ClientTable(rows=10, top=10))
    restored.load_state_dict(accounting.state_dict())
    assert restored.clients is not None
    rows = {row[1]: row[2:] for row in restored.clients.table()["data"]}
    # tasks, accepted, refused, failed, timed_out, staleness_mean, upload, download, refused.norm
    assert rows == {
        3: [1, 1, 0, 0, 0, 2.0, 5, 7, 0],
        4: [0, 0, 1, 1, 0, None, 0, 0, 1],
        5: [0, 0, 0, 0, 1, None, 0, 0, 0],
    }
    assert restored.stats.updates_accepted == 2


def test_an_arrival_counts_as_an_upload_and_cloud_ingress() -> None:
    """arrived() counts what uploaded() and ingress() count together: the run's and the client's upload bytes, the
    cloud's ingress and the version's."""
    one, both = (Accounting(failure_limit=10, clients=ClientTable(rows=10, top=10)) for _ in range(2))
    for client, size in ((3, 100), (5, 40), (3, 7)):
        one.arrived(size, client_id=client)
        both.uploaded(size, client_id=client)
        both.ingress(size)
    assert one.state_dict() == both.state_dict()
    assert one.stats.upload_bytes == one.stats.cloud_ingress_bytes == 147
    assert one.close_version(1).ingress_bytes == 147


@pytest.mark.parametrize("table", [False, True])
def test_updates_taken_together_are_counted_as_each_arrived_and_accepted_in_turn(table: bool) -> None:
    """:meth:`Accounting.took` leaves the counters, the version's figures and the per-client table as
    :meth:`arrived` and then :meth:`accepted` of each update in turn; a refusal's streak ends alike."""
    sizes, staleness, clients = [10, 20, 30, 40, 50], [0, 2, 1, 0, 3], [7, 3, 7, 9, 1]
    together = Accounting(failure_limit=3, rejection_limit=5, clients=ClientTable(3, 2) if table else None)
    one_by_one = Accounting(failure_limit=3, rejection_limit=5, clients=ClientTable(3, 2) if table else None)
    for accounting in (together, one_by_one):
        accounting.rejected("norm", client_id=4)
        accounting.rejected("stale", client_id=4)
    together.took(sizes, staleness, clients)
    together.took([], [], [])
    for size, tau, client in zip(sizes, staleness, clients, strict=True):
        one_by_one.arrived(size, client_id=client)
        one_by_one.accepted(tau, client_id=client)
    assert together.state_dict() == one_by_one.state_dict()
    assert together.close_version(1) == one_by_one.close_version(1)


@pytest.mark.parametrize(("table", "from_cloud"), [(False, True), (True, True), (True, False)])
def test_tasks_dispatched_together_are_counted_as_each_in_turn(table: bool, from_cloud: bool) -> None:
    """:meth:`Accounting.dispatched_many` numbers the tasks as :meth:`dispatched` of each in turn would, and leaves
    the same counters, egress, version figures and per-client table; none dispatched counts nothing."""
    clients = [7, 3, 9, 1]
    together = Accounting(failure_limit=3, clients=ClientTable(3, 2) if table else None)
    one_by_one = Accounting(failure_limit=3, clients=ClientTable(3, 2) if table else None)
    for accounting in (together, one_by_one):
        accounting.dispatched(500, from_cloud=True, client_id=4)
    ids = together.dispatched_many(1234, clients, from_cloud=from_cloud)
    assert together.dispatched_many(1234, [], from_cloud=from_cloud) == range(5, 5)
    assert (
        list(ids) == [one_by_one.dispatched(1234, from_cloud=from_cloud, client_id=c) for c in clients] == [1, 2, 3, 4]
    )
    assert together.state_dict() == one_by_one.state_dict()
    assert together.close_version(1) == one_by_one.close_version(1)
