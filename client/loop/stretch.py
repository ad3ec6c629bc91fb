"""Stretches: the server decodes by itself and streams (a Decode call), the client absorbing and emitting the tokens
as they come, and rehearsing its drafting on them (mode auto) without sending a tree. Each function here takes the
generation's ``client.loop.decode.Run``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from client.loop.adaptive import Loaded, Rehearsal, State, Streamed
from client.net.failures import LinkDown, SessionLost
from shared.engine.target import Verdict
from shared.tree import depths

# Tokens per payload while the server decodes: fewer, larger payloads cost the server less to make and compress
# better; a cut may keep the last (up to this many tokens') from arriving, and the settlement fetches them then.
PAYLOAD_EVERY = 8


def stream(run, stretch: int, opening: float | None = None) -> None:
    """A stream: a stretch of ``stretch`` tokens decoded by the server alone (a Decode stream),
    absorbed and emitted as they arrive. The server is asked for all the generation has left, so that the policy
    may extend the stretch without a new call (a plan asked while ``streaming``);
    the stream is cancelled when the stretch ends, or once the generation is finished (a stop string).
    ``opening``: the session is opened by this stream (the time the generation began)."""
    verifier, drafter, policy, stats, clock = run.verifier, run.drafter, run.policy, run.stats, run.clock
    room = verifier.max_context - len(run.prompt_ids) - len(run.out)
    limit = min(run.limit - len(run.out), room)
    run.check_heartbeat()
    spec, stop, self_draft = run.spec, sorted(run.stop), run.plan.self_draft
    t0, got, compute = clock(), 0, 0.0
    stats.streams += 1
    if opening is None:
        tokens = verifier.decode(limit, stop, PAYLOAD_EVERY, self_draft=self_draft, spec=spec)
        featured = cached = len(run.prompt_ids) + len(run.out) - 1  # the server caches all but the root
    else:  # the prompt's features come with the first payload
        held = drafter.keep_for(run.prompt_ids) if spec else 0
        tokens = verifier.open_decode(run.prompt_ids, run.sampling, limit, stop, PAYLOAD_EVERY,
                                      self_draft=self_draft, spec=spec, held=held)  # fmt: skip
        featured, cached = held, len(run.prompt_ids) - 1
    rehearsal = None  # (a tree drafted and not sent, its depth, where its root is in the output, seconds drafting)
    try:
        with contextlib.closing(tokens):
            for result in tokens if opening is None else awaiting_first(run, tokens):
                if opening is not None and not run.out:
                    drafter.begin(run.prompt_ids + result.new_tokens, result.features)
                    run.started(opening)
                    stretch += 1  # the prefill's token: every mode waits for it, so it does not time the stream
                    t0, got, compute = clock(), -1, -result.compute_s
                else:
                    drafter.absorb(result.new_tokens, result.features)
                cached += len(result.new_tokens)
                if result.features is not None:
                    featured = result.features.start + len(result.features)
                got, compute = got + len(result.new_tokens), compute + result.compute_s
                # a streamed token's time on a loaded server (its batch's forward) bounds a Verify's from below
                run.verify_s = max(result.compute_s, 0.8 * run.verify_s + 0.2 * result.compute_s)
                stats.streamed_tokens += len(result.new_tokens)
                run.commit(run.out + result.new_tokens, run.verified + [True] * len(result.new_tokens))
                if result.load is not None:
                    policy.observe(Loaded(result.load))
                if run.finished():
                    break
                rehearsal = rehearse(run, rehearsal, featured == cached or not spec)
                # the stretch is over once its features are in too (a payload comes every PAYLOAD_EVERY tokens;
                # ending between two would leave the drafter without the last ones): told, then maybe extended
                if got >= stretch and (featured == cached or not spec):
                    policy.observe(Streamed(got, compute, clock() - t0))
                    t0, got, compute = clock(), 0, 0.0
                    plan = policy.plan(State(len(run.prompt_ids), len(run.out), streaming=True))
                    if not (stretch := plan.stream):
                        break
    except (LinkDown, SessionLost):
        if featured < cached and spec:
            run.unfeatured = (featured, cached)  # fetched when the server is back (client.loop.offline)
        raise
    policy.observe(Streamed(got, compute, clock() - t0))

def rehearse(run, rehearsal, featured: bool):
    """Drafting rehearsed during a stream (``client.loop.schedule``): a tree drafted from the newest token once the
    drafter has every feature (``featured``), never sent, scored once the tokens its depth reaches have streamed
    in. Returns the rehearsal under way (None: none)."""
    drafter, clock = run.drafter, run.clock
    if rehearsal is not None:
        tree, depth, at, draft_s = rehearsal
        if len(run.out) - (at + 1) <= depth:  # (checked at every chunk: no copy of the output until then)
            return rehearsal
        run.policy.observe(Rehearsal(tree, tree.follow(run.out[at + 1 :]), draft_s))
    if not featured or not run.plan.rehearse:
        return None
    t0 = clock()
    tree = drafter.propose(run.budget(), run.plan.depth)
    drafter.discard()
    depth = max(depths(tree.parents), default=0)  # (an empty tree counts: a round that gains one)
    draft_s = clock() - t0
    run.stats.rehearse_s += draft_s
    return tree, depth, len(run.out) - 1, draft_s

def awaiting_first(run, tokens: Iterator[Verdict]) -> Iterator[Verdict]:
    """A stream that opens the session: its first chunk awaited beside the drafter's preparing, then the rest."""
    first = run.beside_prepare(lambda: next(tokens, None))
    if first is not None:
        yield first
        yield from tokens
