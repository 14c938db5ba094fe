"""Tests of the typed publish/subscribe event bus."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flasync.core.bus import BusStatistics, EventBus, OverflowPolicy, Subscription, SubscriptionStatistics
from flasync.core.errors import BusClosed, BusFull
from flasync.core.instruments import Instrument

pytestmark = pytest.mark.timeout(5)


@dataclass(frozen=True, slots=True, kw_only=True)
class Tick:
    n: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Tock:
    n: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Derived(Tick):
    pass


async def settle(rounds: int = 10) -> None:
    """Let every ready task run until it blocks."""
    for _ in range(rounds):
        await asyncio.sleep(0)


def drain(subscription: Subscription[Any]) -> list[Any]:
    """Receive everything queued in ``subscription`` without waiting."""
    events = []
    while subscription.statistics().queued:
        events.append(subscription.receive_nowait())
    return events


async def test_publish_blocks_on_full_block_subscriber_until_it_receives() -> None:
    """A publisher waits while a block subscriber is full and resumes once it receives."""
    bus = EventBus()
    sub = bus.subscribe(Tick, capacity=1)
    await bus.publish(Tick(n=0))
    publisher = asyncio.create_task(bus.publish(Tick(n=1)))
    await settle()
    assert not publisher.done()
    assert sub.receive_nowait() == Tick(n=0)
    await asyncio.wait_for(publisher, 1)
    assert sub.receive_nowait() == Tick(n=1)


async def test_drop_oldest_drops_and_counts_the_oldest_event() -> None:
    """A full drop_oldest subscriber loses its oldest event, counted in dropped; the publisher never waits."""
    bus = EventBus()
    sub = bus.subscribe(Tick, capacity=2, policy=OverflowPolicy.DROP_OLDEST)
    for n in range(5):
        await bus.publish(Tick(n=n))
    assert drain(sub) == [Tick(n=3), Tick(n=4)]
    assert sub.statistics().dropped == 3
    assert bus.statistics().dropped == 3


async def test_policy_accepts_its_string_value() -> None:
    """The policy can be given as its string value, as a config file would."""
    bus = EventBus()
    sub = bus.subscribe(Tick, capacity=1, policy="drop_oldest")  # type: ignore[call-overload]
    assert sub.policy is OverflowPolicy.DROP_OLDEST


async def test_subscriber_receives_only_its_types_subclasses_included() -> None:
    """A subscription gets instances of its types, subclasses included, and nothing else."""
    bus = EventBus()
    ticks = bus.subscribe(Tick)
    tocks = bus.subscribe(Tock)
    for event in (Tick(n=0), Tock(n=1), Derived(n=2), "text", 3):
        await bus.publish(event)
    assert drain(ticks) == [Tick(n=0), Derived(n=2)]
    assert drain(tocks) == [Tock(n=1)]


async def test_subscription_without_types_receives_every_event() -> None:
    """A subscription made with no types receives every published event."""
    bus = EventBus()
    everything = bus.subscribe()
    events = [Tick(n=0), Tock(n=1), "text", None]
    for event in events:
        await bus.publish(event)
    assert drain(everything) == events


async def test_subscription_to_several_types_receives_each() -> None:
    """A subscription to several types receives an instance of any of them."""
    bus = EventBus()
    sub = bus.subscribe(Tick, Tock)
    for event in (Tick(n=0), "text", Tock(n=1)):
        await bus.publish(event)
    assert drain(sub) == [Tick(n=0), Tock(n=1)]


async def test_close_ends_every_async_for_after_draining() -> None:
    """Closing the bus lets each subscriber's async for drain its queue and then end."""
    bus = EventBus()
    first, second = bus.subscribe(Tick), bus.subscribe()
    for n in range(3):
        await bus.publish(Tick(n=n))
    bus.close()

    async def collect(sub: Subscription[Any]) -> list[Any]:
        return [event async for event in sub]

    results = await asyncio.gather(collect(first), collect(second))
    assert list(results) == [[Tick(n=0), Tick(n=1), Tick(n=2)]] * 2


async def test_close_wakes_a_waiting_receiver() -> None:
    """A receiver waiting on an empty queue gets BusClosed when the bus closes."""
    bus = EventBus()
    sub = bus.subscribe(Tick)
    receiver = asyncio.create_task(sub.receive())
    await settle()
    bus.close()
    with pytest.raises(BusClosed):
        await asyncio.wait_for(receiver, 1)


async def test_receive_raises_bus_closed_once_closed_and_drained() -> None:
    """After close, receive returns what is queued and then raises BusClosed."""
    bus = EventBus()
    sub = bus.subscribe(Tick)
    await bus.publish(Tick(n=0))
    bus.close()
    assert await sub.receive() == Tick(n=0)
    with pytest.raises(BusClosed):
        await sub.receive()
    with pytest.raises(BusClosed):
        sub.receive_nowait()


async def test_publish_after_close_raises_bus_closed() -> None:
    """Publishing, with or without waiting, on a closed bus raises BusClosed."""
    bus = EventBus()
    bus.subscribe(Tick)
    bus.close()
    with pytest.raises(BusClosed):
        await bus.publish(Tick(n=0))
    with pytest.raises(BusClosed):
        bus.publish_nowait(Tick(n=0))


async def test_subscribe_after_close_raises_bus_closed() -> None:
    """Subscribing to a closed bus raises BusClosed."""
    bus = EventBus()
    bus.close()
    with pytest.raises(BusClosed):
        bus.subscribe(Tick)


async def test_close_is_idempotent() -> None:
    """Closing a closed bus or subscription again does nothing."""
    bus = EventBus()
    sub = bus.subscribe(Tick)
    sub.close()
    sub.close()
    bus.close()
    bus.close()
    assert bus.closed
    assert sub.closed


async def test_close_releases_blocked_publisher_with_bus_closed() -> None:
    """A publisher waiting for room gets BusClosed when the bus closes, and delivers nothing."""
    bus = EventBus()
    sub = bus.subscribe(Tick, capacity=1)
    await bus.publish(Tick(n=0))
    publisher = asyncio.create_task(bus.publish(Tick(n=1)))
    await settle()
    bus.close()
    with pytest.raises(BusClosed):
        await asyncio.wait_for(publisher, 1)
    assert [event async for event in sub] == [Tick(n=0)]
    assert bus.statistics().published == 1


async def test_publish_nowait_raises_bus_full_and_delivers_to_no_one() -> None:
    """publish_nowait raises BusFull when a block subscriber is full, leaving every queue untouched."""
    bus = EventBus()
    roomy = bus.subscribe(Tick, capacity=10)
    lossy = bus.subscribe(Tick, capacity=1, policy=OverflowPolicy.DROP_OLDEST)
    full = bus.subscribe(Tick, capacity=1)
    bus.publish_nowait(Tick(n=0))
    with pytest.raises(BusFull):
        bus.publish_nowait(Tick(n=1))
    assert drain(roomy) == drain(lossy) == drain(full) == [Tick(n=0)]
    assert lossy.statistics().dropped == 0
    assert bus.statistics().published == 1


async def test_statistics_are_exact() -> None:
    """Bus and subscription statistics count published, delivered, dropped and high water exactly."""
    bus = EventBus()
    blocking = bus.subscribe(Tick, capacity=3, name="blocking")
    lossy = bus.subscribe(capacity=2, policy=OverflowPolicy.DROP_OLDEST)
    for n in range(3):
        await bus.publish(Tick(n=n))
    await bus.publish("unmatched by blocking")
    blocking.receive_nowait()
    blocking.receive_nowait()
    lossy.receive_nowait()
    assert blocking.statistics() == SubscriptionStatistics(
        name="blocking", capacity=3, queued=1, delivered=2, dropped=0, high_water=3
    )
    assert lossy.statistics() == SubscriptionStatistics(
        name="*", capacity=2, queued=1, delivered=1, dropped=2, high_water=2
    )
    assert bus.statistics() == BusStatistics(published=4, delivered=3, dropped=2, high_water=3, subscribers=2)


async def test_default_name_comes_from_the_types() -> None:
    """A subscription without a name is named after its event types."""
    bus = EventBus()
    assert bus.subscribe(Tick, Tock).name == "Tick|Tock"


async def test_order_is_preserved_under_backpressure() -> None:
    """Every subscriber receives one publisher's events in publish order, even while it blocks."""
    bus = EventBus()
    slow = bus.subscribe(Tick, capacity=2)
    fast = bus.subscribe(Tick, capacity=100)
    lossy = bus.subscribe(Tick, capacity=3, policy=OverflowPolicy.DROP_OLDEST)

    async def produce() -> None:
        for n in range(100):
            await bus.publish(Tick(n=n))
        bus.close()

    async def consume(sub: Subscription[Tick]) -> list[int]:
        numbers = []
        async for event in sub:
            numbers.append(event.n)
            await asyncio.sleep(0)
        return numbers

    async with asyncio.TaskGroup() as group:
        group.create_task(produce())
        slow_task = group.create_task(consume(slow))
    assert slow_task.result() == list(range(100))
    assert drain(fast) == [Tick(n=n) for n in range(100)]
    lossy_numbers = [event.n for event in drain(lossy)]
    assert lossy_numbers == sorted(lossy_numbers)


async def test_blocked_publishers_get_room_in_arrival_order() -> None:
    """Publishers waiting on one full subscriber deliver in the order they started waiting."""
    bus = EventBus()
    sub = bus.subscribe(Tick, capacity=1)
    await bus.publish(Tick(n=0))
    publishers = []
    for n in range(1, 4):
        publishers.append(asyncio.create_task(bus.publish(Tick(n=n))))
        await settle()
    received = []
    for _ in range(4):
        received.append((await sub.receive()).n)
        await settle()
    assert received == [0, 1, 2, 3]
    await asyncio.gather(*publishers)


async def test_newcomer_does_not_overtake_a_blocked_publisher() -> None:
    """A slot freed while a publisher waits goes to that publisher, not to a later publish_nowait."""
    bus = EventBus()
    sub = bus.subscribe(Tick, capacity=1)
    await bus.publish(Tick(n=0))
    waiting = asyncio.create_task(bus.publish(Tick(n=1)))
    await settle()
    assert sub.receive_nowait() == Tick(n=0)
    with pytest.raises(BusFull):
        bus.publish_nowait(Tick(n=2))
    await asyncio.wait_for(waiting, 1)
    assert drain(sub) == [Tick(n=1)]


async def test_blocked_publish_delivers_to_no_one_until_all_have_room() -> None:
    """While a publish waits for one full subscriber, the others do not get the event yet."""
    bus = EventBus()
    full = bus.subscribe(Tick, capacity=1)
    roomy = bus.subscribe(Tick, capacity=5)
    await bus.publish(Tick(n=0))
    publisher = asyncio.create_task(bus.publish(Tick(n=1)))
    await settle()
    assert drain(roomy) == [Tick(n=0)]
    full.receive_nowait()
    await asyncio.wait_for(publisher, 1)
    assert drain(roomy) == drain(full) == [Tick(n=1)]


async def test_cancelled_blocked_publish_leaves_no_partial_state() -> None:
    """Cancelling a waiting publish delivers nothing, counts nothing and frees the slots it had reserved."""
    bus = EventBus()
    full = bus.subscribe(Tick, capacity=1)
    roomy = bus.subscribe(Tick, capacity=2)
    lossy = bus.subscribe(Tick, capacity=1, policy=OverflowPolicy.DROP_OLDEST)
    await bus.publish(Tick(n=0))
    before = bus.statistics()
    publisher = asyncio.create_task(bus.publish(Tick(n=1)))
    await settle()
    publisher.cancel()
    with pytest.raises(asyncio.CancelledError):
        await publisher
    assert bus.statistics() == before
    full.receive_nowait()
    bus.publish_nowait(Tick(n=2))
    assert drain(full) == [Tick(n=2)]
    assert drain(roomy) == [Tick(n=0), Tick(n=2)]
    assert drain(lossy) == [Tick(n=2)]


async def test_cancelled_publish_passes_its_turn_to_the_next_publisher() -> None:
    """When the first waiting publisher is cancelled, the next one gets the freed slot."""
    bus = EventBus()
    sub = bus.subscribe(Tick, capacity=1)
    await bus.publish(Tick(n=0))
    first = asyncio.create_task(bus.publish(Tick(n=1)))
    await settle()
    second = asyncio.create_task(bus.publish(Tick(n=2)))
    await settle()
    sub.receive_nowait()
    first.cancel()
    await settle()
    await asyncio.wait_for(second, 1)
    assert first.cancelled()
    assert drain(sub) == [Tick(n=2)]


async def test_cancelled_receive_loses_no_event() -> None:
    """Cancelling a waiting receive does not lose the next event."""
    bus = EventBus()
    sub = bus.subscribe(Tick)
    receiver = asyncio.create_task(sub.receive())
    await settle()
    bus.publish_nowait(Tick(n=0))
    receiver.cancel()
    await settle()
    assert sub.receive_nowait() == Tick(n=0)


async def test_receive_waits_for_the_next_publish() -> None:
    """A receiver on an empty queue wakes when an event is published."""
    bus = EventBus()
    sub = bus.subscribe(Tick)
    receiver = asyncio.create_task(sub.receive())
    await settle()
    assert not receiver.done()
    await bus.publish(Tick(n=0))
    assert await asyncio.wait_for(receiver, 1) == Tick(n=0)


async def test_receive_nowait_on_empty_queue_raises_queue_empty() -> None:
    """receive_nowait raises asyncio.QueueEmpty when nothing is queued and the bus is open."""
    bus = EventBus()
    sub = bus.subscribe(Tick)
    with pytest.raises(asyncio.QueueEmpty):
        sub.receive_nowait()


async def test_subscription_close_unsubscribes() -> None:
    """A closed subscription gets no more events, keeps what was queued, and then ends."""
    bus = EventBus()
    sub = bus.subscribe(Tick)
    await bus.publish(Tick(n=0))
    sub.close()
    await bus.publish(Tick(n=1))
    assert bus.statistics().subscribers == 0
    assert [event async for event in sub] == [Tick(n=0)]


async def test_subscription_close_releases_publisher_blocked_on_it() -> None:
    """A publisher waiting for room in a subscription completes, delivering elsewhere, when it closes."""
    bus = EventBus()
    full = bus.subscribe(Tick, capacity=1)
    other = bus.subscribe(Tick)
    await bus.publish(Tick(n=0))
    publisher = asyncio.create_task(bus.publish(Tick(n=1)))
    await settle()
    full.close()
    await asyncio.wait_for(publisher, 1)
    assert drain(other) == [Tick(n=0), Tick(n=1)]
    assert drain(full) == [Tick(n=0)]


async def test_context_manager_closes_the_subscription() -> None:
    """Leaving a with block closes the subscription."""
    bus = EventBus()
    with bus.subscribe(Tick) as sub:
        assert not sub.closed
    assert sub.closed
    assert bus.statistics().subscribers == 0


async def test_on_activity_is_called_on_every_publish_and_delivery() -> None:
    """on_activity runs once per publish (waiting or not) and once per event received."""
    calls = 0

    def on_activity() -> None:
        nonlocal calls
        calls += 1

    bus = EventBus(on_activity=on_activity)
    sub = bus.subscribe(Tick)
    await bus.publish(Tick(n=0))
    bus.publish_nowait(Tick(n=1))
    await bus.publish("unmatched")
    assert calls == 3
    await sub.receive()
    sub.receive_nowait()
    assert calls == 5


async def test_capacity_below_one_is_rejected() -> None:
    """subscribe raises ValueError for a capacity below 1."""
    bus = EventBus()
    with pytest.raises(ValueError, match="capacity"):
        bus.subscribe(Tick, capacity=0)


async def test_non_class_type_is_rejected() -> None:
    """subscribe raises TypeError when an event type is not a class."""
    bus = EventBus()
    with pytest.raises(TypeError, match="classes"):
        bus.subscribe(Tick(n=0))  # type: ignore[call-overload]


EVENT_MAKERS: tuple[Callable[[int], object], ...] = (
    lambda n: Tick(n=n),
    lambda n: Tock(n=n),
    lambda n: Derived(n=n),
    str,
)
SUBSCRIBED_TYPES = ((), (Tick,), (Tock,), (Derived,), (Tick, Tock))
subscription_specs = st.lists(
    st.tuples(st.integers(1, 3), st.sampled_from(list(OverflowPolicy)), st.sampled_from(SUBSCRIBED_TYPES)),
    min_size=1,
    max_size=4,
)


def make_event(kind: int, n: int) -> object:
    """Build the n-th event of the given kind."""
    return EVENT_MAKERS[kind](n)


def matching(subscription: Subscription[Any], event: object) -> bool:
    """Tell whether ``event`` is one the subscription asked for."""
    return not subscription.types or isinstance(event, subscription.types)


def assert_conserved(bus: EventBus, subscriptions: list[Subscription[Any]], published: list[object]) -> None:
    """Check published * matching = delivered + dropped + queued, per subscription and for the bus."""
    for sub in subscriptions:
        stats = sub.statistics()
        expected = sum(matching(sub, event) for event in published)
        assert expected == stats.delivered + stats.dropped + stats.queued
        assert stats.queued <= stats.high_water <= stats.capacity
    totals = bus.statistics()
    assert totals.published == len(published)
    assert totals.delivered == sum(sub.statistics().delivered for sub in subscriptions)
    assert totals.dropped == sum(sub.statistics().dropped for sub in subscriptions)
    assert totals.high_water == max(sub.statistics().high_water for sub in subscriptions)


@pytest.mark.timeout(60)
@settings(max_examples=200, deadline=None)
@given(
    specs=subscription_specs,
    operations=st.lists(st.tuples(st.sampled_from(["publish", "receive"]), st.integers(0, 3)), max_size=60),
)
def test_conservation_law_without_waiting(
    specs: list[tuple[int, OverflowPolicy, tuple[type[Any], ...]]], operations: list[tuple[str, int]]
) -> None:
    """published * matching = delivered + dropped + queued for any publish_nowait/receive_nowait mix."""
    bus = EventBus()
    subscriptions = [bus.subscribe(*types, capacity=cap, policy=policy) for cap, policy, types in specs]
    published: list[object] = []
    for n, (operation, index) in enumerate(operations):
        if operation == "publish":
            event = make_event(index, n)
            try:
                bus.publish_nowait(event)
            except BusFull:
                continue
            published.append(event)
        else:
            with contextlib.suppress(asyncio.QueueEmpty):
                subscriptions[index % len(subscriptions)].receive_nowait()
        assert_conserved(bus, subscriptions, published)


@pytest.mark.timeout(60)
@settings(max_examples=150, deadline=None)
@given(
    specs=subscription_specs,
    operations=st.lists(
        st.tuples(
            st.sampled_from(["publish", "publish", "publish", "settle", "receive", "cancel", "unsubscribe"]),
            st.integers(0, 3),
        ),
        min_size=4,
        max_size=50,
    ),
)
@pytest.mark.slow
def test_conservation_law_with_waiting_and_cancelled_publishers(
    specs: list[tuple[int, OverflowPolicy, tuple[type[Any], ...]]], operations: list[tuple[str, int]]
) -> None:
    """Blocked, cancelled and released publishers keep the conservation law and each subscriber's order."""

    async def scenario() -> None:
        bus = EventBus()
        subscriptions = [bus.subscribe(*types, capacity=cap, policy=policy) for cap, policy, types in specs]
        received: list[list[object]] = [[] for _ in subscriptions]
        committed: list[object] = []
        closed_after: dict[int, int] = {}
        tasks: list[asyncio.Task[None]] = []

        async def publish(event: object) -> None:
            await bus.publish(event)
            committed.append(event)  # same task step as the delivery, so this is the delivery order

        for n, (operation, index) in enumerate(operations):
            i = index % len(subscriptions)
            if operation == "publish":
                tasks.append(asyncio.create_task(publish(make_event(index, n))))
            elif operation == "receive":
                with contextlib.suppress(asyncio.QueueEmpty, BusClosed):
                    received[i].append(subscriptions[i].receive_nowait())
            elif operation == "cancel" and tasks:
                tasks[index % len(tasks)].cancel()
            elif operation == "unsubscribe" and i not in closed_after:
                subscriptions[i].close()
                closed_after[i] = len(committed)
            else:
                await settle(index + 1)
        for _ in range(len(tasks) * 4 + 10):
            if all(task.done() for task in tasks):
                break
            for i, sub in enumerate(subscriptions):
                received[i].extend(drain(sub))
            await settle(2)
        assert all(task.done() for task in tasks)
        assert all(task.cancelled() or task.exception() is None for task in tasks)
        for i, sub in enumerate(subscriptions):
            received[i].extend(drain(sub))
            expected = [event for event in committed[: closed_after.get(i)] if matching(sub, event)]
            stats = sub.statistics()
            assert len(expected) == stats.delivered + stats.dropped + stats.queued
            if sub.policy is OverflowPolicy.BLOCK:
                assert received[i] == expected
            else:
                remaining = iter(expected)
                assert all(any(event is e for e in remaining) for event in received[i])
        assert bus.statistics().published == len(committed)

    asyncio.run(scenario())


@dataclass(frozen=True)
class _Letter:
    to: str
    body: int


async def test_addressed_events_reach_only_their_address_and_observers() -> None:
    """``to`` routes an event to the subscription with that address; unaddressed subscriptions see all."""
    bus = EventBus()
    alice = bus.subscribe(_Letter, address="alice")
    bob = bus.subscribe(_Letter, address="bob")
    observer = bus.subscribe(_Letter)
    bus.publish_nowait(_Letter(to="alice", body=1))
    bus.publish_nowait(_Letter(to="bob", body=2))
    await bus.publish(_Letter(to="carol", body=3))
    assert [alice.receive_nowait().body] == [1]
    assert [bob.receive_nowait().body] == [2]
    assert [observer.receive_nowait().body for _ in range(3)] == [1, 2, 3]
    assert alice.statistics().queued == bob.statistics().queued == 0
    assert alice.address == "alice" and observer.address is None


async def test_unaddressed_events_reach_addressed_subscriptions() -> None:
    """An event without ``to`` is for everyone subscribed to its type."""
    bus = EventBus()
    alice = bus.subscribe(int, address="alice")
    bus.publish_nowait(5)
    assert alice.receive_nowait() == 5


async def test_a_full_addressed_subscription_blocks_only_its_own_mail() -> None:
    """Backpressure follows the address: a full mailbox does not block letters to others."""
    bus = EventBus()
    alice = bus.subscribe(_Letter, capacity=1, address="alice")
    bob = bus.subscribe(_Letter, capacity=1, address="bob")
    bus.publish_nowait(_Letter(to="alice", body=1))
    with pytest.raises(BusFull):
        bus.publish_nowait(_Letter(to="alice", body=2))
    bus.publish_nowait(_Letter(to="bob", body=3))
    assert bob.receive_nowait().body == 3
    assert alice.receive_nowait().body == 1


async def test_instruments_see_every_event_in_publish_order_and_the_close() -> None:
    """An instrument's hooks run once per published event, after delivery, and once when the bus closes."""
    from flasync.core.instruments import Instrument

    class Recorder(Instrument):
        def __init__(self) -> None:
            self.seen: list[object] = []
            self.closed = 0

        def event_published(self, event: object) -> None:
            self.seen.append(event)

        def bus_closed(self) -> None:
            self.closed += 1

    bus = EventBus()
    sub = bus.subscribe(int)
    recorder = Recorder()
    bus.add_instrument(recorder)
    bus.add_instrument(recorder)  # once is enough
    await bus.publish(1)
    bus.publish_nowait(2)
    assert recorder.seen == [1, 2] and sub.queued() == (1, 2)
    bus.remove_instrument(recorder)
    await bus.publish(3)
    bus.add_instrument(recorder)
    bus.close()
    bus.close()
    assert recorder.seen == [1, 2] and recorder.closed == 1


async def test_an_instrument_that_raises_is_removed_and_publishing_goes_on() -> None:
    """A failing hook costs its instrument, never the publisher or the other instruments."""
    from flasync.core.instruments import Instrument

    class Broken(Instrument):
        def event_published(self, event: object) -> None:
            raise RuntimeError("bug in an observer")

    class Counting(Instrument):
        def __init__(self) -> None:
            self.count = 0

        def event_published(self, event: object) -> None:
            self.count += 1

    bus = EventBus()
    counting = Counting()
    bus.add_instrument(Broken())
    bus.add_instrument(counting)
    await bus.publish("a")
    await bus.publish("b")
    assert counting.count == 2


@dataclass(frozen=True)
class _Member:
    to: str = "a"


@dataclass(frozen=True)
class _Batch:
    to: str = "a"


class _Watcher(Instrument):
    pass


class _BatchWatcher(Instrument):
    takes_batches = True


async def test_a_batch_is_allowed_only_where_it_reaches_every_receiver_of_its_members() -> None:
    """batches_reach is True while each subscription that wants the member events at that address takes the batch
    too and every instrument takes batches; a new subscription or instrument is seen at once."""
    bus = EventBus()
    assert bus.batches_reach(_Batch, _Member, "a")  # nobody listens: nothing to miss
    receiver = bus.subscribe(_Member, _Batch, address="a")
    assert bus.batches_reach(_Batch, _Member, "a")
    elsewhere = bus.subscribe(_Member, address="b")  # another address: never sent these events
    assert bus.batches_reach(_Batch, _Member, "a")
    everything = bus.subscribe(name="recorder")  # no types: takes the batch as it comes
    assert bus.batches_reach(_Batch, _Member, "a")
    watcher = _BatchWatcher()
    bus.add_instrument(watcher)
    assert bus.batches_reach(_Batch, _Member, "a")
    plain = _Watcher()
    bus.add_instrument(plain)
    assert not bus.batches_reach(_Batch, _Member, "a")
    bus.remove_instrument(plain)
    assert bus.batches_reach(_Batch, _Member, "a")
    members_only = bus.subscribe(_Member)
    assert not bus.batches_reach(_Batch, _Member, "a")
    members_only.close()
    assert bus.batches_reach(_Batch, _Member, "a")
    for subscription in (receiver, elsewhere, everything):
        subscription.close()


async def test_publish_together_sends_one_batch_only_where_it_reaches_every_receiver() -> None:
    """publish_together publishes ``batch.of(events)`` where batches_reach allows it, else each event in order."""
    from flasync.core.events import ClientId, TaskAssigned, TasksAssigned, Version

    def task(k: int) -> TaskAssigned:
        return TaskAssigned(task_id=k, client_id=ClientId(k), participation=0, base_version=Version(0), simulated_s=0)

    bus = EventBus()
    tasks = [task(k) for k in range(3)]
    with bus.subscribe(TaskAssigned, TasksAssigned) as both:
        await bus.publish_together(TasksAssigned, tasks)
        assert both.receive_nowait() == TasksAssigned(tasks=tuple(tasks))
        with bus.subscribe(TaskAssigned) as single:
            await bus.publish_together(TasksAssigned, tasks)
            assert [single.receive_nowait() for _ in tasks] == tasks
            assert [both.receive_nowait() for _ in tasks] == tasks
        await bus.publish_together(TasksAssigned, tasks[:1])  # one event needs no batch
        assert both.receive_nowait() == tasks[0]
        assert both.statistics().queued == 0
