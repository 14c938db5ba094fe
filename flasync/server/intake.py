"""The intake: one admission path for every update, at the cloud and at every edge.

An update is admitted only if it answers a task in flight, was trained from a version that exists and is not too
stale, decodes into a vector of the model's length, and passes validation (form, finiteness, norm bound, robust
z-score), and every plug-in of the run's algorithm state (:class:`~flasync.training.plugins.ServerPlugin`) agrees;
an admitted update is clipped to the configured norm. A refusal names its reason and is never an exception: a
forged or broken upload costs its sender, never the run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch

from flasync.codecs import Pipeline
from flasync.codecs.validation import UpdateValidator, Verdict, clip_to_norm
from flasync.core.errors import DecodeError
from flasync.core.events import UpdateUploaded
from flasync.core.snapshots import ModelSnapshot
from flasync.server.registry import TaskRegistry
from flasync.training.plugins import Refusal, ServerPlugin

__all__ = ["Admitted", "Decoded", "Intake", "Plain", "PreparedRow", "Refused", "RowDecoder"]

_new_tuple = tuple.__new__  # builds a named tuple (every field given) in C, without its class's Python constructor


class Decoded(NamedTuple):
    """An upload's delta as :meth:`Intake.decode` gave it.

    Attributes:
        delta: The delta on the intake's device (None: the payload does not decode, see ``error``).
        norm: Its L2 norm where a batch's norms were taken together (None: the validator takes it).
        decode_s: Real seconds its decoding took (its share of a batch's).
        error: Why the payload does not decode (empty when it does).
        alone: The validator's verdict and norm of the checks that look at the delta alone
            (:meth:`~flasync.codecs.validation.UpdateValidator.check_alone`), where a batch's rows were checked
            together (None: they are taken at admission).
    """

    delta: torch.Tensor | None
    norm: float | None
    decode_s: float
    error: str = ""
    alone: tuple[Verdict | None, float] | None = None


class Admitted(NamedTuple):
    """An update that may be aggregated: the decoded (and clipped) delta and what was learnt about it (a named
    tuple: one is made per update on the event loop, and a frozen dataclass's constructor costs several times
    one)."""

    delta: torch.Tensor
    staleness: int
    norm: float
    base: ModelSnapshot
    received_wall: float
    decode_s: float
    extra: torch.Tensor | None = None


class PreparedRow(NamedTuple):
    """One upload's delta as :meth:`Intake.decode` would give it in a batch, made ahead by a :class:`RowDecoder`.

    Attributes:
        decoded: The entry :meth:`Intake.decode` gives the upload: its delta (a row of the stacked tensor its batch
            was decoded into), norm, share of the decoding's seconds and the verdict of the checks of the delta
            alone.
        payload: The bytes it was decoded from (an intake takes the entry only for the upload that carries them).
        decoder: The decoder that made it (an intake takes only its own decoder's rows).
        lease: Its batch's rows counted in the decoder's bound (``RowDecoder.max_bytes``), shared by the batch's
            entries: their bytes come back when the last entry is dropped (taken by an intake, or dropped with its
            upload).
    """

    decoded: Decoded
    payload: bytes
    decoder: RowDecoder
    lease: _Lease


class _Lease:
    """Bytes of a batch's rows counted in a :class:`RowDecoder`'s bound, given back when the lease is freed (in
    whichever thread drops it last: a batch's entries share one)."""

    __slots__ = ("_give_back", "nbytes")

    def __init__(self, give_back: Callable[[int], None], nbytes: int) -> None:
        self._give_back = give_back
        self.nbytes = nbytes

    def __del__(self) -> None:
        self._give_back(self.nbytes)


class RowDecoder:
    """Decode uploads' payloads together and check each delta alone, as :meth:`Intake.decode` does a batch, anywhere.

    The training worker that encodes a cohort's uploads calls it right after (see
    :attr:`flasync.training.jobs.JobContext.prepare`), so the event loop finds each upload's delta decoded, measured
    and checked when the upload arrives. It reads only what is fixed when it is made (the codec, the model's length,
    the validator's ``max_norm``) and writes only the fresh tensor it returns rows of, so any thread may call it
    while the run goes on. Row ``k`` of a batch is what :meth:`Intake.decode` gives the same payload in any batch of
    two or more: the same delta, bit for bit, the same norm (one ``vector_norm`` per row, whatever the other rows) and
    the same verdict (:meth:`~flasync.codecs.validation.UpdateValidator.check_rows` judges each row alone). The row
    of a lone payload is admitted as the upload decoded alone and checked at admission would be: the same delta,
    norm and verdict.

    Args:
        codec: How clients encode their deltas (the receiving intake's).
        num_params: Length of the flat model.
        max_norm: The validator's bound on an update's L2 norm (None: no bound).
        wall: Monotonic real seconds (decode timing).
        max_bytes: The most bytes of decoded rows it may have waiting at once, every batch's together: a row waits
            beside its payload from the moment it is made until its batch's entries are dropped (taken by the
            intake, or dropped with their uploads), so rows are made only while those waiting and the new batch's fit
            in it, and the receiver decodes the rest as they arrive. Memory made ahead is bounded by it, whatever the
            number of uploads waiting and their model's size.
    """

    __slots__ = ("_alive", "_checks", "_lock", "codec", "max_bytes", "num_params", "wall")

    def __init__(
        self,
        *,
        codec: Pipeline,
        num_params: int,
        max_norm: float | None,
        wall: Callable[[], float],
        max_bytes: int = 256 << 20,
    ) -> None:
        """Bind the codec and the checks of a delta alone."""
        self.codec = codec
        self.num_params = num_params
        self.wall = wall
        self.max_bytes = max_bytes
        self._alive = 0  # bytes of the rows it made that are still waiting
        # Reentrant: a lease may be freed (and its bytes given back) by a collection inside the counting itself.
        self._lock = threading.RLock()
        # Its own validator, with no history: the checks of a delta alone read only its form and max_norm.
        self._checks = UpdateValidator(num_params, max_norm=max_norm)

    @property
    def max_norm(self) -> float | None:
        """The bound on an update's L2 norm its checks apply (None: none)."""
        return self._checks.max_norm

    def matches(self, codec: Pipeline, num_params: int, validator: UpdateValidator) -> bool:
        """Whether its rows are what an intake of ``codec``, ``num_params`` and ``validator`` decodes and checks."""
        checks = self._checks
        return (
            codec == self.codec
            and num_params == self.num_params
            and validator.num_params == num_params
            and validator.dtype == checks.dtype
            and validator.max_norm == checks.max_norm
        )

    @property
    def alive_bytes(self) -> int:
        """Bytes of the rows it made that are still waiting (each batch's until the last of its entries is dropped)."""
        return self._alive

    def __call__(self, payloads: Sequence[bytes]) -> list[PreparedRow] | None:
        """Decode ``payloads`` into the rows of a new tensor; None where they cannot be decoded together (none, rows
        that would take those waiting past ``max_bytes``, or not of one dense form: the receiver decodes them)."""
        count = len(payloads)
        nbytes = count * self.num_params * self._checks.dtype.itemsize
        if not count or not self._take(nbytes):
            return None
        lease = _Lease(self._give_back, nbytes)  # gives the bytes back when dropped: returned unused, raised or freed
        start = self.wall()
        stacked = self.codec.decode_stacked(payloads, expected_elements=self.num_params)
        if stacked is None:
            return None
        norms = torch.linalg.vector_norm(stacked, dim=1).tolist()
        share = (self.wall() - start) / count
        checks = self._checks.check_rows(stacked, norms)
        return [
            PreparedRow(_new_tuple(Decoded, (row, norm, share, "", alone)), payload, self, lease)
            for row, norm, alone, payload in zip(stacked.unbind(0), norms, checks, payloads, strict=True)
        ]

    def _take(self, nbytes: int) -> bool:
        """Count ``nbytes`` more of rows waiting if they fit in ``max_bytes``; tell whether they did."""
        with self._lock:
            if self._alive + nbytes > self.max_bytes:
                return False
            self._alive += nbytes
            return True

    def _give_back(self, nbytes: int) -> None:
        with self._lock:
            self._alive -= nbytes


@dataclass(frozen=True, slots=True)
class Refused:
    """An update that must not be aggregated: a short ``reason`` key and a one-line ``detail``."""

    reason: str
    detail: str


def _unexpected(message: UpdateUploaded) -> Refused:
    """The refusal of an upload that answers no task in flight."""
    return Refused("unexpected", f"client {message.client_id} has no task {message.task_id}")


class Plain(NamedTuple):
    """A run of uploads :meth:`Intake.plain` found, as columns in order: the uploads, their staleness, their deltas,
    the deltas' L2 norms and each one's decoding seconds."""

    uploads: list[UpdateUploaded]
    staleness: list[int]
    deltas: list[torch.Tensor]
    norms: list[float]
    decode_s: list[float]


class Intake:
    """Admit or refuse uploaded updates.

    Args:
        registry: The tasks in flight (an admitted update releases its task) and the models they started from.
        codec: How clients encoded their deltas.
        num_params: Length of the flat model.
        device: Where admitted deltas go (the aggregator's device).
        validator: Form, finiteness and norm checks; it remembers accepted norms.
        max_staleness: Refuse updates more versions old than this (None: no limit).
        clip_norm: Scale admitted updates down to this L2 norm (None: no clipping).
        wall: Monotonic real seconds (decode timing).
        plugins: The run's server-side algorithm state: each checks an upload before its delta is decoded, decodes
            what the client sent beside it, and learns of its admission.
        row_decoder: Whose rows :meth:`decode` takes where a batch arrives with them (:class:`PreparedRow`), made
            ahead off the event loop; ignored unless it decodes and checks as this intake does, on the CPU (None:
            every batch is decoded here).
    """

    def __init__(
        self,
        *,
        registry: TaskRegistry,
        codec: Pipeline,
        num_params: int,
        device: torch.device,
        validator: UpdateValidator,
        max_staleness: int | None,
        clip_norm: float | None,
        wall: Callable[[], float],
        plugins: Sequence[ServerPlugin] = (),
        row_decoder: RowDecoder | None = None,
    ) -> None:
        """Bind the registry, codec and checks."""
        self.registry = registry
        self.codec = codec
        self.num_params = num_params
        self.device = device
        self.validator = validator
        self.max_staleness = max_staleness
        self.clip_norm = clip_norm
        self.wall = wall
        self.plugins = tuple(plugins)
        self._decodes_extra = any(plugin.decodes_extra for plugin in self.plugins)
        # Where batches are decoded, kept from one batch to the next (an aggregator reads a delta or clones it, and a
        # batch is decoded once the previous one was handled): a fresh buffer of a megabyte or more would cost its
        # pages' first touch every time, several times the decoding.
        self._rows: torch.Tensor | None = None
        takes_rows = (
            row_decoder is not None
            and device.type == "cpu"
            and not self._decodes_extra
            and row_decoder.matches(codec, num_params, validator)
        )
        self.row_decoder = row_decoder if takes_rows else None

    def decode(self, messages: Sequence[UpdateUploaded], prepared: Sequence[object] | None = None) -> list[Decoded]:
        """Decode the deltas of uploads that arrived together (one upload or many), in order.

        A batch whose payloads share one form is decoded in a few tensor calls, its norms taken in one reduction
        (:meth:`~flasync.codecs.Pipeline.decode_stacked`, one ``vector_norm`` over the rows) and the validator's
        checks of each delta alone (form, finiteness, ``max_norm``) made over its rows together
        (:meth:`~flasync.codecs.validation.UpdateValidator.check_rows`: each row's verdict and norm as alone); one
        upload, or a batch that cannot be decoded together (payloads of several forms, a plug-in's extras beside the
        deltas), is decoded upload by upload. Nothing is released or recorded here: each upload still goes through
        :meth:`admit` with its entry, which refuses it in its turn. A batch's deltas are rows of a buffer the next
        batch writes again: admit its uploads before decoding another.

        Where the batch (one upload included) comes with each upload's row made ahead by this intake's
        :attr:`row_decoder`, those are its entries (the same deltas, norms and verdicts, decoded off the event loop),
        else it is decoded here.

        Args:
            messages: The uploads, in the order they will be admitted.
            prepared: Each upload's :class:`PreparedRow`, in order, where they were decoded ahead (None: none).
        """
        if not self._decodes_extra:
            if prepared is not None and self.row_decoder is not None:
                rows = self._prepared(messages, prepared)
                if rows is not None:
                    return rows
            if len(messages) > 1:
                stacked = self._decode_stacked(messages)
                if stacked is not None:
                    return stacked
        return [self._decode_one(message) for message in messages]

    def _prepared(self, messages: Sequence[UpdateUploaded], prepared: Sequence[object]) -> list[Decoded] | None:
        """The entries of ``prepared`` where each is this intake's decoder's row of its upload's payload, else None."""
        decoder = self.row_decoder
        if len(prepared) != len(messages):
            return None
        for row, message in zip(prepared, messages, strict=True):
            if type(row) is not PreparedRow or row.decoder is not decoder or row.payload is not message.payload:
                return None
        return [row.decoded for row in cast("Sequence[PreparedRow]", prepared)]

    def _decode_one(self, message: UpdateUploaded) -> Decoded:
        start = self.wall()
        try:
            delta = self.codec.decode(message.payload, expected_elements=self.num_params)
        except DecodeError as exc:
            return Decoded(None, None, self.wall() - start, str(exc))
        if delta.device != self.device:
            delta = delta.to(self.device)
        return Decoded(delta, None, self.wall() - start)

    def _decode_stacked(self, messages: Sequence[UpdateUploaded]) -> list[Decoded] | None:
        """Decode a batch's deltas as rows of one buffer; None where their payloads cannot be decoded together."""
        start = self.wall()
        count, rows = len(messages), self._rows
        if rows is None or rows.shape[0] < count:
            rows = self._rows = torch.empty((count, self.num_params), dtype=torch.float32)
        stacked = self.codec.decode_stacked(
            [m.payload for m in messages], expected_elements=self.num_params, out=rows[:count]
        )
        if stacked is None:
            return None
        if stacked.device != self.device:
            stacked = stacked.to(self.device)
        norms = torch.linalg.vector_norm(stacked, dim=1).tolist()
        share = (self.wall() - start) / count
        checks = self.validator.check_rows(stacked, norms)
        return [
            _new_tuple(Decoded, (row, norm, share, "", alone))
            for row, norm, alone in zip(stacked.unbind(0), norms, checks, strict=True)
        ]

    def admit(self, message: UpdateUploaded, *, version: int, decoded: Decoded | None = None) -> Admitted | Refused:
        """Check ``message`` against the model ``version`` it would join; release its task unless it is forged.

        Args:
            message: The upload.
            version: The version the receiver holds now (the cloud's, or the one an edge last installed).
            decoded: Its entry of :meth:`decode` (None: decoded here, as a batch of one).
        """
        registry, plugins = self.registry, self.plugins
        base_version = int(message.base_version)
        base = registry.base(message.base_version)
        received_wall = self.wall()
        if not 0 <= base_version <= version:
            # Refused before it can close a task: a forged or corrupt message must not cost the real answer.
            return Refused("unknown_version", f"base version {message.base_version} was never published")
        if not registry.release(message):
            return _unexpected(message)
        staleness = version - base_version
        if base is None or staleness < 0:
            return Refused("unknown_version", f"base version {message.base_version} was never published")
        limit = self.max_staleness
        if limit is not None and staleness > limit:
            return Refused("stale", f"staleness {staleness} > max_staleness {limit}")
        for plugin in plugins:
            objection = plugin.admit(message, version)
            if objection is not None:
                return Refused(*objection)
        delta, norm, decode_s, error, alone = self._decode_one(message) if decoded is None else decoded
        if delta is None:
            return Refused("decode", error)
        extra = None
        for plugin in plugins:
            value = plugin.decode_extra(message)
            if isinstance(value, Refusal):
                return Refused(*value)
            if value is not None:
                extra = value
        if alone is None:
            verdict, norm = self.validator.check(delta, norm)
        else:  # the checks of the delta alone were made with its batch's; those against the history are made now
            verdict, norm = alone
            if verdict is None:
                verdict = self.validator.check_norm(norm)
        if verdict is not None:
            return Refused(verdict.reason, verdict.detail)
        if self.clip_norm is not None:
            delta, _ = clip_to_norm(delta, self.clip_norm)
        for plugin in plugins:
            plugin.admitted(message, version)
        return _new_tuple(Admitted, (delta, staleness, norm, base, received_wall, decode_s, extra))

    def plain(
        self, batch: Sequence[tuple[UpdateUploaded, Decoded | None]], start: int, version: int, end: int | None = None
    ) -> Plain:
        """Find the longest run of uploads from ``batch[start]`` on (before ``batch[end]``, if given) that :meth:`admit`
        would pass up to the release of its task and the checks against the norms seen before (:meth:`take_run` makes
        those); nothing is changed.

        Each is plain: decoded (its entry of :meth:`decode`) into a delta that passes the checks of a delta alone,
        trained from a version that exists, ``version`` holds its model and it is not too stale, and no plug-in of
        the run's algorithm state takes part (with one the run is empty). The first upload that is not stops it:
        :meth:`admit` takes that one.

        Args:
            batch: Uploads and their entries of :meth:`decode`, in the order they are admitted.
            start: Where the run begins.
            version: The version the receiver holds now.
            end: Where the run ends at the latest (None: the end of ``batch``).
        """
        run = Plain([], [], [], [], [])
        if self.plugins:
            return run
        uploads, staleness, deltas, norms, seconds = run
        registry, limit, validator = self.registry, self.max_staleness, self.validator
        known = -1  # the last base version found (a batch's uploads mostly share theirs)
        for index in range(start, len(batch) if end is None else min(end, len(batch))):
            message, decoded = batch[index]
            base_version = int(message.base_version)
            if not 0 <= base_version <= version:
                break
            if base_version != known:
                if registry.base(message.base_version) is None:
                    break
                known = base_version
            tau = version - base_version
            if (limit is not None and tau > limit) or decoded is None:
                break
            delta, norm, decode_s, _, alone = decoded
            if delta is None:
                break
            if alone is None:  # an upload decoded alone: the checks of its delta alone are made here
                alone = validator.check_alone(delta, norm)
            if alone[0] is not None:
                break
            uploads.append(message)
            staleness.append(tau)
            deltas.append(delta)
            norms.append(alone[1])
            seconds.append(decode_s)
        return run

    def take_run(
        self,
        uploads: Sequence[UpdateUploaded],
        deltas: list[torch.Tensor],
        norms: Sequence[float],
        after: Callable[[bool], None] | None = None,
    ) -> Refused | None:
        """Admit a run of plain uploads (:meth:`plain`) in order, as :meth:`admit` would one by one, and record each
        as :meth:`accepted` would: the caller folds every delta left in ``deltas`` (the norms join the z-score's
        reference as they are taken, each before the next one is judged).

        Each upload's task is released and its norm checked against the norms seen before; the run stops at the
        first that is refused (its task released, as :meth:`admit` would leave it). ``deltas`` is cut to those
        admitted (and clipped to ``clip_norm`` where that is set). ``after`` (if given) is called with each one's
        outcome (accepted or not) once it is known, before the next task is released.

        Returns:
            The refusal of the upload after the last one admitted (None: every upload of the run was admitted).
        """
        registry, validator, clip = self.registry, self.validator, self.clip_norm
        history, release = validator.judges_history, registry.release
        refused: Refused | None = None
        taken = 0
        for message, norm in zip(uploads, norms, strict=True):
            if not release(message):
                refused = _unexpected(message)
                break
            if history:
                verdict = validator.check_norm(norm)
                if verdict is not None:
                    refused = Refused(verdict.reason, verdict.detail)
                    break
                validator.accepted(norm)
            taken += 1
            if after is not None:
                after(True)
        if refused is not None and after is not None:
            after(False)
        del deltas[taken:]
        if not history:
            validator.accepted_many(norms[:taken])
        if clip is not None:
            deltas[:] = [clip_to_norm(delta, clip)[0] for delta in deltas]
        return refused

    def accepted(self, admitted: Admitted) -> None:
        """Record that ``admitted`` was aggregated (its norm joins the z-score's reference)."""
        self.validator.accepted(admitted.norm)  # a norm that is not finite is not recorded

    def state_dict(self) -> dict[str, Any]:
        """Return the validator's reference norms."""
        return {"validator_norms": self.validator.norms}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.validator.load_norms(state["validator_norms"])
