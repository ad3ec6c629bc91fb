"""What the server decodes by itself: the stretch a Decode call streams (opening its session first when it carries
a prompt), decoding on for a client that left mid-call, and the API baseline's Complete stream.

A client that leaves (a cut link) does not stop a stretch: the tokens it asked for are the target's own whoever reads
them, so the session keeps them (``held_tokens``) and the client's next call takes them with no forward. Its own lookup
(``server.self_draft.SelfDraft``) may verify several tokens a step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator

import grpc

from server.batching import ShuttingDown
from server.refusals import Abort
from server.security import caller
from server.self_draft import SelfDraft
from shared.payload import PayloadSpec
from shared.tree import DraftTree
from shared.wire import splitspec_pb2 as pb

log = logging.getLogger("splitspec.server")


def held_tokens(session, length: int) -> list[int]:
    """The tokens the session holds past the client's committed ``length`` (0: unchecked, none): the target's own,
    which the client never received (a stream it left, a reply it lost). They are not rolled back: the call
    takes them first (``Verify``, ``Stretches.stream``)."""
    held = len(session.sequence.tokens)
    if length > held:  # a sequencer check: ABORTED, as gRPC says
        raise Abort(grpc.StatusCode.ABORTED,
                    f"client believes the session holds {length} tokens, the server holds {held}")  # fmt: skip
    return session.sequence.tokens[length:] if length else []


class Stretches:
    """The server's decoding alone, for one ``SplitSpecService`` (its sessions, limits, batcher and payloads)."""

    def __init__(self, service) -> None:
        self.service = service

    def stream(self, session, request, spec: PayloadSpec, stop: set[int], context):
        """The stream of a Decode call (``session`` None: open it first). Its steps run on a thread of their own
        (``steps``), which holds the session's lock from the first step to the last: a client that leaves
        mid-stream (a cut link) does not stop them, since the tokens it asked for are the target's own whoever reads
        them. They go on for at most ``keep_decoding`` tokens of its budget, or until another call for the session
        comes (``Session.wanted``) or it is closed; the client's next call takes them with no compute
        (``held_tokens``)."""
        start, prefilled = time.perf_counter(), None
        if session is None:
            session, prefilled = self.service.open_session(request.prompt_ids, request.sampling, spec, context)
        self.service.lock(session)
        try:
            held = held_tokens(session, request.length)
            session.verified = None  # no round a chained Verify may follow
            limit = self.service.limits.max_context
            if not held and len(session.sequence.tokens) + 1 > limit:
                raise Abort(grpc.StatusCode.OUT_OF_RANGE, f"the session's {len(session.sequence.tokens)} tokens fill "
                            f"the context limit of {limit}: nothing more to decode")  # fmt: skip
        except BaseException:
            session.release()
            raise
        chunks: queue.SimpleQueue = queue.SimpleQueue()

        def produce() -> None:
            try:
                for chunk in self.steps(session, request, spec, stop, held, (prefilled, start), context):
                    chunks.put(chunk)
            except BaseException as exc:  # noqa: BLE001 - the stream ends with it (its status), the server goes on
                chunks.put(exc)
            finally:
                session.release()
                chunks.put(None)

        threading.Thread(target=produce, name="splitspec-decode", daemon=True).start()
        return self._streamed(chunks)

    @staticmethod
    def _streamed(chunks: queue.SimpleQueue) -> Iterator[pb.DecodeChunk]:
        """What ``stream``'s thread makes, as the call's stream (an error it met ends the stream with it)."""
        while (chunk := chunks.get()) is not None:
            if isinstance(chunk, BaseException):
                raise chunk
            yield chunk

    def steps(self, session, request, spec: PayloadSpec, stop: set[int], held: list[int], prefilled, context):
        """Steps on the session, one token a chunk, the payload of the tokens cached since the last one every
        ``payload_every`` tokens and on the last chunk. ``held``: tokens the session holds past the client's length,
        streamed first without a forward. ``prefilled``: (the first token, when the call opened the session; the
        call's start) — that token is the first chunk, sent before the prompt's features, which go with the second.
        With ``request.self_draft`` a step may verify the server's own prompt-lookup draft (``SelfDraft``): several
        tokens. A client gone: see ``stream``."""
        sequence, every, budget = session.sequence, max(1, request.payload_every), request.max_new_tokens
        (first_token, start), held = prefilled, list(held)
        drafter = SelfDraft(sequence.tokens, request.self_draft, lambda: self.service.costs(len(sequence.tokens))) if (
            request.self_draft) else None  # fmt: skip
        at = len(sequence.tokens) - len(held) - (first_token is not None)  # the client's length before each chunk
        sent = max(0, at - 1) if first_token is None else request.payload_from  # cached tokens the client has
        produced, left_at = 0, None  # left_at: tokens produced when the client was found gone
        while True:
            first = produced == 0 and first_token is not None
            if not context.is_active():
                if first:  # the client never learnt the session's id
                    self.service.sessions.pop(session.id, reason="cancelled")
                    return
                left_at = produced if left_at is None else left_at
                if self._done_for(session) or produced - left_at >= self.service.limits.keep_decoding:
                    return
            try:
                if first:
                    tokens, compute_s = [first_token], time.perf_counter() - start
                elif held:
                    tokens, compute_s = held[: budget - produced], 0.0
                    tokens = tokens[: next((i + 1 for i, t in enumerate(tokens) if t in stop), len(tokens))]
                    held = held[len(tokens) :]
                else:
                    tokens, compute_s = self._step(session, drafter, budget - produced, stop)
                produced += len(tokens)
                full = at + len(tokens) + 1 > self.service.limits.max_context
                reason = ("stop" if tokens[-1] in stop else "length" if produced >= budget
                          else "context" if full else "")  # fmt: skip
                payload, cached = None, at + len(tokens) - 1
                if reason or (cached - sent >= every and not first):
                    payload, sent = self.service.payload(session, spec, sent, cached), cached
            except (Abort, ShuttingDown):
                raise
            except Exception:
                self.service.sessions.pop(session.id, reason="failed")  # a half-written cache is never served again
                raise
            for i, token in enumerate(tokens):  # a step's compute goes with its first token, its payload its last
                last = i == len(tokens) - 1
                told = first or (last and (payload is not None or reason))  # the load: now and then is enough
                yield pb.DecodeChunk(token=token, length=at + i + 1, compute_s=0.0 if i else compute_s,
                                     payload=payload if last else None, finish_reason=reason if last else "",
                                     load=self.service.load(len(sequence.tokens)) if told else None,
                                     session_id=session.id if first else "",
                                     reused_tokens=session.stats.reused_tokens if first else 0)  # fmt: skip
            at += len(tokens)
            if reason:
                return

    def _step(self, session, drafter: SelfDraft | None, budget: int, stop: set[int]) -> tuple[list[int], float]:
        """One forward of a Decode stream: its new tokens (at most ``budget``, none past a stop token; the session
        keeps only those) and its seconds."""
        sequence, m, start = session.sequence, self.service.metrics, time.perf_counter()
        room = min(budget, self.service.limits.max_context - len(sequence.tokens)) - 1  # drafted, besides the bonus
        tree = drafter.propose(room) if drafter is not None and room > 0 else DraftTree()
        verdict = sequence.verify(tree, self.service.batcher.run)  # (not the call's runner: a client gone goes on)
        session.keep_hidden(verdict)
        tokens = verdict.new_tokens
        end = next((i + 1 for i, t in enumerate(tokens) if t in stop), len(tokens))
        if end < len(tokens):  # a stop token inside an accepted draft: what follows it is not the answer
            session.truncate(len(sequence.tokens) - (len(tokens) - end))
            tokens = tokens[:end]
        if drafter is not None:
            drafter.observe(tokens)
        m.tokens_generated.inc(len(tokens))
        m.tokens_decoded.inc(len(tokens))
        session.stats.decoded += len(tokens)
        return tokens, time.perf_counter() - start

    def decode_on(self, session) -> bool:
        """A Verify whose client left while it ran (a cut link): the session's lock passes to a thread that decodes on
        as a stream whose client left does (``steps``) — the client's next call takes those tokens with no compute
        (``held_tokens``) — for at most ``keep_decoding`` tokens, until another call for the session comes
        (``Session.wanted``), it is closed, or an end-of-sequence token. False: nothing to decode (the lock stays)."""
        stop, tokens = set(self.service.target.eos_token_ids), session.sequence.tokens
        if tokens[-1] in stop or len(tokens) + 1 > self.service.limits.max_context:
            return False
        request = pb.DecodeRequest(session_id=session.id, max_new_tokens=self.service.limits.keep_decoding)

        class Gone:  # the call's client: gone
            @staticmethod
            def is_active() -> bool:
                return False

        def run() -> None:
            try:
                for _ in self.steps(session, request, PayloadSpec(), stop, [], (None, 0.0), Gone()):
                    pass  # nobody to send them to: the session keeps them
            except (Abort, ShuttingDown):
                pass
            except Exception:  # a bug, not the client's (``steps`` dropped the session): logged, the server goes on
                log.exception("decoding on for session %s failed", session.id[:8])
            finally:
                session.release()

        threading.Thread(target=run, name="splitspec-decode-on", daemon=True).start()
        return True

    def _done_for(self, session) -> bool:
        """Should decoding for a client that left stop? Another call for the session came, or it was closed."""
        return session.wanted.is_set() or not self.service.sessions.holds(session.id)

    def api(self, prompt, sampling, budget, stop, context):
        """One token per chunk, as an API streams; stops early when the client goes away. An open stream holds a
        place in the session store, so streams cannot take every worker from the other calls."""
        owner, prefixes, failed = caller(context, self.service.auth), self.service.prefixes, False
        with self.service.place(len(prompt)):
            sequence = self.service.target.session(sampling)
            reuse = prefixes.take(owner, prompt, live=self.service.sessions.idle(owner) if prefixes.max_bytes else ())
            if reuse:
                sequence.reuse(reuse.k, reuse.v)
            try:
                verdict = sequence.prefill(prompt, self.service.limits.prefill_chunk, self.service.runner(context))
                self.service.metrics.tokens_generated.inc()
                for produced in range(1, budget + 1):
                    token = verdict.bonus
                    done = token in stop or produced == budget
                    reason = ("stop" if token in stop else "length") if done else ""
                    reused = reuse.length if reuse and produced == 1 else 0
                    yield pb.CompleteChunk(tokens=[token], compute_s=verdict.compute_s, finish_reason=reason,
                                           reused_tokens=reused)  # fmt: skip
                    if done or not context.is_active():
                        return
                    verdict = sequence.verify(DraftTree(), self.service.runner(context))
                    self.service.metrics.tokens_generated.inc()
            except Exception:
                failed = True  # a forward failed: its cache may be half-written, never kept for another prompt
                raise
            finally:
                if not failed:  # done, or the client went away between tokens
                    prefixes.keep(owner, sequence)
                self.service.batcher.forget(sequence.cache)
