"""`evolve` gives what `dataclasses.replace` gives, for every kind of dataclass."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import InitVar, dataclass, field
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.job import JobState
from services.common.frozen import _copyable, evolve
from services.gateway.projection import JobView
from services.meter.runs import RunState
from services.meter.ticks import Run
from services.queue.lifecycle import JobRecord


@dataclass(frozen=True)
class Plain:
    a: int
    b: str = "b"
    c: tuple[int, ...] = ()
    hidden: bool = field(default=False, compare=False)


@dataclass(frozen=True)
class Derived:
    a: int
    doubled: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "doubled", 2 * self.a)


@dataclass
class Cached:
    a: int

    @functools.cached_property
    def squared(self) -> int:
        return self.a * self.a


@dataclass(frozen=True, slots=True)
class Slotted:
    a: int
    b: int = 0


@dataclass(frozen=True)
class Counted:
    a: int
    seen: int = field(default=0, init=False)  # replace resets it to its default


@dataclass
class Handmade:
    a: int

    def __init__(self, a: int) -> None:
        self.a = abs(a)


@dataclass(init=False)
class NoInit:
    a: int = 0


@dataclass
class WithInitVar:
    a: int
    scale: InitVar[int] = 1


class SlottedBase:
    __slots__ = ("extra",)


@dataclass
class OnSlottedBase(SlottedBase):
    a: int


@given(st.integers(), st.text(), st.lists(st.integers()).map(tuple), st.booleans())
def test_the_same_as_replace_for_a_plain_class(a: int, b: str, c: tuple[int, ...], h: bool) -> None:
    old = Plain(1, hidden=True)
    new = evolve(old, a=a, b=b, c=c, hidden=h)
    assert new == dataclasses.replace(old, a=a, b=b, c=c, hidden=h)
    assert new.hidden is h  # a field left out of comparisons is set too
    assert old == Plain(1, hidden=True) and old.hidden  # the old one is untouched
    assert evolve(old).hidden and evolve(old) == old and evolve(old) is not old


def test_a_frozen_result_stays_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        evolve(Plain(1), a=2).a = 3  # type: ignore[misc]


def test_a_name_that_is_no_field_is_refused_as_replace_refuses_it() -> None:
    with pytest.raises(TypeError):
        evolve(Plain(1), d=4)


def test_a_class_with_post_init_or_a_cached_property_or_slots_goes_through_replace() -> None:
    assert evolve(Derived(2), a=5).doubled == 10  # __post_init__ ran
    old = Cached(3)
    assert old.squared == 9  # cached in the instance's dictionary
    assert evolve(old, a=4).squared == 16  # not carried over
    assert evolve(Slotted(1), b=2) == Slotted(1, 2)
    assert _copyable(Derived) is None and _copyable(Cached) is None
    assert _copyable(Slotted) is None


def test_classes_replace_treats_otherwise_go_through_replace() -> None:
    counted = Counted(1)
    object.__setattr__(counted, "seen", 5)
    assert evolve(counted, a=2) == dataclasses.replace(counted, a=2)
    assert evolve(counted, a=2).seen == 0
    assert evolve(Handmade(1), a=-3).a == 3  # its own __init__ ran
    assert evolve(WithInitVar(1), a=2) == dataclasses.replace(WithInitVar(1), a=2)
    on_base = OnSlottedBase(1)
    on_base.extra = 7
    assert not hasattr(evolve(on_base, a=2), "extra")
    for cls in (Counted, Handmade, NoInit, WithInitVar, OnSlottedBase):
        assert _copyable(cls) is None, cls


def test_an_instance_carrying_more_than_its_fields_goes_through_replace() -> None:
    old = Plain(1)
    object.__setattr__(old, "extra", 1)
    assert not hasattr(evolve(old, a=2), "extra")


@pytest.mark.parametrize("cls", [JobView, JobRecord, RunState, Run])
def test_the_hot_paths_classes_take_the_fast_way(cls: type) -> None:
    """The projections' records are plain: if one gains a __post_init__ or a cached
    property, `evolve` is still right but no faster than `replace` for it."""
    assert _copyable(cls) is not None


def test_a_view_evolved_equals_the_view_replaced() -> None:
    at = datetime(2026, 11, 1, tzinfo=UTC)
    view = JobView("j", "t", JobState.QUEUED, at, at, nodes=("n1",), spec_stored=True)
    changes = {"state": JobState.PLACED, "attempt": 2, "cluster": "c1"}
    evolved, replaced = evolve(view, **changes), dataclasses.replace(view, **changes)
    assert evolved == replaced and evolved.spec_stored and replaced.spec_stored
    assert vars(evolved) == vars(replaced)
