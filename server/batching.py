"""Continuous batching: every forward the server runs goes through one thread that gathers the work waiting.

Calls (a Verify's tree, a prompt piece of an OpenSession, a decode step of the streaming API) hand their
``Step`` (``shared.target``) to ``Batcher.run`` and wait. The worker takes what is queued — up to
``max_batch`` steps and ``max_tokens`` tokens, waiting at most ``window_s`` for more once it has one —
and runs them as one ``forward_many`` (it waits only while fewer steps are gathered than sessions were
active in the last ``ACTIVE_S``: a lone client never waits): each step keeps its own cache, positions
and mask, the weights are read once for all. Then each step's ``finish`` (acceptance, cache moves) runs, in queue order.

A batch never mixes results: a step's rows do not depend on the others' (see ``forward_many``). A
failing forward is retried step by step, so a bad step fails alone. ``max_batch=1`` is the serial server.
Long prompts are cut into pieces (``--prefill-chunk``) that queue behind the steps already waiting,
so a long prefill delays the others by a piece, not by the whole prompt.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from shared.engine import Transformer
from shared.target import Step

ACTIVE_S = 0.5  # a sequence with a step in the last half second is expected to send another soon


@dataclass
class Work:
    step: Step
    future: Future = field(default_factory=Future)


class Batcher:
    def __init__(self, engine: Transformer, max_batch: int = 16, max_tokens: int = 512, window_s: float = 0.002,
                 on_batch=None):  # fmt: skip
        """``on_batch(steps, tokens, seconds)`` is told of every forward (for the metrics)."""
        self.engine, self.max_batch, self.max_tokens, self.window_s = engine, max_batch, max_tokens, window_s
        self.on_batch = on_batch or (lambda steps, tokens, seconds: None)
        self._queue: queue.Queue[Work | None] = queue.Queue()
        self._carry: Work | None = None  # taken from the queue but left for the next batch (over the token cap)
        self._seen: dict[int, float] = {}  # cache id -> when a step of it last ran: who is active
        self._thread = threading.Thread(target=self._work, daemon=True, name="splitspec-batcher")
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    def run(self, step: Step):
        """Run ``step`` in the next batch; its ``finish`` result, or the exception it raised."""
        work = Work(step)
        self._queue.put(work)
        return work.future.result()

    def close(self) -> None:
        self._queue.put(None)

    def _active(self) -> int:
        """Sequences (caches) that had a step run in the last ``ACTIVE_S``."""
        now = time.monotonic()
        self._seen = {k: t for k, t in self._seen.items() if now - t < ACTIVE_S}
        return len(self._seen)

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
                start = time.perf_counter()
                self._seen.update({id(w.step.part.cache): time.monotonic() for w in batch})
                try:
                    hidden = self.engine.forward_many([w.step.part for w in batch])
                except Exception as exc:
                    if len(batch) == 1:
                        batch[0].future.set_exception(exc)
                        continue
                    hidden = [None] * len(batch)  # retried alone below: the failing step fails by itself
                self.on_batch(len(batch), sum(len(w.step.part.ids) for w in batch), time.perf_counter() - start)
                for work, h in zip(batch, hidden, strict=True):
                    try:
                        if h is None:
                            h = self.engine.forward_many([work.step.part])[0]
                        work.future.set_result(work.step.finish(h))
                    except Exception as exc:
                        work.future.set_exception(exc)

