"""Continuous batching across requests: one thread owns the engine and the target, and between steps it
admits waiting requests into free batch slots and retires finished or cancelled rows (vLLM v1's scheduler,
on specdec's `Engine.admit` / `step` / `retire`).

Requests arrive from any thread (the HTTP server's event loop) through `submit`; the engine thread calls
each request's `on_tokens` with the tokens a step committed for it and `on_done` once with the result (or
the exception that ended it). `cancel` marks a request; its row leaves the batch before the next step, so
a client that goes away stops costing target forwards within one step.

Greedy rows give exactly what they give alone, whatever runs beside them (the engine is lossless per row).
Sampled rows draw from their own generator, seeded per request, so they are distributed as the target's
whatever runs beside them; a seed repeats a reply exactly only under the same draft lengths (the adaptive
budget cuts drafts by batch size), as with OpenAI's API, best effort.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..engine import Engine
from ..generation import EngineResult, Row, StopChecker
from ..sampling import SamplingParams

log = logging.getLogger("specdec.serve")


@dataclass
class Request:
    """One generation asked of the scheduler. `prompt_ids` are checked by the caller (non-empty, shorter than
    the context window); the callbacks run on the engine thread and must not block."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    seed: int | None
    stop: list[str]
    on_tokens: Callable[[list[int]], None]
    on_done: Callable[[EngineResult | None, BaseException | None], None]
    submitted_at: float = field(default_factory=time.perf_counter)
    cancelled: bool = False  # set from any thread; read by the engine thread between steps


class QueueFull(Exception):
    """More requests wait than the scheduler was told to hold."""


class NotRunning(Exception):
    """The engine thread has stopped (or never started): nothing would answer the request."""


class Scheduler:
    """Runs `engine` on its own thread over the requests submitted to it, at most `batch_size` at a time."""

    def __init__(self, engine: Engine, batch_size: int, max_waiting: int = 256) -> None:
        self.engine = engine
        self.batch_size = batch_size if engine.target.can_batch else 1
        self.max_waiting = max_waiting
        self._incoming: deque[Request] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._ids = itertools.count()
        self.running = 0  # rows in the batch, for /metrics
        self.error: BaseException | None = None  # what stopped the thread, if anything did
        self._thread = threading.Thread(target=self._loop, name="specdec-engine", daemon=True)

    # -- any thread ------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def waiting(self) -> int:
        return len(self._incoming)

    def submit(self, request: Request) -> None:
        with self._wake:
            if self._stopping or not self._thread.is_alive():
                raise NotRunning("the engine thread is not running")
            if len(self._incoming) >= self.max_waiting:
                raise QueueFull(f"{len(self._incoming)} requests are already waiting")
            self._incoming.append(request)
            self._wake.notify()

    def cancel(self, request: Request) -> None:
        request.cancelled = True
        with self._wake:
            try:  # still waiting: it leaves the queue now (answered outside the lock)
                self._incoming.remove(request)
            except ValueError:
                request = None  # type: ignore[assignment]  # in the batch: its row leaves before the next step
            self._wake.notify()
        if request is not None:
            request.on_done(None, None)

    # -- the engine thread -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        engine, target = self.engine, self.engine.target
        self._joining: list[Row] = []  # rows being admitted (their proposers go back if admission fails)
        active: list[Row] = []
        owners: dict[int, Request] = {}  # row index -> request
        try:
            with target.lock.hold():
                target.reset()
                self._idle = engine.proposers(self.batch_size)
                while True:
                    joining = self._take(len(active))
                    if joining is None:
                        break
                    if joining:
                        self._guarded(lambda joining=joining: self._admit(joining, active, owners), active, owners)
                    elif active:
                        self._guarded(lambda: self._step(active, owners), active, owners)
                    self._guarded(lambda: self._finish(active, owners), active, owners)
                    self.running = len(active)
            self._answer_all(owners, RuntimeError("the server is shutting down"))
        except BaseException as exc:  # noqa: BLE001 - reported to every request left, then to /health
            self.error = exc
            log.exception("the engine thread stopped")
            self._answer_all(owners, exc)

    def _answer_all(self, owners: dict[int, Request], error: BaseException) -> None:
        """The thread is ending: no request may arrive after this, and every one held gets `error`."""
        with self._wake:
            self._stopping = True
            left = [*owners.values(), *self._incoming]
            self._incoming.clear()
        owners.clear()
        self.running = 0
        for request in left:
            request.on_done(None, error)

    def _take(self, active: int) -> list[Request] | None:
        """Requests to admit now (cancelled ones are answered and dropped); waits while nothing runs. None:
        stop."""
        with self._wake:
            while not self._stopping and not active and not self._incoming:
                self._wake.wait()
            if self._stopping:
                return None
            joining = []
            while self._incoming and active + len(joining) < self.batch_size:
                request = self._incoming.popleft()
                if request.cancelled:
                    request.on_done(None, None)
                else:
                    joining.append(request)
            return joining

    def _admit(self, joining: list[Request], active: list[Row], owners: dict[int, Request]) -> None:
        rows = []
        for request in joining:
            index = next(self._ids)
            owners[index] = request  # before the row is made: a failure below still answers the request
            rows.append(self._row(index, request))
        self._joining = rows
        self.engine.admit(rows, active, self._idle, self._deliver(owners))
        self._joining = []

    def _row(self, index: int, request: Request) -> Row:
        target = self.engine.target
        stops = StopChecker(target.eos_token_ids, request.stop, target.tokenizer)  # cheap: one per request
        prompt = torch.tensor(request.prompt_ids, dtype=torch.long, device=target.device)
        return self.engine.make_row(index, prompt, request.max_new_tokens, request.sampling, request.seed, stops)

    @staticmethod
    def _deliver(owners: dict[int, Request]) -> Callable[[int, list[int]], None]:
        def on_tokens(index: int, tokens: list[int]) -> None:
            if tokens:
                owners[index].on_tokens(tokens)

        return on_tokens

    def _step(self, active: list[Row], owners: dict[int, Request]) -> None:
        cancelled = False
        for row in active:
            if owners[row.index].cancelled and not row.finished:
                row.stopped, row.stop_reason, cancelled = True, "cancelled", True
        if cancelled:  # cancelled rows leave before the step, not after it
            self._finish(active, owners)
        if active:
            deliver = self._deliver(owners)
            for row, tokens in zip(active, self.engine.step(active), strict=True):
                deliver(row.index, tokens)

    def _finish(self, active: list[Row], owners: dict[int, Request]) -> None:
        """Finished rows leave the batch (their proposers wait for the next requests) and their requests get
        their results; when the batch empties, the cache starts afresh for the next requests."""
        done = [row for row in active if row.finished]
        if not done:
            return
        self.engine.retire(active, self._idle, last=True)  # all rows done: nothing to drop, the reset follows
        if not active:
            self.engine.target.reset()
        for row in done:
            owners.pop(row.index).on_done(row.result(self.engine.target.max_context), None)

    def _guarded(self, work: Callable[[], None], active: list[Row], owners: dict[int, Request]) -> None:
        """Run one admit, step or retirement; if it raises, the rows in the batch end with that error and the
        engine goes on with a fresh cache (a plugin's bug, or memory running out, ends the requests it touched,
        not the server)."""
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - reported to the requests that were in the batch
            log.exception("a decoding step failed; the requests in the batch end with its error")
            failed = [owners.pop(index) for index in list(owners)]
            for row in [*active, *self._joining]:
                if row.proposer is not None:
                    self._idle.append(row.proposer)
                    row.proposer = None
            active.clear()
            self._joining = []
            for request in failed:  # answered before the reset: a reset that raises stops the thread instead
                request.on_done(None, exc)
            self.engine.target.reset()
