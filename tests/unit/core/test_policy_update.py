"""Changing a batcher's policy while it serves (``update_policy``), under load and one
change at a time.

A seeded random run changes every field that can change (sizes, delays, preferred sizes,
queue bounds, timeouts, classes added, removed, renamed and reordered, shares, costs)
while requests of every class arrive, expire, are cancelled and run out of memory on three
replicas. The model checks each batch against the policy in force when it formed (an
async model runs on the loop, so its body starts in the same step the batch closed);
the run checks that every accepted request is answered once, by those rules, that a
refused update changes nothing, and that afterwards every class gets exactly its share of
the replicas (its running count neither leaked up nor went negative).

Smaller tests pin each edge on its own, and each kind of update (validated first, in force
for the next batch). Time is a FakeClock throughout.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from carpool import (
    Batcher,
    BatchPolicy,
    ClassPolicy,
    ConfigError,
    DeadlineExceeded,
    InvalidInput,
    QueueFull,
)
from carpool.core.clock import FakeClock, settle
from carpool.core.scheduler import share_cap

from .conftest import occupy

SAFETY_S = 5.0  # a net against a hung test, never a timing assertion
NUM_REPLICAS = 3
OOM_ABOVE = 5  # the model runs out of memory on batches of more items than this

CLASS_SETS: list[tuple[ClassPolicy, ...]] = [
    (ClassPolicy("interactive"), ClassPolicy("normal"), ClassPolicy("background", share=0.34)),
    (
        ClassPolicy("interactive", max_batch_size=2),
        ClassPolicy("normal", share=0.67),
        ClassPolicy("background", share=0.34, max_batch_size=3),
    ),
    (ClassPolicy("interactive"), ClassPolicy("normal")),  # background removed
    (ClassPolicy("normal"), ClassPolicy("bulk", share=0.34, max_batch_size=4)),  # renamed
    (ClassPolicy("bulk", share=0.67), ClassPolicy("normal", share=0.34)),  # reordered
]
PRIORITIES = [None, "interactive", "normal", "background", "bulk"]


@dataclass
class Sent:
    """One client request and what the batcher's state was when it was admitted."""

    rid: int
    num_items: int  # 0: a single submit()
    priority: str | None
    policy: BatchPolicy
    num_pending: int
    deadline_s: float | None = None
    task: asyncio.Task[Any] | None = None
    was_cancelled: bool = False


@dataclass
class CheckingModel:
    """An async list model that checks every batch against the policy in force."""

    clock: FakeClock
    rng: random.Random
    batcher: Batcher | None = None
    sent: dict[int, Sent] = field(default_factory=dict)
    entered: set[int] = field(default_factory=set)
    ok_calls: Counter[int] = field(default_factory=Counter)
    running_by_lead: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    oom: bool = True

    async def __call__(self, batch: list[tuple[int, int]]) -> list[tuple[int, int, str]]:
        assert self.batcher is not None
        rids = list(dict.fromkeys(rid for rid, _ in batch))
        is_retry = any(rid in self.entered for rid in rids)  # a half of a bisected batch
        self.entered.update(rids)
        policy = self.batcher.policy
        classes = [self._class_of(rid) for rid in rids]
        lead = classes[0]
        now = self.clock.now()
        for rid in rids:
            deadline_s = self.sent[rid].deadline_s
            if deadline_s is not None and now >= deadline_s:
                self.problems.append(f"request {rid} reached the model past its deadline")
        if not is_retry:
            self._check_new_batch(policy, rids, classes, len(batch))
        self.running_by_lead[lead] += 1
        try:
            await self.gate.wait()
            for _ in range(self.rng.randrange(12)):
                await asyncio.sleep(0)
        finally:
            self.running_by_lead[lead] -= 1
        if self.oom and len(batch) > OOM_ABOVE:
            raise MemoryError(f"a batch of {len(batch)}")
        self.ok_calls.update(rids)
        return [(rid, j, "out") for rid, j in batch]

    def _check_new_batch(
        self, policy: BatchPolicy, rids: list[int], classes: list[str], num_items: int
    ) -> None:
        assert self.batcher is not None
        lead = classes[0]
        limits = policy.limits.get(lead)
        if limits is None:
            self.problems.append(f"a batch led by {lead!r}, a class the policy lacks")
            return
        cap = min(limits.max_batch_size, self.batcher.effective_max_batch_size)
        if num_items > cap and len(rids) > 1:
            self.problems.append(f"a batch of {num_items} items formed under a max of {cap}")
        if policy.max_batch_cost is not None and len(rids) > 1:
            cost = sum(max(1, self.sent[r].num_items) for r in rids)
            if cost > policy.max_batch_cost:
                self.problems.append(f"a batch costing {cost} > {policy.max_batch_cost}")
        ranks = [policy.limits[c].rank if c in policy.limits else -1 for c in classes]
        if ranks != sorted(ranks) or min(ranks) < 0:
            self.problems.append(f"batch classes {classes} out of the policy's order")
        if not policy.fill_from_lower and len(set(classes)) > 1:
            self.problems.append(f"classes {classes} mixed with fill_from_lower=False")
        # No class in this policy ages (no max_wait_s), so the share cap always holds.
        allowed = share_cap(limits.share, NUM_REPLICAS)
        if self.running_by_lead[lead] + 1 > allowed:
            self.problems.append(
                f"{lead!r} leads {self.running_by_lead[lead] + 1} batches, share allows {allowed}"
            )

    def _class_of(self, rid: int) -> str:
        sent = self.sent[rid]
        return sent.priority or sent.policy.default_class


async def _client(batcher: Batcher, model: CheckingModel, sent: Sent, timeout_s: Any) -> Any:
    """Submit ``sent``; the policy is read in the same step the batcher admits it."""
    sent.policy = batcher.policy
    sent.num_pending = batcher.num_pending
    limits = sent.policy.limits.get(sent.priority or sent.policy.default_class)
    timeout = timeout_s if timeout_s is not None else limits and limits.timeout_s
    sent.deadline_s = None if timeout is None else model.clock.now() + timeout
    model.sent[sent.rid] = sent
    options: dict[str, Any] = {"timeout_s": timeout_s}
    if sent.priority is not None:
        options["priority"] = sent.priority
    if sent.num_items:
        return await batcher.submit_many([(sent.rid, j) for j in range(sent.num_items)], **options)
    return await batcher.submit((sent.rid, 0), **options)


def _random_changes(rng: random.Random, current: BatchPolicy) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    for _ in range(rng.randint(1, 3)):
        key = rng.choice(
            [
                "max_batch_size",
                "max_delay_s",
                "preferred_batch_sizes",
                "max_queue_size",
                "timeout_s",
                "classes",
                "fill_from_lower",
                "max_batch_cost",
                "oom_recovery_s",
                "bad",
            ]
        )
        if key == "max_batch_size":
            changes[key] = rng.choice([1, 2, 3, 4, 6, 8])
            if rng.random() < 0.7:  # keep the preferred sizes valid, most of the time
                changes["preferred_batch_sizes"] = tuple(
                    s for s in current.preferred_batch_sizes if s <= changes[key]
                )
        elif key == "max_delay_s":
            changes[key] = rng.choice([0.0, 0.001, 0.005, 0.02])
        elif key == "preferred_batch_sizes":
            changes[key] = tuple(rng.sample([1, 2, 3, 4, 8], rng.randint(0, 2)))
        elif key == "max_queue_size":
            changes[key] = rng.choice([None, 2, 5, 40])
        elif key == "timeout_s":
            changes[key] = rng.choice([None, 0.003, 0.02])
        elif key == "classes":
            classes = rng.choice(CLASS_SETS)
            changes[key] = classes
            changes["default_class"] = rng.choice([c.name for c in classes])
        elif key == "fill_from_lower":
            changes[key] = rng.random() < 0.6
        elif key == "max_batch_cost":
            changes[key] = rng.choice([None, 3.0, 5.0])
        elif key == "oom_recovery_s":
            changes[key] = rng.choice([0.0, 0.01, 1.0])
        else:
            changes[rng.choice(["max_batch_size", "max_delay_s", "default_class"])] = -1
    return changes


def _check_update(batcher: Batcher, changes: dict[str, Any]) -> None:
    before = batcher.policy
    try:
        new = batcher.update_policy(**changes)
    except ConfigError as error:
        assert batcher.policy is before, f"a refused update {changes} changed the policy"
        # The field named is one changed, or one the change contradicts.
        related = {*changes, "preferred_batch_sizes", "default_class", "classes", "policy"}
        assert error.field.split("[")[0] in related, error.field
        return
    assert batcher.policy is new
    for name, value in changes.items():
        got = getattr(new, name)
        assert got == (tuple(sorted(set(value))) if name == "preferred_batch_sizes" else value)
    cap = batcher.effective_max_batch_size
    assert cap <= new.max_batch_size, f"effective max {cap} above max_batch_size"


def _check_answer(model: CheckingModel, sent: Sent) -> None:
    assert sent.task is not None and sent.task.done()
    policy, rid = sent.policy, sent.rid
    limits = policy.limits.get(sent.priority or policy.default_class)
    k = max(1, sent.num_items)
    must_refuse = (
        limits is None
        or k > limits.max_batch_size
        or (policy.max_batch_cost is not None and k > policy.max_batch_cost)
    )
    is_full = policy.max_queue_size is not None and sent.num_pending >= policy.max_queue_size
    if sent.task.cancelled():
        assert sent.was_cancelled
        assert model.ok_calls[rid] <= 1
        return
    error = sent.task.exception()
    if must_refuse:
        assert isinstance(error, InvalidInput), (rid, error)
        assert rid not in model.entered
    elif is_full:
        assert isinstance(error, QueueFull), (rid, error)
        assert rid not in model.entered
    elif error is not None:
        assert isinstance(error, DeadlineExceeded), (rid, repr(error))
        assert model.ok_calls[rid] == 0, f"request {rid} expired after it ran"
    else:
        expected = [(rid, j, "out") for j in range(sent.num_items)]
        assert sent.task.result() == (expected if sent.num_items else (rid, 0, "out"))
        assert model.ok_calls[rid] == 1, f"request {rid} ran {model.ok_calls[rid]} times"


@pytest.mark.parametrize("seed", range(6))
async def test_random_policy_updates_under_load_keep_every_rule(seed, loop_errors):
    rng = random.Random(seed)
    clock = FakeClock()
    model = CheckingModel(clock, rng)
    model.gate.set()
    policy = BatchPolicy(max_batch_size=4, max_delay_s=0.002, classes=CLASS_SETS[0])
    batcher = Batcher(
        model, policy, collate="list", clock=clock, num_replicas=NUM_REPLICAS, name="m"
    )
    model.batcher = batcher
    await batcher.start()
    sent: list[Sent] = []
    try:
        for _ in range(300):
            roll = rng.random()
            if roll < 0.5:
                for _ in range(rng.randint(1, 4)):  # a burst
                    names = [c.name for c in batcher.policy.classes]
                    priority = rng.choice(PRIORITIES if rng.random() < 0.2 else [None, *names])
                    item = Sent(len(sent), rng.choice([0, 0, 0, 1, 2, 3, 5]), priority, policy, 0)
                    timeout_s = rng.choice([None, None, 0.004, 0.03])
                    item.task = asyncio.ensure_future(_client(batcher, model, item, timeout_s))
                    sent.append(item)
            elif roll < 0.6 and sent:
                victim = rng.choice(sent[-10:])
                if victim.task is not None and not victim.task.done():
                    victim.was_cancelled = True
                    victim.task.cancel()
            elif roll < 0.75:
                _check_update(batcher, _random_changes(rng, batcher.policy))
            else:
                await clock.advance(rng.choice([0.0, 0.0005, 0.002, 0.01]))
            await asyncio.sleep(0)
        for _ in range(200):  # load stops: everything accepted is answered
            if all(s.task is not None and s.task.done() for s in sent):
                break
            await clock.advance(0.01)
        assert not model.problems, model.problems[:5]
        for item in sent:
            _check_answer(model, item)
        assert batcher.num_pending == 0
        await _check_every_class_gets_its_share(batcher, model)
    finally:
        model.gate.set()
        await asyncio.wait_for(batcher.stop(drain=True), SAFETY_S)
    assert not loop_errors
    answered = [s for s in sent if s.task is not None and not s.task.cancelled()]
    assert sum(1 for s in answered if s.task and s.task.exception() is None) > 20


async def _check_every_class_gets_its_share(batcher: Batcher, model: CheckingModel) -> None:
    """With every replica free, each class leads exactly ``share_cap`` batches at once."""
    model.oom = False
    batcher.update_policy(
        max_batch_size=1, max_delay_s=0.0, preferred_batch_sizes=(), max_queue_size=None,
        max_batch_cost=None, fill_from_lower=False, timeout_s=None,
    )  # fmt: skip
    policy = batcher.policy
    for rank, c in enumerate(policy.classes):
        model.gate.clear()
        tasks = []
        for i in range(NUM_REPLICAS):
            item = Sent(10_000 + 10 * rank + i, 0, c.name, policy, 0)
            item.task = asyncio.ensure_future(_client(batcher, model, item, None))
            tasks.append(item.task)
        await settle()
        expected = share_cap(policy.limits[c.name].share, NUM_REPLICAS)
        assert model.running_by_lead[c.name] == expected, (c.name, dict(model.running_by_lead))
        model.gate.set()
        await asyncio.wait_for(asyncio.gather(*tasks), SAFETY_S)


# -- one edge at a time ---------------------------------------------------------------------


class ListModel:
    """An async model that records each batch and can be held mid-batch."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.oom_above: int | None = None

    async def __call__(self, batch: list[Any]) -> list[Any]:
        self.batches.append(list(batch))
        await self.gate.wait()
        if self.oom_above is not None and len(batch) > self.oom_above:
            raise MemoryError(f"a batch of {len(batch)}")
        return [x * 10 for x in batch]


def make(model: Any, clock: FakeClock, **policy: Any) -> Batcher:
    return Batcher(model, BatchPolicy(**policy), collate="list", clock=clock)


async def wait_all(*tasks: asyncio.Future[Any]) -> list[Any]:
    return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), SAFETY_S)


@pytest.mark.parametrize("value", ["no", 0, 1, None])
async def test_fill_from_lower_that_is_not_a_bool_is_refused_naming_it(value):
    """Every field is validated (docs/core.md): ``"no"`` is truthy, and a POST of
    ``{"fill_from_lower": "no"}`` used to be taken as True and shown back as "no"."""
    with pytest.raises(ConfigError, match="fill_from_lower"):
        BatchPolicy(fill_from_lower=value)
    batcher = make(ListModel(), FakeClock(), max_delay_s=0.0)
    before = batcher.policy
    with pytest.raises(ConfigError, match="fill_from_lower") as caught:
        batcher.update_policy(fill_from_lower=value)
    assert caught.value.field == "fill_from_lower"
    assert batcher.policy is before


async def test_max_batch_tokens_is_refused_before_auto_has_chosen_a_collator():
    """``collate="auto"`` never picks a length-measuring collator. An update (or a
    constructor) with ``max_batch_tokens`` before the first request used to be accepted,
    and then every request failed with ConfigError; after the first one, refused."""
    with pytest.raises(ConfigError, match="max_batch_tokens"):
        Batcher(lambda xs: xs, BatchPolicy(max_batch_tokens=8))
    batcher = Batcher(lambda xs: xs, BatchPolicy(max_delay_s=0.0), clock=FakeClock())
    async with batcher:
        before = batcher.policy
        with pytest.raises(ConfigError, match="max_batch_tokens"):
            batcher.update_policy(max_batch_tokens=8)
        assert batcher.policy is before
        assert await asyncio.wait_for(batcher.submit(3), SAFETY_S) == 3


async def test_effective_max_batch_size_never_exceeds_a_lowered_max_batch_size():
    clock = FakeClock()
    model = ListModel()
    model.oom_above = 6
    batcher = make(model, clock, max_batch_size=16, max_delay_s=0.0)
    async with batcher:
        model.gate.clear()
        first = asyncio.ensure_future(batcher.submit(0))
        await settle()
        rest = [asyncio.ensure_future(batcher.submit(i)) for i in range(1, 13)]
        await settle()
        model.gate.set()
        assert await wait_all(first, *rest) == [i * 10 for i in range(13)]
        assert batcher.effective_max_batch_size == 6  # half of the batch of 12 that ran out

        batcher.update_policy(max_batch_size=2)
        assert batcher.effective_max_batch_size == 2
        batcher.update_policy(max_batch_size=16)
        assert batcher.effective_max_batch_size == 6  # the memory evidence still stands


async def test_removing_a_class_with_queued_requests_is_refused_and_they_still_run():
    clock = FakeClock()
    model = ListModel()
    batcher = make(model, clock, max_batch_size=4, max_delay_s=1.0)
    async with batcher:
        queued = [asyncio.ensure_future(batcher.submit(i, priority="background")) for i in (1, 2)]
        await settle()
        before = batcher.policy
        with pytest.raises(ConfigError, match="background") as caught:
            batcher.update_policy(classes=before.classes[:2])
        assert caught.value.field == "classes"
        assert batcher.policy is before
        await clock.advance(1.0)
        assert await wait_all(*queued) == [10, 20]
        assert batcher.snapshot().classes["background"].num_completed == 2
        batcher.update_policy(classes=before.classes[:2])  # empty now: it may go
        with pytest.raises(InvalidInput, match="background"):
            await batcher.submit(3, priority="background")


async def test_raising_max_delay_while_a_replica_waits_holds_the_batch_to_the_new_delay():
    """The delay counts from the oldest request's arrival under the policy in force: a
    replica that armed its timer for the old delay looks again and waits for the new one."""
    clock = FakeClock()
    model = ListModel()
    batcher = make(model, clock, max_batch_size=8, max_delay_s=0.010)
    async with batcher:
        first = asyncio.ensure_future(batcher.submit(1))
        await clock.advance(0.004)
        batcher.update_policy(max_delay_s=0.030)
        await clock.advance(0.010)  # 14 ms after the first arrival: the old delay is gone
        assert model.batches == []
        second = asyncio.ensure_future(batcher.submit(2))
        await clock.advance(0.0159)
        assert model.batches == []
        await clock.advance(0.0002)  # 30 ms after the first request arrived
        assert model.batches == [[1, 2]]
        assert await wait_all(first, second) == [10, 20]


async def test_lowering_max_queue_size_below_the_queue_keeps_every_queued_request():
    clock = FakeClock()
    model = ListModel()
    batcher = make(model, clock, max_batch_size=2, max_delay_s=0.0)
    async with batcher:
        model.gate.clear()
        queued = [asyncio.ensure_future(batcher.submit(i)) for i in range(7)]
        await settle()
        assert batcher.num_pending == 5  # 2 run, 5 wait
        batcher.update_policy(max_queue_size=2)
        with pytest.raises(QueueFull):
            await batcher.submit(99)
        model.gate.set()
        assert await wait_all(*queued) == [i * 10 for i in range(7)]
        assert await asyncio.wait_for(batcher.submit(8), SAFETY_S) == 80
        snapshot = batcher.snapshot()
        assert snapshot.classes["normal"].rejections["queue_full"] == 1
        assert snapshot.num_pending == 0


async def test_queued_requests_keep_the_deadline_of_the_policy_they_were_admitted_under():
    clock = FakeClock()
    model = ListModel()
    batcher = make(model, clock, max_batch_size=4, max_delay_s=1.0, timeout_s=0.5)
    async with batcher:
        old = asyncio.ensure_future(batcher.submit(1))
        await settle()
        batcher.update_policy(timeout_s=None)
        new = asyncio.ensure_future(batcher.submit(2))
        await clock.advance(0.6)
        assert old.done() and isinstance(old.exception(), DeadlineExceeded)
        assert not new.done()
        await clock.advance(0.5)
        assert new.result() == 20
        assert model.batches == [[2]]


async def test_lowering_max_batch_tokens_below_a_queued_packed_request_runs_it_alone():
    clock = FakeClock()
    seen: list[list[int]] = []
    gate = asyncio.Event()

    async def model(batch: Any) -> Any:
        seen.append([int(n) for n in batch.lengths])
        await gate.wait()
        return np.add.reduceat(batch.data, batch.offsets)

    batcher = Batcher(
        model,
        BatchPolicy(max_batch_size=8, max_delay_s=0.0, max_batch_tokens=16),
        collate="packed",
        clock=clock,
    )
    async with batcher:
        blocker = asyncio.ensure_future(batcher.submit(np.ones(1, dtype=np.int64)))
        await settle()
        lengths = [6, 2, 2, 5]
        queued = [
            asyncio.ensure_future(batcher.submit(np.ones(n, dtype=np.int64))) for n in lengths
        ]
        await settle()
        batcher.update_policy(max_batch_tokens=4)
        with pytest.raises(InvalidInput, match="max_batch_tokens=4"):
            await batcher.submit(np.ones(5, dtype=np.int64))
        gate.set()
        assert await wait_all(blocker, *queued) == [1, *lengths]
        assert seen == [[1], [6], [2, 2], [5]]


async def test_update_policy_refuses_max_batch_tokens_the_collator_cannot_measure():
    """Building a batcher with max_batch_tokens and a NumPy collator is a ConfigError;
    update_policy ("validated first") accepts the same setting and then ignores it."""
    with pytest.raises(ConfigError, match="max_batch_tokens"):
        Batcher(lambda b: b, BatchPolicy(max_batch_tokens=8), collate="numpy")

    batcher = Batcher(lambda b: b, BatchPolicy(), collate="numpy", clock=FakeClock())
    with pytest.raises(ConfigError, match="max_batch_tokens"):
        batcher.update_policy(max_batch_tokens=8)


async def test_class_removed_and_restored_while_its_batch_runs_keeps_its_share_cap(
    fake_clock, fake_model, spawn
):
    classes = (
        ClassPolicy("interactive"),
        ClassPolicy("normal"),
        ClassPolicy("background", share=0.5),  # one of two replicas
    )
    batcher = Batcher(
        fake_model,
        BatchPolicy(max_batch_size=1, max_delay_s=0.0, classes=classes),
        clock=fake_clock,
        num_replicas=2,
    )
    await batcher.start()
    try:
        fake_model.hold()
        first = spawn(batcher.submit(1, priority="background"))
        await settle()
        assert fake_model.running == 1

        batcher.update_policy(classes=classes[:2])  # no background request is queued
        batcher.update_policy(classes=classes)

        second = spawn(batcher.submit(2, priority="background"))
        await settle()
        assert fake_model.running == 1, "background now leads batches on both replicas"
    finally:
        fake_model.release()
        await asyncio.wait_for(batcher.stop(drain=True), SAFETY_S)
    assert [first.result(), second.result()] == [10, 20]


# -- each update on its own --------------------------------------------------------------------


async def test_policy_check_refuses_a_policy_at_construction_and_on_update() -> None:
    def at_most_eight(policy: BatchPolicy) -> None:
        if policy.max_batch_size > 8:
            raise ConfigError("max_batch_size", policy.max_batch_size, "8 or less")

    with pytest.raises(ConfigError, match="8 or less"):
        Batcher(lambda xs: xs, BatchPolicy(max_batch_size=9), policy_check=at_most_eight)
    batcher = Batcher(lambda xs: xs, BatchPolicy(max_batch_size=4), policy_check=at_most_eight)
    async with batcher:
        with pytest.raises(ConfigError, match="8 or less"):
            batcher.update_policy(max_batch_size=16)
        assert batcher.policy.max_batch_size == 4  # unchanged
        assert batcher.update_policy(max_batch_size=8).max_batch_size == 8


async def test_update_policy_takes_effect_for_the_next_batch(
    make_batcher, fake_model, fake_clock, spawn
):
    batcher = make_batcher(max_batch_size=2, max_delay_s=0.0)
    await occupy(batcher, fake_model, spawn, fake_clock)
    for i in range(4):
        spawn(batcher.submit(i))
    await settle()

    new = batcher.update_policy(max_batch_size=4)
    fake_model.release()
    await settle()

    assert new.max_batch_size == 4
    assert batcher.policy is new
    assert fake_model.batches[1:] == [[0, 1, 2, 3]]


async def test_update_policy_shortening_max_delay_releases_a_waiting_batch(
    make_batcher, fake_model, spawn
):
    batcher = make_batcher(max_delay_s=10.0)
    task = spawn(batcher.submit(1))
    await settle()
    assert fake_model.batches == []

    batcher.update_policy(max_delay_s=0.0)
    await settle()

    assert fake_model.batches == [[1]]
    assert task.result() == 10


async def test_update_policy_below_a_queued_requests_size_still_runs_it(
    make_batcher, fake_model, fake_clock, spawn
):
    batcher = make_batcher(max_batch_size=4, max_delay_s=0.0)
    await occupy(batcher, fake_model, spawn, fake_clock)
    many = spawn(batcher.submit_many([1, 2, 3, 4]))
    await settle()

    batcher.update_policy(max_batch_size=2)
    fake_model.release()
    await settle()
    assert many.result() == [10, 20, 30, 40]

    singles = [spawn(batcher.submit(i)) for i in (5, 6, 7)]
    await fake_clock.advance(0.0)
    assert [t.result() for t in singles] == [50, 60, 70]
    assert fake_model.batches[1:] == [[1, 2, 3, 4], [5, 6], [7]]


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_delay_s": -1.0}, "max_delay_s"),
        ({"preferred_batch_sizes": (64,)}, "preferred_batch_sizes"),
        ({"max_queue_size": 0}, "max_queue_size"),
        ({"bogus": 1}, "policy"),
    ],
)
async def test_invalid_policy_update_raises_config_error_naming_the_field(
    make_batcher, changes, field
):
    batcher = make_batcher(max_delay_s=0.0)
    await batcher.start()
    before = batcher.policy

    with pytest.raises(ConfigError) as caught:
        batcher.update_policy(**changes)

    assert caught.value.field == field
    assert field in str(caught.value)
    assert batcher.policy is before
    assert await batcher.submit(1) == 10


def _double(batch: Any) -> Any:
    return batch * 2


def test_set_policy_refuses_what_is_not_a_batch_policy() -> None:
    batcher = Batcher(_double, clock=FakeClock())
    with pytest.raises(ConfigError) as caught:
        batcher.set_policy({"max_batch_size": 8})  # type: ignore[arg-type]
    assert caught.value.field == "policy"
    assert batcher.policy.max_batch_size == 32  # unchanged


async def test_a_new_budget_unit_starts_the_adaptive_line_and_rates_afresh():
    """Was: a line fitted per unit of cost was read per item after max_batch_cost went
    (0.01 ms an item where the model takes 1 ms), and one batch of 200 ran 200 ms under a
    50 ms SLO; the rates, in the old unit, stayed too."""
    policy = BatchPolicy(
        max_delay_s="auto",
        max_batch_size="auto",
        slo_s=0.05,
        max_batch_cost=5000.0,
        cost_fn=lambda item: 100.0,
    )
    async with Batcher(lambda batch: batch, policy, collate="list") as batcher:
        for size in (1, 2, 4, 8, 16) * 2:
            await asyncio.gather(*(batcher.submit(i) for i in range(size)))
        before = batcher.adaptive_state()
        assert before is not None and before.unit == "cost" and before.num_batches > 0
        batcher.update_policy(max_batch_cost=None, cost_fn=None)
        after = batcher.adaptive_state()
        assert after is not None and after.unit == "items"
        assert (after.num_batches, after.per_item_s) == (0, 0.0)
        assert all(c.arrival_rate_rps == 0.0 for c in after.classes)
        assert await batcher.submit(7) == 7


async def test_batches_formed_in_the_old_unit_are_not_fitted_after_it_changed():
    """Batches still running when the unit changes land after the line started afresh:
    their size in cost was fitted as items (each 200 ms batch read as 1000 items)."""
    release = asyncio.Event()

    async def model(batch: list[int]) -> list[int]:
        await release.wait()
        return batch

    policy = BatchPolicy(
        max_delay_s="auto", max_batch_size="auto", slo_s=0.05, max_batch_cost=1000.0,
        cost_fn=lambda item: 100.0,
    )  # fmt: skip
    async with Batcher(model, policy, collate="list", num_replicas=3) as batcher:
        running = [asyncio.ensure_future(batcher.submit(i)) for i in range(30)]
        await settle()
        batcher.update_policy(max_batch_cost=None, cost_fn=None)
        release.set()
        await asyncio.gather(*running)
        state = batcher.adaptive_state()
        assert state is not None and state.unit == "items" and state.num_batches == 0
