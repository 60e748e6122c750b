"""Request timelines (``GET /v2/timelines``, :mod:`carpool.server.timelines`) as Chrome
trace-event JSON, the format Perfetto (ui.perfetto.dev) and chrome://tracing open.

One process per model; in it one track per replica, whose slices are the batches it ran
(a generation model: one track of its engine's steps, the forward passes), and request
lanes: each request one slice from arrival to answer, over its stages as nested slices
(queue, fill wait, replica wait, compute, answer; a generation request: queue, then
prefill and each decode step), on the first lane free at its arrival, so slices on a
lane never overlap. A flow arrow joins each request to the batch (or first step) that
carried it::

    model mlp (pid 1)
      replica 0   |==batch 8==|     |==batch 3==|          tid 1 + replica id
      requests 0  |queue|fill|rw|compute|answer|           tid 1000 + lane
                     \\____________ flow ___^ (to its batch slice)

Times are microseconds from the first event captured.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

REPLICA_TID = 1  # replica r is thread 1 + r
LANE_TID = 1000  # request lane k is thread 1000 + k
_US = 1e6


@dataclass(frozen=True, slots=True)
class Timeline:
    """One request's moments (seconds on the server's clock; None: never reached)."""

    model: str
    request_id: int
    class_name: str
    outcome: str
    num_items: int
    batch_size: int
    replica_id: int
    fill_wait_s: float
    arrived_s: float
    batch_closed_s: float | None
    compute_started_s: float | None
    compute_ended_s: float | None
    answered_s: float

    @classmethod
    def from_dict(cls, document: dict[str, Any]) -> Timeline:
        """A timeline of the server's JSON. Raises KeyError or TypeError when malformed."""
        return cls(
            model=str(document["model"]),
            request_id=int(document["request_id"]),
            class_name=str(document["class_name"]),
            outcome=str(document["outcome"]),
            num_items=int(document["num_items"]),
            batch_size=int(document["batch_size"]),
            replica_id=int(document["replica_id"]),
            fill_wait_s=float(document["fill_wait_s"] or 0.0),
            arrived_s=float(document["arrived_s"]),
            batch_closed_s=_optional(document["batch_closed_s"]),
            compute_started_s=_optional(document["compute_started_s"]),
            compute_ended_s=_optional(document["compute_ended_s"]),
            answered_s=float(document["answered_s"]),
        )

    @property
    def has_run(self) -> bool:
        return self.compute_started_s is not None and self.compute_ended_s is not None

    def flow_target(self) -> tuple[int, float] | None:
        """The track and time its flow arrow ends at: its batch's start on its replica."""
        if self.compute_started_s is None:
            return None
        return REPLICA_TID + self.replica_id, self.compute_started_s

    def args(self) -> dict[str, Any]:
        return {"class": self.class_name, "outcome": self.outcome, "num_items": self.num_items}

    def stages(self) -> list[tuple[str, float, float]]:
        """(name, start, end) of each stage it went through, in order."""
        closed = self.batch_closed_s
        if closed is None:  # left before a batch took it (expired, cancelled)
            return [("queue", self.arrived_s, self.answered_s)]
        fill_from = max(self.arrived_s, closed - self.fill_wait_s)
        stages = [("queue", self.arrived_s, fill_from), ("fill wait", fill_from, closed)]
        if self.compute_started_s is not None and self.compute_ended_s is not None:
            stages += [
                ("replica wait", closed, self.compute_started_s),
                ("compute", self.compute_started_s, self.compute_ended_s),
                ("answer", self.compute_ended_s, self.answered_s),
            ]
        else:
            stages.append(("answer", closed, self.answered_s))
        return [(name, start, end) for name, start, end in stages if end > start]


@dataclass(frozen=True, slots=True)
class GenerationTimeline:
    """One generation request: its moments and the forward passes (steps) it was in."""

    model: str
    request_id: int
    class_name: str
    outcome: str
    num_prompt_tokens: int
    num_generated: int
    arrived_s: float
    scheduled_s: float | None
    answered_s: float
    steps: tuple[tuple[float, float], ...]

    @classmethod
    def from_dict(cls, document: dict[str, Any]) -> GenerationTimeline:
        """A timeline of the server's JSON. Raises KeyError or TypeError when malformed."""
        return cls(
            model=str(document["model"]),
            request_id=int(document["request_id"]),
            class_name=str(document["class_name"]),
            outcome=str(document["outcome"]),
            num_prompt_tokens=int(document["num_prompt_tokens"]),
            num_generated=int(document["num_generated"]),
            arrived_s=float(document["arrived_s"]),
            scheduled_s=_optional(document["scheduled_s"]),
            answered_s=float(document["answered_s"]),
            steps=tuple((float(a), float(b)) for a, b in document["steps"]),
        )

    def stages(self) -> list[tuple[str, float, float]]:
        """Its wait for a first step, then each step it was in: prefill, then decodes."""
        stages = [("queue", self.arrived_s, self.scheduled_s or self.answered_s)]
        stages += [
            ("prefill" if number == 0 else "decode", start, end)
            for number, (start, end) in enumerate(self.steps)
        ]
        return [(name, start, end) for name, start, end in stages if end > start]

    def flow_target(self) -> tuple[int, float] | None:
        """Its first step, on the engine's track."""
        return (REPLICA_TID, self.steps[0][0]) if self.steps else None

    def args(self) -> dict[str, Any]:
        return {
            "class": self.class_name,
            "outcome": self.outcome,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated": self.num_generated,
            "num_steps": len(self.steps),
        }


AnyTimeline = Timeline | GenerationTimeline


def timeline_from_dict(document: dict[str, Any]) -> AnyTimeline:
    """A batched or a generation request's timeline, as its ``kind`` says."""
    if document.get("kind") == "generation":
        return GenerationTimeline.from_dict(document)
    return Timeline.from_dict(document)


def _optional(value: Any) -> float | None:
    return None if value is None else float(value)


def chrome_trace(timelines: Iterable[AnyTimeline], *, metadata: dict[str, Any]) -> dict[str, Any]:
    """The trace-event document (JSON object form) of ``timelines``."""
    ordered = sorted(timelines, key=lambda t: (t.model, t.arrived_s))
    origin_s = min((t.arrived_s for t in ordered), default=0.0)

    def us(seconds: float) -> float:
        return round((seconds - origin_s) * _US, 3)

    events: list[dict[str, Any]] = []
    pids = {model: number for number, model in enumerate(sorted({t.model for t in ordered}), 1)}
    for model, pid in pids.items():
        events.append(_meta("process_name", pid, 0, f"model {model}"))
        mine = [t for t in ordered if t.model == model]
        events += _batch_events([t for t in mine if isinstance(t, Timeline)], pid, us)
        events += _step_events([t for t in mine if isinstance(t, GenerationTimeline)], pid, us)
        events += _request_events(mine, pid, us)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": metadata}


def _meta(name: str, pid: int, tid: int, value: str) -> dict[str, Any]:
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "args": {"name": value}}


def _batch_events(timelines: list[Timeline], pid: int, us: Any) -> list[dict[str, Any]]:
    batches: dict[tuple[int, float], list[Timeline]] = {}
    for t in timelines:
        if t.has_run:  # a batch's requests share its replica and compute start
            assert t.compute_started_s is not None
            batches.setdefault((t.replica_id, t.compute_started_s), []).append(t)
    replicas = sorted({replica for replica, _ in batches})
    events = [_meta("thread_name", pid, REPLICA_TID + r, f"replica {r}") for r in replicas]
    for (replica, started_s), members in sorted(batches.items()):
        ended_s = max(t.compute_ended_s or started_s for t in members)
        events.append(
            {
                "ph": "X",
                "cat": "batch",
                "name": f"batch of {len(members)}",
                "pid": pid,
                "tid": REPLICA_TID + replica,
                "ts": us(started_s),
                "dur": max(round((ended_s - started_s) * _US, 3), 1.0),
                "args": {
                    "num_requests": len(members),
                    "num_items": sum(t.num_items for t in members),
                    "request_ids": [t.request_id for t in members],
                },
            }
        )
    return events


def _step_events(timelines: list[GenerationTimeline], pid: int, us: Any) -> list[dict[str, Any]]:
    """A generation engine's forward passes, each one slice on its track."""
    steps: dict[float, list[int]] = {}
    ends: dict[float, float] = {}
    for t in timelines:
        for start_s, end_s in t.steps:  # the sequences of one step share its times
            steps.setdefault(start_s, []).append(t.request_id)
            ends[start_s] = end_s
    if not steps:
        return []
    events = [_meta("thread_name", pid, REPLICA_TID, "engine steps")]
    for start_s, members in sorted(steps.items()):
        events.append(
            {
                "ph": "X",
                "cat": "step",
                "name": f"step of {len(members)}",
                "pid": pid,
                "tid": REPLICA_TID,
                "ts": us(start_s),
                "dur": max(round((ends[start_s] - start_s) * _US, 3), 1.0),
                "args": {"num_sequences": len(members), "request_ids": members},
            }
        )
    return events


def _request_events(timelines: list[AnyTimeline], pid: int, us: Any) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    free: list[tuple[float, int]] = []  # (end of its last request, lane), a heap
    num_lanes = 0
    for t in timelines:  # by arrival
        if free and free[0][0] <= t.arrived_s:
            _, lane = heapq.heappop(free)
        else:
            lane, num_lanes = num_lanes, num_lanes + 1
            events.append(_meta("thread_name", pid, LANE_TID + lane, f"requests {lane}"))
        heapq.heappush(free, (t.answered_s, lane))
        tid = LANE_TID + lane
        stages = t.stages()
        events.append(
            {
                "ph": "X",
                "cat": "request",
                "name": f"request {t.request_id}",
                "pid": pid,
                "tid": tid,
                "ts": us(t.arrived_s),
                "dur": max(round((t.answered_s - t.arrived_s) * _US, 3), 1.0),
                "args": {**t.args(), **_stage_ms(stages)},
            }
        )
        for name, start_s, end_s in stages:
            events.append(
                {
                    "ph": "X",
                    "cat": "stage",
                    "name": name,
                    "pid": pid,
                    "tid": tid,
                    "ts": us(start_s),
                    "dur": round(us(end_s) - us(start_s), 3),  # ends where the next starts
                }
            )
        target = t.flow_target()
        if target is not None:
            events += _flow(t, pid, tid, target, us)
    return events


def _stage_ms(stages: list[tuple[str, float, float]]) -> dict[str, float]:
    """Each stage's milliseconds; a generation request's steps summed as one."""
    out: dict[str, float] = {}
    for name, start_s, end_s in stages:
        key = f"{name.replace(' ', '_')}_ms"
        out[key] = out.get(key, 0.0) + (end_s - start_s) * 1e3
    return out


def _flow(
    t: AnyTimeline, pid: int, tid: int, target: tuple[int, float], us: Any
) -> list[dict[str, Any]]:
    """An arrow from the request's slice (at its arrival) to the batch or step that ran
    it, each end just inside its slice's start so it binds to it (``bp: e``: the
    enclosing slice)."""
    target_tid, target_s = target
    flow_id = f"{t.model}/{t.request_id}"
    common = {"cat": "flow", "name": "batched", "pid": pid, "id": flow_id}
    # Half a microsecond in: every slice lasts at least one (a batch, a step, a request).
    return [
        {**common, "ph": "s", "tid": tid, "ts": us(t.arrived_s) + 0.5},
        {**common, "ph": "f", "bp": "e", "tid": target_tid, "ts": us(target_s) + 0.5},
    ]
