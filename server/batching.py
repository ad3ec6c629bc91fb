"""Continuous batching: every forward the server runs goes through one thread that gathers the work waiting.

Calls (a Verify's tree, a prompt piece of an OpenSession, a decode step of the streaming API) hand their
``Step`` (``shared.engine.target``) to ``Batcher.run`` and wait. The worker takes what is queued — up to
``max_batch`` steps and ``max_tokens`` tokens, waiting at most ``window_s`` for more once it has one —
and runs them as one ``forward_many`` (it waits only while fewer steps are gathered than sessions were
active in the last ``ACTIVE_S``: a lone client never waits): each step keeps its own cache, positions
and mask, the weights are read once for all, the LM head's too (``head_logits``). Then each step's ``finish``
(acceptance, cache moves) runs, in queue order.

A batch never mixes results: a step's rows do not depend on the others' (see ``forward_many``). A
failing forward is retried step by step, so a bad step fails alone. ``max_batch=1`` is the serial server.
Long prompts are cut into pieces (``--prefill-chunk``) that queue behind the steps already waiting,
so a long prefill delays the others by a piece, not by the whole prompt.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from server.budget import Tree, TreeBudget
from shared.engine.decoder import Cache, Part, Transformer
from shared.engine.target import Step, Verdict, head_logits

log = logging.getLogger(__name__)
ACTIVE_S = 0.5  # a sequence with a step in the last half second is expected to send another soon
FORGET_S = 60.0  # a sequence's time away is forgotten after this long without a step
AWAY_WEIGHT = 0.3  # of the latest time away in its running average


class ShuttingDown(RuntimeError):
    """A forward asked for after the batcher was closed."""


@dataclass
class Work:
    step: Step
    future: Future = field(default_factory=Future)
    arrived: float = field(default_factory=time.monotonic)


def pairs(part: Part) -> int:
    """Query·key pairs a part's attention computes."""
    return len(part.ids) * (part.at + len(part.ids))


class Batcher:
    def __init__(self, engine: Transformer, max_batch: int = 16, max_tokens: int = 512, window_s: float = 0.002,
                 on_batch=None, budget: TreeBudget | None = None):  # fmt: skip
        """``on_batch(steps, tokens, seconds)`` is told of every forward (for the metrics); ``budget`` cuts trees
        (None: every node is verified)."""
        self.engine, self.max_batch, self.max_tokens, self.window_s = engine, max_batch, max_tokens, window_s
        self.budget = budget
        # the state below is keyed by a number each cache gets on its first step, never reused (an id() is, once
        # its object is gone: a new sequence would inherit a dead one's time away)
        self._keys: weakref.WeakKeyDictionary[Cache, int] = weakref.WeakKeyDictionary()  # while the cache lives
        self._next_key = itertools.count()
        self._done: dict[int, float] = {}  # cache key -> when its last step finished
        self._away: dict[int, float] = {}  # cache key -> running average of its time between steps
        self.on_batch = on_batch or (lambda steps, tokens, seconds: None)
        self._queue: queue.Queue[Work | None] = queue.Queue()
        self._carry: Work | None = None  # taken from the queue but left for the next batch (over the token cap)
        self._seen: dict[int, float] = {}  # cache key -> when a step of it last ran: who is active
        self._ended: list[int] = []  # cache keys of sequences that ended (appended by any thread, read by the worker)
        self._closing = threading.Lock()  # a step is queued before close() drains the queue, or refused
        self._closed = False
        self._thread = threading.Thread(target=self._work, daemon=True, name="splitspec-batcher")
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    @property
    def sessions(self) -> int:
        """Sequences that had a step in the last ``ACTIVE_S`` (readable from any thread)."""
        now = time.monotonic()
        return sum(1 for t in list(self._seen.values()) if now - t < ACTIVE_S)

    def forget(self, cache) -> None:
        """The sequence of ``cache`` ended (closed, its stream over): it will send no more steps, so no forward should
        wait for one (a lone client's next generation would otherwise wait a window per step for ``ACTIVE_S``)."""
        key = self._keys.get(cache)
        if key is not None:  # (None: it never ran a step here, there is nothing to forget)
            self._ended.append(key)

    def run(self, step: Step):
        """Run ``step`` in the next batch; its ``finish`` result, or the exception it raised."""
        work = Work(step)
        with self._closing:
            if self._closed:
                raise ShuttingDown("the server is shutting down: no new forwards")
            self._queue.put(work)
        return work.future.result()

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish the forwards already queued, stop the worker (waiting up to ``timeout_s`` for it), and fail any
        step queued behind it, so that no caller waits on a worker that is gone and no thread is left inside a
        forward when the process exits (a daemon thread cut off in native code aborts the interpreter)."""
        with self._closing:
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout_s)
        while True:
            try:
                work = self._queue.get_nowait()
            except queue.Empty:
                return
            if work is not None:
                work.future.set_exception(ShuttingDown("the server is shutting down: the forward was not run"))

    @property
    def alive(self) -> bool:
        """Is the worker thread running (every forward waits on it)?"""
        return self._thread.is_alive()

    def _key(self, cache: Cache) -> int:
        """The cache's key in the batcher's state, given on its first step (worker thread only)."""
        key = self._keys.get(cache)
        if key is None:
            key = self._keys[cache] = next(self._next_key)
        return key

    def _active(self) -> int:
        """Sequences (caches) that had a step run in the last ``ACTIVE_S``."""
        now = time.monotonic()
        while self._ended:
            self._seen.pop(self._ended.pop(), None)
        self._seen = {k: t for k, t in self._seen.items() if now - t < ACTIVE_S}
        self._done = {k: t for k, t in self._done.items() if now - t < FORGET_S}
        self._away = {k: a for k, a in self._away.items() if k in self._done}
        return len(self._seen)

    def _cut(self, batch: list[Work]) -> None:
        """Cut the batch's trees to the length its budget chooses for this forward."""
        trees = [w for w in batch if w.step.cut is not None]
        if self.budget is None or not trees:
            return
        others = [w.step.part for w in batch if w.step.cut is None]
        k = self.budget.choose(
            [Tree(w.step.nodes, w.step.part.at, self._away.get(self._key(w.step.part.cache), 0.0)) for w in trees],
            sum(len(p.ids) for p in others), sum(pairs(p) for p in others))  # fmt: skip
        for w in trees:
            if k is not None and w.step.nodes > k:
                w.step = w.step.cut(k)

    def _arrive(self, work: Work) -> None:
        """Note how long the step's sequence was away since its last step (drafting, the network)."""
        key = self._key(work.step.part.cache)
        if key in self._done:
            away = max(0.0, work.arrived - self._done[key])
            before = self._away.get(key, away)
            self._away[key] = (1 - AWAY_WEIGHT) * before + AWAY_WEIGHT * away

    def _gather(self, first: Work) -> list[Work]:
        batch, tokens = [first], len(first.step.part.ids)
        deadline = time.monotonic() + self.window_s
        active = self._active()
        while len(batch) < self.max_batch:
            if len(batch) >= active and self._queue.empty():
                break  # nobody else is likely to come: do not wait
            try:
                work = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if work is None:
                self._queue.put(None)
                break
            if tokens + len(work.step.part.ids) > self.max_tokens:
                self._carry = work
                break
            batch.append(work)
            tokens += len(work.step.part.ids)
        return batch

    def _work(self) -> None:
        with torch.inference_mode():
            while True:
                first, self._carry = self._carry or self._queue.get(), None
                if first is None:
                    return
                batch = self._gather(first)
                for work in batch:
                    self._arrive(work)
                try:
                    self._cut(batch)
                except Exception:  # a cut only saves time: it never fails a forward
                    log.exception("could not cut the trees of a forward; verifying them whole")
                start = time.perf_counter()
                self._seen.update({self._key(w.step.part.cache): time.monotonic() for w in batch})
                try:
                    hidden = self.engine.forward_many([w.step.part for w in batch])
                except Exception as exc:
                    if len(batch) == 1:
                        batch[0].future.set_exception(exc)
                        continue
                    hidden = [None] * len(batch)  # retried alone below: the failing step fails by itself
                try:
                    firsts = head_logits(self.engine, [w.step for w in batch], hidden)
                except Exception:  # one head matmul only saves time: each step computes its own instead
                    log.exception("could not run the LM head for the whole batch; each step runs its own")
                    firsts = [None] * len(batch)
                seconds, tokens = time.perf_counter() - start, sum(len(w.step.part.ids) for w in batch)
                self.on_batch(len(batch), tokens, seconds)  # the forward's seconds, its LM head's included
                if self.budget is not None and hidden[0] is not None:
                    self.budget.observe_forward(tokens, sum(pairs(w.step.part) for w in batch), seconds)
                for work, h, first in zip(batch, hidden, firsts, strict=True):
                    try:
                        if h is None:
                            h = self.engine.forward_many([work.step.part])[0]
                        result = work.step.finish(h, first)
                    except Exception as exc:
                        work.future.set_exception(exc)
                        continue
                    self._done[self._key(work.step.part.cache)] = time.monotonic()
                    if self.budget is not None and isinstance(result, Verdict) and work.step.cut is not None:
                        self.budget.observe_path(result.verified_nodes, result.accepted)
                    work.future.set_result(result)
