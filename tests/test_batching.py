"""Continuous batching: sessions' steps run together in one forward and each gets exactly what it gets alone;
a failing step fails alone; a long prompt's pieces let other sessions' steps in between."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from server import batching
from server.batching import Batcher
from server.budget import TreeBudget
from shared.acceptance import SamplingParams
from shared.engine.models import load_target
from shared.tree import DraftTree


@pytest.fixture(scope="module")
def bf16(tiny_model_dir):
    return load_target(str(tiny_model_dir), dtype="bfloat16")


def trees(guide: list[int], vocab: int):
    """Plain steps, chains and branchy trees around likely continuations (accepted paths move KV)."""
    g = guide
    w = (g[0] + 1) % vocab
    return [DraftTree(), DraftTree.chain(g[:3]), DraftTree([w, g[0], g[1]], [-1, -1, 1]),
            DraftTree([g[0], w, g[1], g[2]], [-1, 0, 0, 2])]  # fmt: skip


def decode(target, prompt, sampling, rounds, run=None):
    """Prefill (in pieces of 8) and ``rounds`` verifications; every verdict and the final cache."""
    session = target.session(sampling, feature_kinds=("kv",))
    verdicts = [session.prefill(prompt, chunk=8, run=run)]
    for i in range(rounds):
        tree = trees(session.tokens[-3:], target.vocab_size)[i % 4]
        verdicts.append(session.verify(tree, run=run))
    n = session.cached_len
    return ([(v.accepted, v.new_tokens) for v in verdicts], session.tokens, session.cache.k[..., :n, :].clone(),
            [v.features.kv for v in verdicts])  # fmt: skip


@pytest.fixture(scope="module")
def bf16_gpu_plan(tiny_model_dir):
    """The exact bf16 recipe a GPU serves (``exact_rows``: fp64 caches), whose sequences attend as padded groups."""
    from shared.engine.decoder import exact_rows

    target = load_target(str(tiny_model_dir), dtype="bfloat16")
    exact_rows(target.engine)
    return target


@pytest.mark.parametrize("plan", ["bf16", "bf16_gpu_plan"])
def test_batched_sessions_get_exactly_what_they_get_alone(plan, request):
    """Sessions of different lengths, trees and sampling (greedy, and seeded sampling) in the same forwards: on a CPU's
    plan (the kernels' attention, a sequence at a time) and a GPU's (fp64 caches, attended as padded groups)."""
    bf16 = request.getfixturevalue(plan)
    cases = [([5, 9, 14, 5, 9, 21, 33], SamplingParams()),
             (list(range(5, 45)), SamplingParams()),
             ([7, 8, 9], SamplingParams(temperature=1.5, top_p=0.9, seed=7)),
             (list(range(60, 80)), SamplingParams(temperature=0.8, seed=3))]  # fmt: skip
    alone = [decode(bf16, p, s, 12) for p, s in cases]
    sizes = []
    batcher = Batcher(bf16.engine, max_batch=8, max_tokens=512, window_s=0.05,
                      on_batch=lambda steps, tokens, seconds: sizes.append(steps))  # fmt: skip
    results = [None] * len(cases)

    def run(i):
        results[i] = decode(bf16, *cases[i], 12, run=batcher.run)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    batcher.close()
    assert max(sizes) > 1, "no batch ever held more than one step"
    for i, (got, want) in enumerate(zip(results, alone, strict=True)):
        assert got[0] == want[0] and got[1] == want[1], i  # every verdict, every token
        assert torch.equal(got[2], want[2]), i  # the caches, bit for bit
        assert all(torch.equal(a, b) for a, b in zip(got[3], want[3], strict=True)), i  # the payload features


def test_one_head_matmul_serves_every_step_of_a_forward(bf16, monkeypatch):
    """The LM head's first rows of every step in a forward (``Step.head``) come from one matmul, and each verdict is
    the one its session gets alone."""
    prompts = [[5, 9, 14, 5], list(range(20, 31)), [7, 8, 9]]

    def sessions():
        out = [bf16.session() for _ in prompts]
        for session, prompt in zip(out, prompts, strict=True):
            session.prefill(prompt)
        return out

    def tree_of(session):  # a branchy tree around the session's likely continuation
        return trees(session.tokens[-3:], bf16.vocab_size)[3]

    want = [s.verify(tree_of(s)) for s in sessions()]
    steps = [s.verify_step(tree_of(s)) for s in sessions()]
    hidden = bf16.engine.forward_many([step.part for step in steps])
    calls, logits = [], bf16.engine.logits
    monkeypatch.setattr(bf16.engine, "logits", lambda h: calls.append(h.shape[0]) or logits(h))
    firsts = batching.head_logits(bf16.engine, steps, hidden)
    assert calls == [sum(len(step.head) for step in steps)] and all(len(step.head) > 1 for step in steps)
    got = [step.finish(h, first) for step, h, first in zip(steps, hidden, firsts, strict=True)]
    assert [(v.accepted, v.new_tokens) for v in got] == [(v.accepted, v.new_tokens) for v in want]


def test_a_failing_step_fails_alone(bf16):
    batcher = Batcher(bf16.engine, max_batch=8, max_tokens=512, window_s=0.05)
    good = bf16.session()
    want = bf16.session()
    want.prefill([5, 6, 7, 8])
    outcome = {}

    def bad():
        session = bf16.session()
        session.prefill([5, 6])
        step = session.verify_step(DraftTree([9], [-1]))
        step.part.ids[1] = 10**9  # no such token: the embedding lookup fails
        try:
            batcher.run(step)
        except Exception as exc:  # noqa: BLE001 - whatever the engine raised
            outcome["bad"] = exc

    def fine():
        outcome["good"] = good.prefill([5, 6, 7, 8], run=batcher.run)

    threads = [threading.Thread(target=f) for f in (bad, fine)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    batcher.close()
    assert isinstance(outcome["bad"], (IndexError, RuntimeError))
    assert outcome["good"].new_tokens == want.tokens[-1:] and good.tokens == want.tokens


def test_a_long_prompt_lets_other_steps_in_between_its_pieces(bf16):
    """Before: one long prefill held the model for its whole length. Pieces queue behind waiting steps."""
    started, pieces = threading.Event(), []
    batcher = Batcher(bf16.engine, max_batch=1, max_tokens=512, window_s=0.0,
                      on_batch=lambda steps, tokens, seconds: pieces.append(tokens) or started.set())  # fmt: skip
    other = bf16.session()
    other.prefill([5, 6, 7])
    long_done = threading.Event()

    def long_prompt():
        bf16.session().prefill(list(range(5, 5 + 200)), chunk=8, run=batcher.run)
        long_done.set()

    thread = threading.Thread(target=long_prompt)
    thread.start()
    started.wait(10)
    verdict = other.verify(DraftTree(), run=batcher.run)  # queued behind one piece at most
    assert not long_done.is_set() and verdict.new_tokens
    thread.join()
    batcher.close()
    assert len(pieces) == 25 + 1  # 200 tokens in pieces of 8, and the other session's step among them


def test_a_new_sequence_does_not_inherit_an_ended_ones_state(bf16, monkeypatch):
    """Before: the batcher kept each sequence's state under id(cache), which Python gives again once a cache is gone,
    so a new session could take over an ended one's time away (as if away since that one's last step) and the budget
    would cut its trees as a slow client's. Here every id() is the same, as reuse makes it."""
    monkeypatch.setattr(batching, "id", lambda obj: 1, raising=False)
    aways = []

    class Recording(TreeBudget):
        def choose(self, trees, tokens, pairs):
            aways.extend(t.away_s for t in trees)
            return super().choose(trees, tokens, pairs)

    batcher = Batcher(bf16.engine, max_batch=1, window_s=0.0, budget=Recording())
    old = bf16.session()
    old.prefill([5, 6, 7])
    old.verify(DraftTree([9], [-1]), run=batcher.run)
    batcher.forget(old.cache)
    del old
    time.sleep(0.2)
    new = bf16.session()
    new.prefill([5, 6, 7])
    new.verify(DraftTree([9], [-1]), run=batcher.run)  # its first step here: no time away to know of
    batcher.close()
    assert aways == [0.0, 0.0], aways


def test_a_batched_server_answers_every_session_as_the_serial_one_does(bf16):
    """Through gRPC: sessions with different prompts, trees, sampling and payload forms (none, kv, hidden) verify
    concurrently on a batching server; every reply — accepted path, bonus token, payload bytes — equals what
    the serial server (--max-batch 1) answers the same session."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from shared.wire import splitspec_pb2 as pb
    from shared.wire import splitspec_pb2_grpc as pb_grpc
    from tests.conftest import start_server

    cases = [([5, 9, 14, 5, 9, 21, 33], pb.Sampling(), pb.PayloadSpec()),
             (list(range(5, 45)), pb.Sampling(), pb.PayloadSpec(form="kv", precision="fp32")),
             ([7, 8, 9], pb.Sampling(temperature=1.5, top_p=0.9, seed=7), pb.PayloadSpec(form="hidden")),
             (list(range(60, 80)), pb.Sampling(temperature=0.8, seed=3), pb.PayloadSpec(form="kv", precision="int8"))]

    def conversation(stub, prompt, sampling, spec) -> list:
        opened = stub.OpenSession(pb.OpenSessionRequest(prompt_ids=prompt, sampling=sampling, payload=spec),
                                  timeout=60)  # fmt: skip
        replies, tokens, length = [opened.SerializeToString()], [*prompt, opened.first_token], opened.length
        for i in range(10):
            tree = trees(tokens[-3:], bf16.vocab_size)[i % 4]
            reply = stub.Verify(pb.VerifyRequest(session_id=opened.session_id, tokens=tree.tokens,
                                                 parents=tree.parents, length=length, payload=spec), timeout=60)
            reply.compute_s = 0.0
            reply.ClearField("load")  # measured costs and the preference they give: timing, not the answer
            replies.append(reply.SerializeToString())
            tokens += [tree.tokens[i] for i in reply.accepted] + [reply.bonus_token]
            length = reply.length
        return replies

    answers = {}
    for mode, limits in (("serial", {"max_batch": 1}), ("batched", {"max_batch": 8, "batch_window_ms": 50})):
        server, address, service = start_server(bf16, max_sessions=8, max_tree_nodes=16, max_context=256,
                                                min_tree_nodes=16, **limits)  # every node: no cut at load  # fmt: skip
        try:
            with grpc.insecure_channel(address) as channel, ThreadPoolExecutor(len(cases)) as pool:
                stub = pb_grpc.SplitSpecStub(channel)
                answers[mode] = list(pool.map(lambda case, stub=stub: conversation(stub, *case), cases))
            sizes = service.metrics.forward_sessions  # a histogram: count of forwards per batch-size bucket
            counts = [bucket.get() for bucket in sizes._buckets]
            most = max((b for b, c in zip(sizes._upper_bounds, counts, strict=True) if c), default=1)
        finally:
            server.stop(grace=None)
            service.close()
        if mode == "batched":
            assert most > 1, "no forward ever held more than one session's step"
    for i, (serial, batched) in enumerate(zip(answers["serial"], answers["batched"], strict=True)):
        one, other = pb.OpenSessionReply.FromString(serial[0]), pb.OpenSessionReply.FromString(batched[0])
        assert (one.first_token, one.payload) == (other.first_token, other.payload), i
        assert serial[1:] == batched[1:], i
