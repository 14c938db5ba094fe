"""Events: their quicker constructors make the objects, and refuse the arguments, that dataclasses' would."""

from __future__ import annotations

import dataclasses
import inspect
import math
import pickle
import random
from typing import Any

import pytest

from flasync.core import events
from flasync.core.events import Evaluated, TaskDiagnosis, UpdateUploaded

EVENT_CLASSES = [
    cls for name in events.__all__ if dataclasses.is_dataclass(cls := getattr(events, name)) and isinstance(cls, type)
]


def _value(rng: random.Random, spec: dataclasses.Field[Any]) -> Any:
    """A value for one field, of a kind its annotation names (the constructor does not check types)."""
    kind = str(spec.type)
    if "bytes" in kind:
        return rng.randbytes(rng.randrange(8))
    if "Mapping" in kind or "frozenset" in kind:
        return {"x": rng.random()} if "Mapping" in kind else frozenset({rng.randrange(9)})
    if "tuple" in kind:
        return (rng.random(),)
    if "float" in kind:
        return rng.random()
    if "bool" in kind:
        return rng.random() < 0.5
    if "str" in kind or "Literal" in kind:
        return rng.choice(["cloud", "edge-1", "error"])
    return rng.randrange(1000)


def _by_setattr(cls: type[Any], values: dict[str, Any]) -> Any:
    """Build an event the way the constructor dataclasses writes does: defaults, then each field stored in turn."""
    made = object.__new__(cls)
    for spec in dataclasses.fields(cls):
        if spec.name in values:
            value = values[spec.name]
        elif spec.default is not dataclasses.MISSING:
            value = spec.default
        else:
            value = spec.default_factory()  # type: ignore[misc]
        object.__setattr__(made, spec.name, value)
    return made


def test_every_event_class_is_frozen_slotted_and_keyword_only() -> None:
    """Every event is a frozen, slotted dataclass whose fields are keyword-only arguments of its constructor."""
    assert len(EVENT_CLASSES) >= 20
    for cls in EVENT_CLASSES:
        assert cls.__dataclass_params__.frozen and "__slots__" in cls.__dict__  # type: ignore[attr-defined]
        parameters = list(inspect.signature(cls).parameters.values())
        specs = dataclasses.fields(cls)
        assert [p.name for p in parameters] == [s.name for s in specs]
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters)
        for parameter, spec in zip(parameters, specs, strict=True):
            if spec.default is not dataclasses.MISSING:
                assert parameter.default is spec.default
            elif spec.default_factory is not dataclasses.MISSING:
                assert repr(parameter.default) == "<factory>"
            else:
                assert parameter.default is inspect.Parameter.empty


@pytest.mark.parametrize("cls", EVENT_CLASSES, ids=lambda cls: cls.__name__)
def test_constructed_events_equal_events_stored_field_by_field(cls: type[Any]) -> None:
    """With random arguments, and with every optional one left out, an event equals (and hashes, prints and pickles
    like) the one stored field by field."""
    rng = random.Random(cls.__name__)
    specs = dataclasses.fields(cls)
    for keep_optional in (True, False):
        values = {
            s.name: _value(rng, s)
            for s in specs
            if keep_optional or (s.default is dataclasses.MISSING and s.default_factory is dataclasses.MISSING)
        }
        made, expected = cls(**values), _by_setattr(cls, values)
        assert made == expected
        assert repr(made) == repr(expected)
        assert repr(pickle.loads(pickle.dumps(made))) == repr(made)  # (a NaN unpickled is a new float)
        try:
            expected_hash = hash(expected)
        except TypeError:  # a mapping field
            with pytest.raises(TypeError):
                hash(made)
        else:
            assert hash(made) == expected_hash
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(made, specs[0].name, values.get(specs[0].name))


def test_default_factories_give_each_event_its_own_value() -> None:
    """A field with a default factory gets a fresh value per event, and a given value is kept as given."""
    first = Evaluated(version=events.Version(1), accuracy=0.5, loss=1.0, simulated_s=0.0, wall_s=0.0)
    second = Evaluated(version=events.Version(1), accuracy=0.5, loss=1.0, simulated_s=0.0, wall_s=0.0)
    assert first.metrics == {} and first.metrics is not second.metrics
    given = {"f1": 0.25}
    assert (
        Evaluated(version=events.Version(1), accuracy=0.5, loss=1.0, simulated_s=0.0, wall_s=0.0, metrics=given).metrics
        is given
    )


def test_constructors_refuse_what_dataclass_constructors_refuse() -> None:
    """Missing, unknown and positional arguments are TypeErrors naming the problem."""
    with pytest.raises(TypeError, match="missing 4 required keyword-only arguments"):
        Evaluated(version=events.Version(1))  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        TaskDiagnosis(colour=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="positional argument"):
        TaskDiagnosis(True)  # type: ignore[misc]
    upload = UpdateUploaded(
        task_id=1,
        client_id=events.ClientId(2),
        base_version=events.Version(0),
        num_samples=3,
        payload=b"ab",
        train_loss=math.nan,
        simulated_s=0.0,
        sent_wall_s=0.0,
    )
    assert dataclasses.replace(upload, task_id=5).task_id == 5
    assert upload.upload_bytes == 2 and upload.to == events.CLOUD


def test_an_event_is_made_of_its_own_class_and_a_subclass_of_its_subclass() -> None:
    """An event is made with its class's quicker stores yet is of that class, frozen; an object of a subclass with
    a slot of its own (another layout, which the quicker stores leave alone) is made field by field, of that
    subclass, equal in every field."""

    class Tagged(UpdateUploaded):
        __slots__ = ("tag",)

    values: dict[str, Any] = {
        "task_id": 3,
        "client_id": events.ClientId(4),
        "base_version": events.Version(5),
        "num_samples": 6,
        "payload": b"abc",
        "train_loss": 0.25,
        "simulated_s": 1.5,
        "sent_wall_s": 2.5,
    }
    made, tagged = UpdateUploaded(**values), Tagged(**values)
    assert type(made) is UpdateUploaded and type(tagged) is Tagged
    assert all(getattr(tagged, f.name) == getattr(made, f.name) for f in dataclasses.fields(UpdateUploaded))
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.task_id = 9  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        tagged.task_id = 9  # type: ignore[misc]


@pytest.mark.parametrize("cls", EVENT_CLASSES, ids=lambda cls: cls.__name__)
def test_positional_makes_the_event_the_constructor_makes(cls: type[Any]) -> None:
    """positional(cls) given every field's value in field order makes an event of that class equal to (and printing
    and pickling like) the constructor's, frozen."""
    rng = random.Random(f"positional {cls.__name__}")
    specs = dataclasses.fields(cls)
    for _ in range(3):
        values = {s.name: _value(rng, s) for s in specs}
        made = events.positional(cls)(*values.values())
        expected = cls(**values)
        assert type(made) is cls and made == expected and repr(made) == repr(expected)
        assert repr(pickle.loads(pickle.dumps(made))) == repr(made)
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(made, specs[0].name, values[specs[0].name])
    with pytest.raises(TypeError, match="positional"):
        events.positional(cls)(*list(values.values())[:-1])


def test_positional_refuses_a_class_that_is_no_event() -> None:
    """Only the events of flasync.core.events have a positional maker."""
    with pytest.raises(TypeError, match="is not an event"):
        events.positional(dict)
