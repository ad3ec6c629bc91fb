"""Drafting ahead of a verdict, and chained rounds (``client.loop.decode``'s pipelined rounds over a link).

While a Verify is in flight the drafter drafts ahead: it takes the tree's likeliest path as accepted
(``Drafter.assume``) and drafts the tree after it, whose first level holds its guesses for the server's bonus token.
When the verdict is that path and a bonus it guessed, the subtree under that bonus is the next round's tree, ready at
once. Chained (``chain``): that tree is sent at once, before the verdict it assumes (``Verifier.verify_after``), so the
server verifies it straight after the round before; where the guess was wrong the server answers it stale without
computing. Each function here takes the generation's ``client.loop.decode.Run``.
"""

from __future__ import annotations

from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from client.loop.adaptive import Ahead
from client.loop.sizing import Decision, outcomes
from client.net.failures import LinkDown
from client.verifiers import Pending
from shared.engine.target import Verdict
from shared.tree import DraftTree, path_to

AHEAD_NODES = 1.5  # a tree drafted ahead holds this many times a round's budget: its likeliest root's subtree is sent
HEDGES = 3  # outcomes a round drafts ahead for, the likeliest first, the others only while its verdict is not in
FLIGHT_GRACE_S = 2.0  # a Verify in flight is bounded by the verifier itself; this wait outlasts that bound
UNBOUNDED_FLIGHT_S = 300.0  # (no deadline: on_reconnect fail) the most a wait for a Verify in flight lasts


@dataclass
class Chained:
    """A round sent before the verdict of the round before it (``Verifier.verify_after``): its call, its tree, how
    it was sized, the tokens it assumes the round before commits."""

    pending: Pending
    tree: DraftTree
    decision: Decision
    assumed: list[int]


def pipelined(run, tree: DraftTree, chained: Chained | None = None) -> Verdict:
    """Verify ``tree`` (or wait for ``chained``, its call already under way) while drafting ahead of its verdict,
    for its likeliest outcomes in turn (the first always, the next ones while the verdict is not in); the drafter
    ends having absorbed the verdict, and ``run.ready`` holds the next tree when one of the guesses held — or
    ``run.chained`` the next round, sent chained from the first guess, when that one held."""
    drafter, stats = run.drafter, run.stats
    deadline = run.deadline(len(tree))
    if chained is None:
        flight = run.flights.submit(run.verifier.verify, tree, timeout_s=deadline, spec=run.spec)
        done = flight.done

        def verdict() -> Verdict:
            try:
                return flight.result(timeout=(deadline or UNBOUNDED_FLIGHT_S) + FLIGHT_GRACE_S)
            except FutureTimeout:
                raise LinkDown(f"server {run.verifier.address}: a Verify unanswered past its bound") from None
    else:
        done, verdict = chained.pending.done, chained.pending.verdict
    t0 = run.clock()
    depth = run.plan.depth  # one level more: the first holds the guesses for the bonus
    depth, size = None if depth is None else depth + 1, max(1, round(AHEAD_NODES * run.budget()))
    aheads: list[tuple[list[int], DraftTree]] = []  # (a path guessed accepted, the tree drafted after it)
    after: Chained | None = None  # the next round, sent now from the first guess
    for leaf, _ in outcomes(tree, run.policy.calibration, run.sampling.temperature == 0)[:HEDGES]:
        if aheads and done():
            break
        path = [tree.tokens[i] for i in path_to(tree.parents, leaf)] if leaf >= 0 else []
        drafter.assume(path)
        aheads.append((path, drafter.propose(size, depth)))
        drafter.discard()  # verified, if at all, as the next round's tree
        drafter.rewind(len(path))
        if run.chain and len(aheads) == 1 and not done():
            after = send_after(run, path, aheads[0][1], deadline)
    ahead_s = run.clock() - t0
    stats.ahead_s += ahead_s
    stats.guesses += 1
    try:
        result = verdict()
    except BaseException:
        if after is not None:
            after.pending.drop()
        raise
    drafter.absorb(result.new_tokens, result.features)
    bonus, ready = result.new_tokens[-1], None
    if after is not None and result.new_tokens == after.assumed:
        run.chained = after  # under way already: the next round
        stats.chained_held += 1
    elif after is not None:
        after.pending.drop()  # stale: the server answers it without computing
    taken = next((ahead for path, ahead in aheads if result.new_tokens[:-1] == path), None)
    if taken is not None and run.chained is None:
        first = next((i for i, (t, p) in enumerate(zip(taken.tokens, taken.parents, strict=True))
                      if p == -1 and t == bonus), None)  # fmt: skip
        ready = taken.subtree(first) if first is not None else None
    held = bool(ready) or run.chained is not None
    run.policy.observe(Ahead(taken is not None, held, ahead_s, after is not None))
    if ready:  # (an empty one is no guess: the drafter stopped at the bonus's level, unsure of it)
        run.ready = ready
    stats.guesses_held += held
    return result

def send_after(run, path: list[int], ahead: DraftTree, before_s: float | None) -> Chained | None:
    """Send the next round now, before this one's verdict: the tree ``ahead`` under its likeliest bonus guess,
    assuming this round commits ``path`` and that bonus. None where it would not pay: the guess ends the
    generation, or leaves nothing to send. ``before_s``: this round's deadline, which the chained one waits out
    before its own."""
    firsts = ahead.chain_of_firsts()
    if not firsts:
        return None
    assumed = path + [ahead.tokens[firsts[0]]]
    if run.stop.intersection(assumed) or len(run.out) + len(assumed) >= run.limit:
        return None
    tree = ahead.subtree(firsts[0]).head(run.budget(len(assumed)))  # what the tree ready then would send
    decision = run.policy.size(tree, run.spec)
    tree = tree.head(decision.nodes)
    if not tree.tokens:
        return None
    deadline = run.deadline(len(tree))
    bound = None if deadline is None or before_s is None else before_s + deadline
    pending = run.verifier.verify_after(len(run.prompt_ids) + len(run.out), assumed, tree, timeout_s=bound,
                                         spec=run.spec)  # fmt: skip
    run.stats.chained += 1
    return Chained(pending, tree, decision, assumed)
