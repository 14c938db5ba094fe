"""Publish typed events to subscribers over bounded in-memory queues.

The bus is the single way the parts of a run (clients, edges, server, trackers) tell each other what happened.
An event is any Python object, by convention a frozen, slotted, keyword-only dataclass named as a past-tense
fact (``UpdateReceived``); a subscription names the event types it wants and receives, in publish order, every
published event that is an instance of one of them.

An event with a ``to`` attribute is addressed: a subscription made with ``address=`` receives only the events
addressed to it (``to == address``), so an edge and the cloud can both subscribe to ``UpdateUploaded`` and each
get only its own clients'; a subscription without an address receives every event of its types, addressed or
not (an observer such as a profiler sees all traffic).

Each subscription owns a bounded queue and an :class:`OverflowPolicy` that says what a publisher does when
that queue is full: wait for room (``block``, i.e. backpressure) or drop the oldest queued event
(``drop_oldest``). The model is anyio's memory object streams: ``publish`` waits, ``publish_nowait`` raises
:class:`BusFull`, ``close`` ends every subscriber's ``async for`` once its queue is drained, and
``statistics()`` returns a small named tuple.

Example:
    >>> bus = EventBus()
    >>> with bus.subscribe(int, capacity=8) as numbers:
    ...     bus.publish_nowait(1)
    ...     bus.publish_nowait("not an int")
    ...     numbers.receive_nowait()
    1

Everything happens inside the calls to ``publish`` and ``receive``: the bus starts no task and never polls.
It binds to no event loop until something has to wait, and it is **not thread-safe**: use one bus from the
tasks of one event loop (hand work to other threads with ``loop.call_soon_threadsafe`` or
``asyncio.run_coroutine_threadsafe``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from types import TracebackType
from typing import Any, ClassVar, Generic, NamedTuple, Protocol, TypeVar, overload

import structlog

from flasync.core.errors import BusClosed, BusFull
from flasync.core.instruments import Instrument

__all__ = [
    "BatchEvent",
    "BusStatistics",
    "EventBus",
    "OverflowPolicy",
    "Subscription",
    "SubscriptionStatistics",
]

_log = structlog.get_logger("flasync.core.bus")

E = TypeVar("E")
E1 = TypeVar("E1")
E2 = TypeVar("E2")
E3 = TypeVar("E3")
E_co = TypeVar("E_co", covariant=True)


class OverflowPolicy(enum.StrEnum):
    """Say what ``publish`` does when a subscription's queue is full."""

    BLOCK = "block"
    """Wait until the subscriber receives an event (backpressure); ``publish_nowait`` raises ``BusFull``."""

    DROP_OLDEST = "drop_oldest"
    """Drop the oldest queued event to make room, and count it in ``dropped``; never waits."""


class SubscriptionStatistics(NamedTuple):
    """Counters of one subscription, as returned by :meth:`Subscription.statistics`."""

    name: str
    """The subscription's name (given to ``subscribe``, or made from its event types)."""
    capacity: int
    """Most events its queue holds."""
    queued: int
    """Events in its queue now, published but not yet received."""
    delivered: int
    """Events handed to its receivers."""
    dropped: int
    """Events dropped from its queue by the ``drop_oldest`` policy."""
    high_water: int
    """Longest its queue has ever been."""


class BusStatistics(NamedTuple):
    """Counters of a whole bus, as returned by :meth:`EventBus.statistics`."""

    published: int
    """Events published (a cancelled or failed ``publish`` publishes nothing)."""
    delivered: int
    """Events handed to receivers, summed over every subscription the bus has had."""
    dropped: int
    """Events dropped by ``drop_oldest`` subscriptions, summed over every subscription the bus has had."""
    high_water: int
    """Longest any subscription's queue has ever been."""
    subscribers: int
    """Open subscriptions now."""


class BatchEvent(Protocol):
    """An event that stands for several events of one class (:meth:`EventBus.publish_together`)."""

    member: ClassVar[type[Any]]
    """The class of the events it stands for."""

    @classmethod
    def of(cls, events: tuple[Any, ...]) -> Any:
        """Return the batch of ``events``."""
        ...

    @property
    def members(self) -> tuple[Any, ...]:
        """The events it stands for, in order."""
        ...


class _Route(NamedTuple):
    """The subscriptions one concrete event type, sent to one address, goes to."""

    targets: tuple[Subscription[Any], ...]
    blocking: tuple[Subscription[Any], ...]


class _PendingPublish:
    """One ``publish`` waiting for room in ``block`` subscriptions.

    While it waits it holds a reserved slot in each blocking target that had room (``granted``) and a place
    in the FIFO line of each that did not (``blocked``). A line only forms behind a full queue and each freed
    slot goes to the head of the line, so later publishers cannot overtake earlier ones; and since every
    pending publish joins all its lines at once, two of them never wait on each other (no deadlock).
    """

    __slots__ = ("blocked", "granted", "targets", "woken")

    def __init__(self, targets: tuple[Subscription[Any], ...], woken: asyncio.Future[None]) -> None:
        self.targets = targets
        self.granted: list[Subscription[Any]] = []
        self.blocked: set[Subscription[Any]] = set()
        self.woken = woken

    def wake(self) -> None:
        """Resume the waiting publisher (it then commits, or finds the bus closed)."""
        if not self.woken.done():
            self.woken.set_result(None)


def _wake_first(waiters: deque[asyncio.Future[None]]) -> None:
    """Resume the longest-waiting receiver that is still waiting."""
    while waiters:
        waiter = waiters.popleft()
        if not waiter.done():
            waiter.set_result(None)
            return


class Subscription(Generic[E_co]):
    """Receive the events of the types subscribed to, in publish order.

    Made by :meth:`EventBus.subscribe`. Iterate it with ``async for`` (which ends once the bus or the
    subscription is closed and the queue drained), or call :meth:`receive`. Use it as a context manager to
    unsubscribe on exit::

        with bus.subscribe(UpdateReceived) as updates:
            async for update in updates:
                ...

    One subscription is normally read by one task; several tasks may share it, each event then going to one
    of them.
    """

    __slots__ = (
        "_address",
        "_bus",
        "_capacity",
        "_closed",
        "_delivered",
        "_dropped",
        "_getters",
        "_high_water",
        "_name",
        "_pending",
        "_policy",
        "_queue",
        "_reserved",
        "_types",
    )

    def __init__(
        self,
        bus: EventBus,
        types: tuple[type[Any], ...],
        capacity: int,
        policy: OverflowPolicy,
        name: str,
        address: str | None = None,
    ) -> None:
        """Create a subscription; use :meth:`EventBus.subscribe` instead."""
        self._address = address
        self._bus = bus
        self._types = types
        self._capacity = capacity
        self._policy = policy
        self._name = name
        self._queue: deque[E_co] = deque()
        # Slots promised to waiting publishers that have not committed yet; they count against capacity.
        self._reserved = 0
        self._pending: deque[_PendingPublish] = deque()
        self._getters: deque[asyncio.Future[None]] = deque()
        self._closed = False
        self._delivered = 0
        self._dropped = 0
        self._high_water = 0

    @property
    def name(self) -> str:
        """Return the subscription's name."""
        return self._name

    @property
    def types(self) -> tuple[type[Any], ...]:
        """Return the event types subscribed to (empty: every event)."""
        return self._types

    @property
    def address(self) -> str | None:
        """Return the address this subscription receives addressed events for (None: all of them)."""
        return self._address

    @property
    def policy(self) -> OverflowPolicy:
        """Return what a publisher does when this subscription's queue is full."""
        return self._policy

    @property
    def closed(self) -> bool:
        """Return whether no more events will be delivered to this subscription."""
        return self._closed

    def __repr__(self) -> str:
        """Return a short description with the current queue length."""
        return (
            f"<Subscription {self._name!r} policy={self._policy.value} "
            f"queued={len(self._queue)}/{self._capacity}{' closed' if self._closed else ''}>"
        )

    def __aiter__(self) -> Subscription[E_co]:
        """Return the subscription itself: it is its own async iterator."""
        return self

    async def __anext__(self) -> E_co:
        """Return the next event, waiting for one if the queue is empty.

        Raises:
            StopAsyncIteration: The bus or the subscription is closed and the queue is drained.
        """
        try:
            return await self.receive()
        except BusClosed:
            raise StopAsyncIteration from None

    async def receive(self) -> E_co:
        """Return the oldest queued event, waiting for one if the queue is empty.

        Cancelling a waiting ``receive`` loses no event.

        Returns:
            The event.

        Raises:
            BusClosed: The bus or the subscription is closed and the queue is drained.
        """
        while not self._queue:
            if self._closed:
                raise BusClosed(f"subscription {self._name!r} is closed")
            getter = asyncio.get_running_loop().create_future()
            self._getters.append(getter)
            try:
                await getter
            except BaseException:
                getter.cancel()
                with contextlib.suppress(ValueError):
                    self._getters.remove(getter)
                # Woken for an event, then cancelled before taking it: pass the wake-up on.
                if self._queue and not getter.cancelled():
                    _wake_first(self._getters)
                raise
        return self._take()

    def receive_nowait(self) -> E_co:
        """Return the oldest queued event without waiting.

        Returns:
            The event.

        Raises:
            asyncio.QueueEmpty: The queue is empty but more events may come.
            BusClosed: The bus or the subscription is closed and the queue is drained.
        """
        if self._queue:
            return self._take()
        if self._closed:
            raise BusClosed(f"subscription {self._name!r} is closed")
        raise asyncio.QueueEmpty

    def close(self) -> None:
        """Unsubscribe: deliver no more events here, and release publishers waiting for room here.

        Events already queued can still be received; after them ``receive`` raises ``BusClosed`` and
        ``async for`` ends. Closing twice does nothing.
        """
        if self._closed:
            return
        self._bus._unsubscribe(self)
        self._shutdown()

    def queued(self) -> tuple[E_co, ...]:
        """Return the events waiting to be received, oldest first (a copy; nothing is taken)."""
        return tuple(self._queue)

    def statistics(self) -> SubscriptionStatistics:
        """Return the subscription's counters."""
        return SubscriptionStatistics(
            name=self._name,
            capacity=self._capacity,
            queued=len(self._queue),
            delivered=self._delivered,
            dropped=self._dropped,
            high_water=self._high_water,
        )

    def __enter__(self) -> Subscription[E_co]:
        """Return the subscription itself."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the subscription."""
        self.close()

    def _take(self) -> E_co:
        """Pop the oldest event, count it and give the freed slot to the first waiting publisher."""
        bus = self._bus
        if bus._on_activity is not None:
            # Before the pop, so that if it raises no event is lost.
            bus._on_activity()
        event = self._queue.popleft()
        self._delivered += 1
        bus._delivered += 1
        if self._pending:
            self._grant()
        return event

    def _grant(self) -> None:
        """Reserve free slots for the publishers at the head of the line, in order."""
        pending = self._pending
        while pending and len(self._queue) + self._reserved < self._capacity:
            publish = pending.popleft()
            self._reserved += 1
            publish.granted.append(self)
            publish.blocked.discard(self)
            if not publish.blocked:
                publish.wake()

    def _shutdown(self) -> None:
        """Mark closed and wake everyone waiting on this subscription."""
        self._closed = True
        for publish in self._pending:
            publish.blocked.discard(self)
            if not publish.blocked:
                publish.wake()
        self._pending.clear()
        getters, self._getters = self._getters, deque()
        for getter in getters:
            if not getter.done():
                getter.set_result(None)


class EventBus:
    """Deliver published events to every subscription whose types they match.

    Events from one publisher reach each subscriber in publish order. A ``publish`` is all or nothing: it
    delivers the event to every matching subscription at once, after waiting (if it must) until every
    matching ``block`` subscription has room; if it is cancelled or the bus closes meanwhile, it delivers to
    none. Publishers waiting on the same full subscription get room in the order they started waiting.
    ``publish`` does not yield to the event loop when there is room, like ``asyncio.Queue.put``.

    Matching is ``isinstance(event, types)``, worked out once per concrete event class and cached, so it
    follows the class, not the instance (virtual subclasses registered later are not seen).

    Not thread-safe: use it from the tasks of a single event loop.

    Args:
        on_activity: Called synchronously on every publish and on every event handed to a receiver, so that a
            virtual clock can tell the loop is still busy. Keep it cheap; what it raises propagates to the
            caller of ``publish`` or ``receive``.
    """

    __slots__ = (
        "_batches",
        "_closed",
        "_delivered",
        "_dropped",
        "_high_water",
        "_hooks",
        "_instruments",
        "_on_activity",
        "_published",
        "_routes",
        "_subscriptions",
    )

    def __init__(self, *, on_activity: Callable[[], None] | None = None) -> None:
        """Create an open bus without subscriptions."""
        self._on_activity = on_activity
        self._instruments: list[Instrument] = []
        # Each instrument with its bound event_published, made once: a publish calls them without a lookup.
        self._hooks: tuple[tuple[Instrument, Callable[[object], None]], ...] = ()
        self._subscriptions: list[Subscription[Any]] = []
        self._routes: dict[tuple[type[Any], Any], _Route] = {}
        self._batches: dict[tuple[type[Any], type[Any], Any], bool] = {}
        self._closed = False
        self._published = 0
        self._delivered = 0
        self._dropped = 0
        self._high_water = 0

    @property
    def closed(self) -> bool:
        """Return whether :meth:`close` has been called."""
        return self._closed

    def __repr__(self) -> str:
        """Return a short description with the number of subscriptions."""
        state = "closed" if self._closed else "open"
        return f"<EventBus {state} subscribers={len(self._subscriptions)} published={self._published}>"

    @overload
    def subscribe(
        self,
        event_type: type[E],
        /,
        *,
        capacity: int = ...,
        policy: OverflowPolicy = ...,
        name: str = ...,
        address: str | None = ...,
    ) -> Subscription[E]: ...

    @overload
    def subscribe(
        self,
        type1: type[E1],
        type2: type[E2],
        /,
        *,
        capacity: int = ...,
        policy: OverflowPolicy = ...,
        name: str = ...,
        address: str | None = ...,
    ) -> Subscription[E1 | E2]: ...

    @overload
    def subscribe(
        self,
        type1: type[E1],
        type2: type[E2],
        type3: type[E3],
        /,
        *,
        capacity: int = ...,
        policy: OverflowPolicy = ...,
        name: str = ...,
        address: str | None = ...,
    ) -> Subscription[E1 | E2 | E3]: ...

    @overload
    def subscribe(
        self,
        *types: type[Any],
        capacity: int = ...,
        policy: OverflowPolicy = ...,
        name: str = ...,
        address: str | None = ...,
    ) -> Subscription[Any]: ...

    def subscribe(
        self,
        *types: type[Any],
        capacity: int = 1024,
        policy: OverflowPolicy = OverflowPolicy.BLOCK,
        name: str = "",
        address: str | None = None,
    ) -> Subscription[Any]:
        """Subscribe to the events that are instances of any of ``types``.

        The subscription receives only events whose ``publish`` starts after this call.

        Args:
            *types: Event classes to receive, subclasses included; none means every event.
            capacity: Most events its queue holds, at least 1.
            policy: What a publisher does when the queue is full (a string such as ``"drop_oldest"`` works).
            name: Name shown in statistics and logs; by default made from the types' names.
            address: Receive only events whose ``to`` attribute equals this (and events without one); None:
                every event of ``types`` whatever its ``to``.

        Returns:
            The subscription, to iterate with ``async for`` and to close when done.

        Raises:
            BusClosed: The bus is closed.
            ValueError: ``capacity`` is below 1 or ``policy`` is unknown.
            TypeError: One of ``types`` is not a class.
        """
        if self._closed:
            raise BusClosed("cannot subscribe to a closed bus")
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        policy = OverflowPolicy(policy)
        for event_type in types:
            if not isinstance(event_type, type):
                raise TypeError(f"event types must be classes, got {event_type!r}")
        if not name:
            name = "|".join(t.__qualname__ for t in types) or "*"
        subscription: Subscription[Any] = Subscription(self, types, capacity, policy, name, address)
        self._subscriptions.append(subscription)
        self._forget_routes()
        return subscription

    async def publish(self, event: object) -> None:
        """Deliver ``event`` to every matching subscription, waiting for room where the policy is ``block``.

        This is :meth:`publish_nowait` that waits instead of raising :class:`BusFull`. Full ``drop_oldest``
        subscriptions drop their oldest event instead. Cancelling a waiting publish delivers the event to no one and
        leaves no trace in the statistics.

        Args:
            event: The event; it is not copied, so make it immutable.

        Raises:
            BusClosed: The bus is closed, or closes while this publish waits.
        """
        route = self._route_for(event)
        if route.blocking and self._first_full(route) is not None:
            await self._publish_when_room(event, route)
            return
        self._deliver(event, route.targets)

    def publish_nowait(self, event: object) -> None:
        """Deliver ``event`` to every matching subscription without waiting.

        Full ``drop_oldest`` subscriptions drop their oldest event.

        Args:
            event: The event; it is not copied, so make it immutable.

        Raises:
            BusClosed: The bus is closed.
            BusFull: A matching ``block`` subscription is full; the event was delivered to no one.
        """
        route = self._route_for(event)
        full = self._first_full(route) if route.blocking else None
        if full is not None:
            raise BusFull(f"subscription {full._name!r} is full ({full._capacity} events) and its policy is block")
        self._deliver(event, route.targets)

    def _route_for(self, event: object) -> _Route:
        """Note the activity and find where ``event`` goes (refused on a closed bus)."""
        if self._closed:
            raise BusClosed("cannot publish on a closed bus")
        if self._on_activity is not None:
            self._on_activity()
        key = (type(event), getattr(event, "to", None))
        route = self._routes.get(key)
        if route is None:
            route = self._route(event, key)
        return route

    @staticmethod
    def _first_full(route: _Route) -> Subscription[Any] | None:
        """Return the first ``block`` subscription of ``route`` without room, if any."""
        for subscription in route.blocking:
            if len(subscription._queue) + subscription._reserved >= subscription._capacity:
                return subscription
        return None

    def close(self) -> None:
        """Close the bus: refuse new events, let subscribers drain, fail waiting publishers.

        Later ``publish`` and ``subscribe`` calls raise ``BusClosed``; so do the ``publish`` calls waiting for
        room now. Each subscriber still receives what is queued, then its ``async for`` ends. Closing twice
        does nothing.
        """
        if self._closed:
            return
        self._closed = True
        subscriptions, self._subscriptions = self._subscriptions, []
        self._forget_routes()
        for subscription in subscriptions:
            subscription._shutdown()
        for instrument in list(self._instruments):
            self._call(instrument, "bus_closed")

    def add_instrument(self, instrument: Instrument) -> None:
        """Call ``instrument``'s hooks from now on (see :mod:`flasync.core.instruments`); adding it twice does
        nothing."""
        if instrument not in self._instruments:
            self._instruments.append(instrument)
            self._instruments_changed()

    def remove_instrument(self, instrument: Instrument) -> None:
        """Stop calling ``instrument``'s hooks (nothing happens if it was not added)."""
        if instrument in self._instruments:
            self._instruments.remove(instrument)
            self._instruments_changed()

    def _instruments_changed(self) -> None:
        self._hooks = tuple((instrument, instrument.event_published) for instrument in self._instruments)
        self._batches.clear()

    def batches_reach(self, batch: type[Any], member: type[Any], to: str | None = None) -> bool:
        """Tell whether one ``batch`` event sent to ``to`` reaches everything its ``member`` events would.

        True when every subscription that would receive a ``member`` event addressed ``to`` receives ``batch``
        events addressed there too, and every instrument takes batches (``Instrument.takes_batches``). A publisher
        that can send several events as one batch (:class:`~flasync.core.events.UpdatesUploaded`) asks first and sends
        them one by one where the answer is False, so an observer that wants each event still gets each. The answer
        is cached until a subscription or an instrument comes or goes.

        Args:
            batch: The batch event's class.
            member: The class of the events it stands for.
            to: The address both would be sent to (None: unaddressed).
        """
        key = (batch, member, to)
        known = self._batches.get(key)
        if known is None:
            if all(getattr(instrument, "takes_batches", False) for instrument in self._instruments):
                batches = set(self._targets_of(batch, to))
                known = all(subscription in batches for subscription in self._targets_of(member, to))
            else:
                known = False
            self._batches[key] = known
        return known

    def publish_together(
        self, batch: type[BatchEvent], events: Sequence[Any], *, to: str | None = None
    ) -> Coroutine[Any, Any, None]:
        """Publish ``events`` (of ``batch.member``, addressed ``to``) as one ``batch.of(events)`` where that reaches
        everything they would (:meth:`batches_reach`), else one by one, in order; await what it returns (one event:
        :meth:`publish`'s own coroutine, no other between).

        Raises:
            BusClosed: The bus is closed, or closes while a publish waits.
        """
        if len(events) == 1:
            return self.publish(events[0])
        if len(events) > 1 and self.batches_reach(batch, batch.member, to):
            return self.publish(batch.of(tuple(events)))
        return _publish_each(self, events)

    def _targets_of(self, cls: type[Any], to: Any) -> list[Subscription[Any]]:
        """Return the subscriptions an event of class ``cls`` addressed ``to`` goes to."""
        return [
            s
            for s in self._subscriptions
            if (not s._types or issubclass(cls, s._types)) and (s._address is None or to is None or s._address == to)
        ]

    def _forget_routes(self) -> None:
        """Drop the cached routes and batch answers (the subscriptions changed)."""
        self._routes.clear()
        self._batches.clear()

    def _call(self, instrument: Instrument, hook: str, *args: object) -> None:
        """Call one hook; an instrument whose hook raises is removed and the error logged, the run goes on."""
        try:
            getattr(instrument, hook)(*args)
        except Exception as exc:
            self._failed(instrument, hook, exc)

    def _failed(self, instrument: Instrument, hook: str, exc: Exception) -> None:
        """Remove an instrument whose hook raised, and log why."""
        self.remove_instrument(instrument)
        _log.warning(
            "bus.instrument_removed",
            instrument=type(instrument).__name__,
            hook=hook,
            error=f"{type(exc).__name__}: {exc}",
            metrics=False,
        )

    def statistics(self) -> BusStatistics:
        """Return the bus's counters."""
        return BusStatistics(
            published=self._published,
            delivered=self._delivered,
            dropped=self._dropped,
            high_water=self._high_water,
            subscribers=len(self._subscriptions),
        )

    def _route(self, event: object, key: tuple[type[Any], Any]) -> _Route:
        """Find and cache the subscriptions events of this concrete class and address go to."""
        to = key[1]
        targets = tuple(
            s
            for s in self._subscriptions
            if (not s._types or isinstance(event, s._types)) and (s._address is None or to is None or s._address == to)
        )
        route = _Route(targets, tuple(s for s in targets if s._policy is OverflowPolicy.BLOCK))
        self._routes[key] = route
        return route

    def _unsubscribe(self, subscription: Subscription[Any]) -> None:
        """Forget a subscription that is closing."""
        try:
            self._subscriptions.remove(subscription)
        except ValueError:
            return
        self._forget_routes()

    def _deliver(self, event: object, targets: tuple[Subscription[Any], ...]) -> None:
        """Append ``event`` to every target's queue; the ``block`` ones are known to have room."""
        self._published += 1
        for subscription in targets:
            queue = subscription._queue
            if len(queue) >= subscription._capacity:
                queue.popleft()
                subscription._dropped += 1
                self._dropped += 1
            queue.append(event)
            length = len(queue)
            if length > subscription._high_water:
                subscription._high_water = length
                if length > self._high_water:
                    self._high_water = length
            if subscription._getters:
                _wake_first(subscription._getters)
        for instrument, hook in self._hooks:
            try:
                hook(event)
            except Exception as exc:
                self._failed(instrument, "event_published", exc)

    async def _publish_when_room(self, event: object, route: _Route) -> None:
        """Wait until every blocking target has a slot for ``event``, then deliver it to all at once."""
        publish = _PendingPublish(route.targets, asyncio.get_running_loop().create_future())
        for subscription in route.blocking:
            if subscription._pending or (len(subscription._queue) + subscription._reserved >= subscription._capacity):
                subscription._pending.append(publish)
                publish.blocked.add(subscription)
            else:
                subscription._reserved += 1
                publish.granted.append(subscription)
        try:
            await publish.woken
        except BaseException:
            self._abandon(publish)
            raise
        if self._closed:
            self._abandon(publish)
            raise BusClosed("the bus was closed while publish waited for room")
        for subscription in publish.granted:
            subscription._reserved -= 1
        self._deliver(event, tuple(s for s in publish.targets if not s._closed))

    @staticmethod
    def _abandon(publish: _PendingPublish) -> None:
        """Give back what a pending publish holds: its places in line and its reserved slots."""
        for subscription in publish.blocked:
            subscription._pending.remove(publish)
        publish.blocked.clear()
        for subscription in publish.granted:
            subscription._reserved -= 1
            if subscription._pending and not subscription._closed:
                subscription._grant()
        publish.granted.clear()


async def _publish_each(bus: EventBus, events: Sequence[Any]) -> None:
    """Publish ``events`` on ``bus`` one by one, in order."""
    for event in events:
        await bus.publish(event)
