"""Events on the bus: frozen, slotted, keyword-only dataclasses naming facts in the past tense.

Tensors never travel in events; the one event that carries an update carries the encoded bytes a client uploaded
(``UpdateUploaded.payload``), exactly what would cross a network.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Literal, NewType, TypeVar

__all__ = [
    "BATCH_EVENTS",
    "CLOUD",
    "Aggregated",
    "AlertRaised",
    "ClientConnected",
    "ClientEvaluated",
    "ClientFailed",
    "ClientId",
    "ClientTimedOut",
    "ClientsEvaluated",
    "EdgeForwarded",
    "Evaluated",
    "FailureKind",
    "ModelPublished",
    "RoundDeadlinePassed",
    "RunFinished",
    "SecureGroupClosed",
    "StopRequested",
    "TaskAssigned",
    "TaskClosed",
    "TaskDiagnosis",
    "TaskOutcome",
    "TasksAssigned",
    "UpdateReceived",
    "UpdateRejected",
    "UpdateUploaded",
    "UpdatesReceived",
    "UpdatesUploaded",
    "Version",
    "positional",
]

ClientId = NewType("ClientId", int)
TaskOutcome = Literal["accepted", "rejected", "failed", "timed_out"]
"""How a task ended, as an edge reports it to the cloud."""
FailureKind = Literal["error", "crash", "dropout", "offline"]
"""Why a client's task failed: a genuine training error, or a fault the run simulates."""
Version = NewType("Version", int)

CLOUD = "cloud"
"""The bus address of the server; an edge's address is its name. Events with a ``to`` field are addressed."""

_Event = TypeVar("_Event")


class _Factory:
    """Stands for an argument whose field has a default factory and which was not given (shown as ``<factory>``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        """Return ``<factory>``, as ``dataclasses`` shows such a default."""
        return "<factory>"


_NO_VALUE: Any = _Factory()


def _slot_init(cls: type[_Event]) -> type[_Event]:
    """Give a frozen, slotted, keyword-only dataclass a quicker ``__init__`` that makes equal objects.

    The one ``dataclass`` writes stores each field with ``object.__setattr__``. This one lends the new object, for the
    time of its stores, a writable twin of its class: a subclass with no slots of its own (so the same layout) whose
    ``__setattr__`` and ``__delattr__`` are ``object``'s, so each field is stored as a plain attribute of a slotted
    class is, without a call per field; then the object is given its class back. An object of a subclass (another
    layout, maybe) is stored field by field through the slots' descriptors. Same signature (names, keyword-only,
    defaults and default factories), same checks on the arguments, same annotations; the class stays frozen for
    everyone else.

    Raises:
        TypeError: ``cls`` is not such a dataclass, or has a ``__post_init__``.
    """
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__ or hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__qualname__} must be a frozen, slotted dataclass without __post_init__")
    writable = type(
        f"_Writable{cls.__name__}",
        (cls,),
        {"__slots__": (), "__setattr__": object.__setattr__, "__delattr__": object.__delattr__},
    )
    namespace: dict[str, Any] = {
        "_NO_VALUE": _NO_VALUE,
        "_cls": cls,
        "_writable": writable,
        "_set_class": object.__setattr__,
        "_new": object.__new__,
    }
    arguments, factories, plain, stored = [], [], [], []
    for spec in fields(cls):  # type: ignore[arg-type]
        name = spec.name
        if not (spec.init and spec.kw_only):
            raise TypeError(f"{cls.__qualname__}.{name} must be a keyword-only argument of __init__")
        if spec.default is not MISSING:
            namespace[f"_default_{name}"] = spec.default
            arguments.append(f"{name}=_default_{name}")
        elif spec.default_factory is not MISSING:
            namespace[f"_factory_{name}"] = spec.default_factory
            arguments.append(f"{name}=_NO_VALUE")
            factories.append(f"    if {name} is _NO_VALUE:\n        {name} = _factory_{name}()")
        else:
            arguments.append(name)
        namespace[f"_store_{name}"] = cls.__dict__[name].__set__
        plain.append(f"        self.{name} = {name}")
        stored.append(f"        _store_{name}(self, {name})")
    names = [spec.name for spec in fields(cls)]  # type: ignore[arg-type]
    source = (
        f"def _positional({', '.join(names)}, /):\n"
        + "    self = _new(_writable)\n"
        + "".join(f"    self.{name} = {name}\n" for name in names)
        + "    self.__class__ = _cls\n"
        + "    return self\n"
        + f"def __init__(self, *, {', '.join(arguments)}):\n"
        + "".join(f"{line}\n" for line in factories)
        + "    if type(self) is _cls:\n"
        + "        _set_class(self, '__class__', _writable)\n"
        + "\n".join(plain)
        + "\n        self.__class__ = _cls\n"
        + "    else:\n"
        + "\n".join([*stored, "        pass"])
        + "\n"
    )
    exec(source, namespace)  # how dataclasses itself writes __init__: one flat function per class
    init: Callable[..., None] = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__annotations__ = {**{spec.name: spec.type for spec in fields(cls)}, "return": None}  # type: ignore[arg-type]
    init.__doc__ = cls.__init__.__doc__
    setattr(cls, "__init__", init)  # noqa: B010 - mypy refuses assigning to a method
    positional = namespace["_positional"]
    positional.__qualname__ = f"{cls.__qualname__}._positional"
    positional.__module__ = cls.__module__
    cls._positional = staticmethod(positional)  # type: ignore[attr-defined]
    return cls


def positional(cls: type[_Event]) -> Callable[..., _Event]:
    """Return what makes an event of class ``cls`` from the value of each of its fields, given positionally in the
    order of :func:`dataclasses.fields` (every one, defaults included): the event its constructor makes of them,
    without the constructor's handling of keyword arguments (for code that makes one per update).

    Raises:
        TypeError: ``cls`` is not one of the events here.
    """
    made: Callable[..., _Event] | None = cls.__dict__.get("_positional")
    if made is None:
        raise TypeError(f"{cls.__qualname__} is not an event of flasync.core.events")
    return made


@_slot_init
@dataclass(frozen=True, slots=True, kw_only=True)
class TaskDiagnosis:
    """What the training thread found about one local training call (numbers only, never tensors).

    ``loss_finite`` and ``update_finite`` are checked at every diagnostics level; ``update_norm`` from level
    ``basic``; the gradient fields only at level ``full`` (per layer, in the model's parameter order; see
    :func:`flasync.training.diagnostics.layer_layout`), else empty/NaN.
    """

    loss_finite: bool = True
    update_finite: bool = True
    grad_finite: bool = True
    update_norm: float = math.nan
    grad_norm_max: float = math.nan
    layer_grad_norm_mean: tuple[float, ...] = ()
    layer_grad_norm_max: tuple[float, ...] = ()


@_slot_init
@dataclass(frozen=True, slots=True, kw_only=True)
class ModelPublished:
    """The server made global model ``version`` available for download.

    ``tier`` names the publishing node's tier (``"cloud"`` for the server); ``encode_s`` is the wall time spent
    encoding the download.
    """

    version: Version
    simulated_s: float
    download_bytes: int
    tier: str = "cloud"
    encode_s: float = 0.0


@_slot_init
@dataclass(frozen=True, slots=True, kw_only=True)
class TaskAssigned:
    """Client ``client_id`` was given task ``task_id`` (its ``participation``-th, from 0) on model ``base_version``."""

    task_id: int
    client_id: ClientId
    participation: int
    base_version: Version
    simulated_s: float
    reply_to: str = CLOUD


@_slot_init
@dataclass(frozen=True, slots=True, kw_only=True)
class TasksAssigned:
    """Several tasks were given at once (a round's cohort), in this order.

    Published instead of one :class:`TaskAssigned` each where every observer takes batches
    (:meth:`flasync.core.bus.EventBus.batches_reach`); ``tasks`` are the events it stands for.
    """

    member: ClassVar[type[TaskAssigned]] = TaskAssigned
    tasks: tuple[TaskAssigned, ...]

    @classmethod
    def of(cls, events: tuple[TaskAssigned, ...]) -> TasksAssigned:
        """Return the batch of ``events``."""
        return cls(tasks=events)

    @property
    def members(self) -> tuple[TaskAssigned, ...]:
        """The events the batch stands for."""
        return self.tasks


@_slot_init
@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateUploaded:
    """A client finished its upload to ``to``; ``payload`` holds the encoded delta ``w_base - w_local``.

    The cost of the task: ``compute_s`` and ``encode_s`` are wall seconds of local training and encoding in the
    worker thread; ``sim_download_s``, ``sim_train_s`` and ``sim_upload_s`` are its simulated durations;
    ``download_bytes`` the model it downloaded; ``peak_mem_bytes`` the training call's peak tensor memory;
    ``tier`` the uploading node's tier (``"client"``); ``extra`` what an algorithm's plug-in sends beside the delta
    (empty: nothing).
    """

    to: str = CLOUD
    task_id: int
    client_id: ClientId
    base_version: Version
    num_samples: int
    payload: bytes = field(repr=False)
    train_loss: float
    simulated_s: float
    sent_wall_s: float
    tier: str = "client"
    compute_s: float = 0.0
    encode_s: float = 0.0
    sim_download_s: float = 0.0
    sim_train_s: float = 0.0
    sim_upload_s: float = 0.0
    download_bytes: int = 0
    peak_mem_bytes: int = 0
    diagnosis: TaskDiagnosis | None = None
    extra: bytes = field(default=b"", repr=False)

    @property
    def upload_bytes(self) -> int:
        """Bytes on the wire: the delta and what a plug-in sends beside it (``extra``)."""
        return len(self.payload) + len(self.extra)


@_slot_init
@dataclass(frozen=True, slots=True, kw_only=True)
class UpdatesUploaded:
    """Several uploads to ``to`` finished at one simulated time and go to the receiver as one message, in order.

    A group of tasks trained as one cohort sends the uploads due at one time this way when everything on the bus
    that would receive them one by one takes the batch too (:meth:`flasync.core.bus.EventBus.batches_reach`): the
    receiver handles ``uploads`` exactly as it would handle them one at a time, in this order, and decodes and
    checks them together. Observers that want the uploads themselves read ``uploads``.

    ``prepared`` holds, where the worker that encoded the uploads also decoded and checked them as their receiver
    would (:class:`flasync.server.intake.RowDecoder`), each upload's entry, in order: the receiver takes them
    instead of decoding, when they are its own decoder's (None: the receiver decodes the uploads).
    """

    member: ClassVar[type[UpdateUploaded]] = UpdateUploaded
    to: str = CLOUD
    uploads: tuple[UpdateUploaded, ...]
    prepared: tuple[object, ...] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, events: tuple[UpdateUploaded, ...], prepared: tuple[object, ...] | None = None) -> UpdatesUploaded:
        """Return the batch of ``events``, all addressed alike (to the first one's address), with each one's entry
        decoded ahead (``prepared``, None: none)."""
        return cls(to=events[0].to, uploads=events, prepared=prepared)

    @property
    def members(self) -> tuple[UpdateUploaded, ...]:
        """The events the batch stands for."""
        return self.uploads

    @property
    def upload_bytes(self) -> int:
        """Bytes on the wire of every upload in the batch."""
        return sum(upload.upload_bytes for upload in self.uploads)


@_slot_init
@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateReceived:
    """The server accepted an update into aggregation."""

    task_id: int
    client_id: ClientId
    base_version: Version
    version: Version
    staleness: int
    upload_bytes: int
    simulated_s: float
    tier: str = "client"
    decode_s: float = 0.0
    queue_wait_s: float = 0.0


@_slot_init
@dataclass(frozen=True, slots=True, kw_only=True)
class UpdatesReceived:
    """The server accepted several updates of one batch (:class:`UpdatesUploaded`) at once, in this order.

    Published instead of one :class:`UpdateReceived` each where every observer takes batches
    (:meth:`flasync.core.bus.EventBus.batches_reach`); ``received`` are the events it stands for.
    """

    member: ClassVar[type[UpdateReceived]] = UpdateReceived
    received: tuple[UpdateReceived, ...]

    @classmethod
    def of(cls, events: tuple[UpdateReceived, ...]) -> UpdatesReceived:
        """Return the batch of ``events``."""
        return cls(received=events)

    @property
    def members(self) -> tuple[UpdateReceived, ...]:
        """The events the batch stands for."""
        return self.received


BATCH_EVENTS = (TasksAssigned, UpdatesUploaded, UpdatesReceived)
"""The events that stand for several of one class (``member``): published by
:meth:`flasync.core.bus.EventBus.publish_together` in their place where every receiver takes them; ``members`` are the
events each stands for, in order."""


@_slot_init
@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateRejected:
    """The server refused an update; aggregation state is left as it was.

    ``reason``: ``stale``, ``decode`` (malformed payload), ``shape`` or ``dtype`` (a decoded update of the wrong
    form), ``non_finite`` (NaN/Inf), ``norm`` (above ``resilience.max_update_norm``), ``zscore`` (a norm far
    above recent ones), ``unknown_version`` (a base version never published), ``unexpected`` (no such task in
    flight).
    """

    task_id: int
    client_id: ClientId
    base_version: Version
    reason: str
    detail: str
    simulated_s: float
    where: str = CLOUD


@_slot_init
@dataclass(frozen=True, slots=True, kw_only=True)
class TaskClosed:
    """Edge ``edge`` took a client's answer to a task the cloud dispatched: the cloud counts it and may refill the slot.

    ``outcome`` is ``accepted`` (folded into the edge's buffer), ``rejected`` (``reason`` as for
    :class:`UpdateRejected`), ``failed`` (the client reported :class:`ClientFailed`; ``reason`` is its error and
    ``kind`` its kind) or ``timed_out`` (the task's time limit passed first).
    """

    to: str = CLOUD
    edge: str
    task_id: int
    client_id: ClientId
    base_version: Version
    outcome: TaskOutcome
    reason: str
    staleness: int
    upload_bytes: int
    simulated_s: float
    kind: FailureKind = "error"


@_slot_init
@dataclass(frozen=True, slots=True, kw_only=True)
class EdgeForwarded:
    """Edge ``edge`` (tier ``tier``) sent its partial aggregate to ``to``, its parent.

    ``payload`` is the encoded weighted sum of the ``count`` client deltas it folded, ``sum_k e_k s_k delta_k``,
    and ``example_weight`` is ``sum_k e_k``, so a parent that adds partials gets exactly what it would have got
    from the clients' updates. ``base_version`` is the newest cloud version the edge knew when it folded. (An edge
    that forwards every update unchanged relays the client's :class:`UpdateUploaded` itself, re-addressed.)
    """

    to: str
    edge: str
    tier: str
    count: int
    num_samples: int
    example_weight: float
    base_version: Version
    payload: bytes = field(repr=False)
    simulated_s: float
    sent_wall_s: float


@_slot_init
@dataclass(frozen=True, slots=True, kw_only=True)
class SecureGroupClosed:
    """A secure-aggregation group (a FedBuff buffer, or a FedAvg round's cohort) ended its protocol at ``to``.

    The server unmasked ``weighted_sum``, the float32 bytes of ``sum_u w_u delta_u`` over the ``survivors`` (each
    member weighted its own update before masking), and ``example_weight``, ``sum_u e_u``: nothing of one update.
    ``weighted_sum`` is empty when the group was abandoned (more than ``max_dropouts`` dropped: ``reason``).
    ``version`` is the version the group's sum steps from; ``members`` are the tasks whose clients held their
    updates for it, ``dropped`` the clients that left during the protocol and ``recovered`` how many of them were
    unmasked with the others' shares. ``upload_bytes`` and ``download_bytes`` are each member's protocol bytes by
    client id, ``figures`` the group's ``secagg`` figures (bytes and simulated seconds per round, CPU seconds).
    """

    to: str = CLOUD
    group: int
    version: Version
    members: tuple[TaskAssigned, ...]
    survivors: frozenset[int]
    dropped: frozenset[int]
    recovered: int
    weighted_sum: bytes = field(repr=False)
    example_weight: float
    upload_bytes: Mapping[int, int]
    download_bytes: Mapping[int, int]
    figures: Mapping[str, float]
    reason: str
    simulated_s: float

    @property
    def abandoned(self) -> bool:
        """Return whether the group ended without a sum."""
        return not self.weighted_sum


@_slot_init
@dataclass(frozen=True, slots=True, kw_only=True)
class ClientFailed:
    """A client task ended with an error instead of an update, reported to ``to`` (``diagnosis``: when training
    found NaN/Inf).

    ``kind``: ``error`` (training raised), ``crash`` (an injected crash, ``faults.crash``), ``dropout`` (the client
    left mid-training, ``faults.dropout``), ``offline`` (its availability window closed before it was done).
    """

    to: str = CLOUD
    task_id: int
    client_id: ClientId
    base_version: Version
    error: str
    simulated_s: float
    diagnosis: TaskDiagnosis | None = None
    kind: FailureKind = "error"


@_slot_init
@dataclass(frozen=True, slots=True, kw_only=True)
class ClientTimedOut:
    """A client task was not answered within ``timeout_s`` of its dispatch; whoever it answers to abandons it.

    It goes where the task's answer would have gone (``to``: the cloud, or the client's edge).
    """

    to: str = CLOUD
    task_id: int
    client_id: ClientId
    base_version: Version
    timeout_s: float
    simulated_s: float


@_slot_init
@dataclass(frozen=True, slots=True, kw_only=True)
class RoundDeadlinePassed:
    """The deadline of the sync round that started from model ``version`` passed."""

    version: Version
    simulated_s: float


@_slot_init
@dataclass(frozen=True, slots=True, kw_only=True)
class ClientConnected:
    """A remote device asked for its task after a silence (its first request, or its first after it went offline):
    the server may start a task for it now, not only once the next answer arrives."""

    to: str = CLOUD
    client_id: ClientId


@_slot_init
@dataclass(frozen=True, slots=True, kw_only=True)
class StopRequested:
    """Something outside the run (a signal, :meth:`flasync.Federation.request_stop`) asked it to stop."""

    reason: str


@_slot_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Aggregated:
    """The server folded ``num_updates`` updates into the model, producing ``version``."""

    version: Version
    num_updates: int
    mean_staleness: float
    aggregate_s: float
    simulated_s: float
    wall_s: float = 0.0


@_slot_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Evaluated:
    """The server evaluated ``version`` on the held-out split (each figure is logged as the metric
    ``server/eval/<name>``: ``accuracy``, ``loss`` and each of ``metrics``, the names ``eval.metrics`` adds)."""

    version: Version
    accuracy: float
    loss: float
    simulated_s: float
    wall_s: float
    eval_s: float = 0.0
    metrics: Mapping[str, float] = field(default_factory=dict)

    def value(self, key: str) -> float | None:
        """Return the figure logged under the metric ``key`` (``server/eval/<name>``; None: not one of this event's)."""
        prefix, _, name = key.rpartition("/")
        if prefix != "server/eval":
            return None
        if name in ("accuracy", "loss"):
            return float(getattr(self, name))
        found = self.metrics.get(name)
        return None if found is None else float(found)


@_slot_init
@dataclass(frozen=True, slots=True, kw_only=True)
class ClientEvaluated:
    """A client evaluated a model on its own held-out samples (client-side evaluation, ``eval.clients``).

    The report counts towards ``version``, the model version the client downloaded, whether it evaluated that model
    before local training or the model it trained from it (``when``). It is what the server sums up per version,
    and what a per-client view reads as a client's last evaluation.

    Attributes:
        client_id: The client.
        task_id: The task it evaluated in.
        version: The model version the report counts towards.
        when: ``before`` or ``after`` local training.
        num_samples: Held-out samples evaluated.
        accuracy: Share of them predicted right.
        loss: Mean cross-entropy over them.
        metrics: The figures of the metrics ``eval.metrics`` adds, by name.
        simulated_s: When the report was made (the task's training end).
        eval_s: Real seconds the evaluation took (a member of a cohort: its share of the cohort's).
    """

    client_id: ClientId
    task_id: int
    version: Version
    when: Literal["before", "after"]
    num_samples: int
    accuracy: float
    loss: float
    metrics: Mapping[str, float] = field(default_factory=dict)
    simulated_s: float = 0.0
    eval_s: float = 0.0

    def figures(self) -> dict[str, float]:
        """Return every figure by metric name: ``accuracy``, ``loss`` and :attr:`metrics`."""
        return {"accuracy": self.accuracy, "loss": self.loss, **self.metrics}


@_slot_init
@dataclass(frozen=True, slots=True, kw_only=True)
class ClientsEvaluated:
    """The clients' evaluation of ``version`` closed (client-side evaluation): its reports summed up.

    Attributes:
        version: The model version.
        reports: Reports counted.
        samples: Held-out samples they evaluated.
        figures: Per metric (``accuracy``, ``loss``, ...), its ``mean``, ``p10``, ``p50``, ``p90`` and ``worst10``
            (logged as ``client_eval/<metric>/<figure>``).
        closed_by: ``min_reports``, ``deadline`` or ``end`` (the run finished).
    """

    version: Version
    reports: int
    samples: int
    figures: Mapping[str, Mapping[str, float]]
    closed_by: str

    def value(self, key: str) -> float | None:
        """Return the figure logged under the metric ``key`` (``client_eval/<metric>/<figure>``; None: not one of
        this event's)."""
        head, metric, figure = [*key.split("/"), "", ""][:3]
        if head != "client_eval" or metric not in self.figures or figure not in self.figures[metric]:
            return None
        return float(self.figures[metric][figure])


@_slot_init
@dataclass(frozen=True, slots=True, kw_only=True)
class RunFinished:
    """The run stopped (``reason``: ``max_versions``, ``target_accuracy``, ``max_simulated_s``, ``max_wall_s``)."""

    reason: str
    versions: int
    updates_accepted: int
    simulated_s: float
    wall_s: float


@_slot_init
@dataclass(frozen=True, slots=True, kw_only=True)
class AlertRaised:
    """A diagnostic found something wrong (``kind``: ``nan``, ``exploding_gradient``, ``vanishing_gradient``,
    ``exploding_update``, ``divergence``); ``count`` is how many alerts of this kind the run has raised so far."""

    kind: str
    message: str
    value: float
    count: int
    version: Version
    client_id: ClientId | None
    simulated_s: float
