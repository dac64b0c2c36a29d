"""Waiting queues for the two scheduling policies.

FCFS: arrival order; a preempted request goes back to the head.

Priority: lower `priority` is more urgent; ties go to the earlier arrival. Aging keeps a
low-priority request from starving: its effective priority improves by one level for every
`aging_seconds` it has waited, i.e. effective = priority - (now - arrival) / aging_seconds. Between
two waiting requests the `now` terms cancel, so the order is the static key
priority + arrival / aging_seconds, and a heap keeps it. A batch request (priority 1) that arrived
more than `aging_seconds` before an interactive one (priority 0) therefore goes first.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from llmserve.request import Request


class FCFSQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    def __init__(self, aging_seconds: float) -> None:
        self.aging_seconds = aging_seconds
        self._heap: list[tuple[float, int, Request]] = []
        self._tiebreak = itertools.count()

    def key(self, request: Request) -> float:
        """Smaller is more urgent."""
        return request.priority + request.arrival_time / self.aging_seconds

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (self.key(request), next(self._tiebreak), request))

    add_preempted = add  # its early arrival already puts it ahead of later requests of its priority

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[2] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[2] for entry in sorted(self._heap, key=lambda e: e[:2]))


def create_request_queue(policy: str, aging_seconds: float) -> FCFSQueue | PriorityQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue(aging_seconds)
    raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {policy!r}")
