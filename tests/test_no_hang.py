"""No client waits forever: the races that hung clients after a replica died, made to happen on purpose.

A front (``tests.front``) stands between the client and a server, as Ray Serve's proxy does between clients and
replicas, and holds calls at each stage of a round: before a Verify reaches the server, after the server ran it (the
reply never comes), a Decode stream mid-way, the reopening after a lost session, every call for a while (the front
hangs, then recovers: the heartbeat and the reconnection polls meet it too), and all that while closing a channel
blocks for good. Each generation must end, and exactly as plain decoding. Held calls are released by count, never by
a clock; the only wall-clock figure is each test's outer bound on the generation, there so that a hang fails the test
instead of stalling the suite. Then the bounds on injected numbers, a call gRPC itself never ends, and a scan of the
client's code for waits with no bound.
"""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import grpc
import pytest

from client.drafters.base import NoDrafter
from client.drafters.moa import MoADrafter
from client.loop.adaptive import AdaptivePolicy
from client.loop.decode import Settings, generate
from client.loop.offline import Backoff, Resilience
from client.net.deadlines import FLOOR_S, PROBE_MARGIN_S, SLACK, UNMEASURED_RTT_S, Bounds
from client.net.failures import LinkDown, SessionLost
from client.net.link import LinkMonitor
from client.net.remote import RemoteVerifier
from client.verifiers import LocalVerifier
from shared.payload import PayloadSpec
from shared.tree import DraftTree
from tests.conftest import own_server
from tests.front import Front
from tests.test_moa import make_moa

PROMPT = [5, 9, 14, 5, 9, 21, 33, 40, 41, 5, 9]
NEW = 40
OUTER_BOUND_S = 120.0  # a generation still running after this has hung (each one here ends in a few seconds)
ROOT = Path(__file__).resolve().parents[1]


backend = pytest.fixture(scope="module", name="backend")(own_server)  # (address, service) behind the fronts


@pytest.fixture(scope="module")
def plain(tiny_target):
    return generate(LocalVerifier(tiny_target), NoDrafter(), PROMPT, NEW).token_ids


@pytest.fixture
def front(backend):
    front = Front(backend[0])
    yield front
    front.stop()


def on_verify(verifier: RemoteVerifier, number: int, arm) -> None:
    """``arm(verifier)`` just before the ``number``-th Verify is sent."""
    original, calls = verifier.verify, []

    def verify(tree, **kw):
        calls.append(1)
        if len(calls) == number:
            arm(verifier)
        return original(tree, **kw)

    verifier.verify = verify


def bounded_generate(tiny_target, front: Front, arm=None, mode: str | None = None):
    """A split generation through ``front`` (MoA TLI 1 drafting, kv payloads), ``arm`` set on the third Verify; run on
    a thread of its own and given ``OUTER_BOUND_S``. Returns the Generation."""
    drafter = MoADrafter(make_moa(tiny_target, 1), width=3, depth=3)
    verifier = RemoteVerifier(front.address, rpc_timeout_s=30.0)
    if arm is not None:
        on_verify(verifier, 3, arm)
    spec = PayloadSpec("kv", "fp16")
    policy = AdaptivePolicy.for_run(verifier, [spec], mode=mode, pin_nodes=8) if mode else None
    result: list = []

    def run() -> None:
        try:
            result.append(generate(
                verifier, drafter, PROMPT, NEW,
                Settings(
                    spec=spec,
                    max_tree_nodes=8,
                    policy=policy,
                    resilience=Resilience("verify", Backoff(base_s=0.02, cap_s=0.2, seed=1)),
                ),
            ))
        except Exception as exc:  # noqa: BLE001 - handed to the test
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(OUTER_BOUND_S)
    verifier.shutdown()
    assert not thread.is_alive(), f"the generation hung (front held {dict(front.held)})"
    if isinstance(result[0], Exception):
        raise result[0]
    return result[0]


FOREVER = 1000  # calls a rule holds: every one of the route's, as for a replica that died


def gone(front: Front, service):
    """The session's replica died: its session is gone, and every call of its route key is held by the front."""

    def arm(v: RemoteVerifier) -> None:
        service.sessions.pop(v.session_id)
        front.hold("Verify", route=v.connection.route.key, times=FOREVER)
        front.hold("CloseSession", route=v.connection.route.key, times=FOREVER)

    return arm


STAGES = {
    # the session's Verify never reaches a server: its replica is gone with the session
    "before a Verify": gone,
    # the server runs the session's calls (it moves on), their replies never come
    "during the reply": lambda front, service: lambda v: front.hold("Verify", route=v.connection.route.key,
                                                                     when="after", times=FOREVER),
    # the replica is gone, and the first reopening is lost too
    "and the reopening": lambda front, service: lambda v: (gone(front, service)(v), front.hold("OpenSession")),
    # the whole front hangs — probes and the reconnection polls too — then recovers after 8 held calls
    "everything, for a while": lambda front, service: lambda v: front.hold_all(8),
}


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_call_held_at_each_stage_ends_and_the_output_is_exact(tiny_target, backend, front, plain, stage):
    gen = bounded_generate(tiny_target, front, STAGES[stage](front, backend[1]))
    assert gen.token_ids == plain, stage
    assert gen.stats.disconnects >= 1 and sum(front.held.values()) >= 1, (stage, dict(front.held))
    assert front.held["Verify"] == 1, dict(front.held)  # a lost session is reopened, never asked again (but for the
    assert front.held["Verify chained"] <= 1, dict(front.held)  # round sent chained before the held one's verdict)
    if stage == "and the reopening":
        assert front.held["OpenSession"] == 1


def test_a_stream_held_mid_way_ends_and_the_output_is_exact(tiny_target, front, plain):
    """The server decodes (mode stream); its Decode stream stops after three tokens and is never ended."""
    front.hold("Decode", after_messages=3)
    gen = bounded_generate(tiny_target, front, mode="stream")
    assert gen.token_ids == plain
    assert front.held["Decode"] == 1 and gen.stats.disconnects >= 1 and gen.stats.streamed_tokens >= 3


def test_a_channel_close_that_never_returns_holds_nothing_up(tiny_target, front, plain, monkeypatch):
    """While the front hangs, the heartbeat replaces its connection and the reconnection polls theirs; every close
    blocks (until the test ends). The generation goes on regardless."""
    release, blocked = threading.Event(), []
    original = grpc._channel.Channel.close

    def close(channel):
        blocked.append(channel)
        release.wait(OUTER_BOUND_S)
        original(channel)

    monkeypatch.setattr(grpc._channel.Channel, "close", close)
    try:
        gen = bounded_generate(tiny_target, front, lambda v: front.hold_all(8))
    finally:
        release.set()
        monkeypatch.undo()
    assert gen.token_ids == plain
    assert blocked, "no channel was closed: the test did not reach the close it is about"


# --- the parts, on injected numbers ---


def test_bounds_follow_what_was_measured():
    link = LinkMonitor()
    bounds = Bounds(link, cap_s=60.0)
    assert bounds.call_s(5) == 60.0  # nothing measured: the cap
    assert bounds.exchange_s() == UNMEASURED_RTT_S + FLOOR_S
    bounds.observe(5, 0.04)  # a Verify of 5 tokens took 40 ms of compute: 8 ms a token at most
    assert bounds.call_s(5) == pytest.approx(UNMEASURED_RTT_S + SLACK * 0.04 + FLOOR_S)
    assert bounds.call_s(200) == pytest.approx(UNMEASURED_RTT_S + SLACK * 200 * 0.008 + FLOOR_S)
    bounds.observe(200, 1.0)  # a prefill: 5 ms a token, but the trees' figure decays slowly
    assert bounds.call_s(200) == pytest.approx(UNMEASURED_RTT_S + SLACK * 200 * 0.95 * 0.008 + FLOOR_S)
    bounds.observe(5, 0.01)  # a faster round: the bound relaxes slowly
    assert bounds.step_s == pytest.approx(0.95 * 0.04)
    bounds.observe(5, 0.2)  # a slower one: at once
    assert bounds.step_s == 0.2
    assert link.observe(0.03, 0.01, 100, 100)  # a round trip measured: 20 ms
    assert bounds.exchange_s() == pytest.approx(link.timeout_s() + FLOOR_S)
    assert bounds.probe_s() == pytest.approx(link.timeout_s() + PROBE_MARGIN_S)  # after a lost call: no floor
    bounds.observe(5, 100.0)
    assert bounds.call_s(5) == 60.0  # never past the cap


def test_a_prompt_on_a_compute_bound_server_is_bounded_by_its_tokens_not_by_one_step():
    """Zen 3 with one core: steps of 100 ms, a 17-token tree 570 ms. A 37-token prompt (the demo's API baseline,
    opened after a run that streamed) takes ~1.2 s; bounded by the step it was given 0.9 s and every try was lost."""
    bounds = Bounds(LinkMonitor(), cap_s=60.0)
    for _ in range(30):
        bounds.observe(1, 0.1)
    bounds.observe(17, 0.57)
    for _ in range(30):  # streaming again: the trees' figure relaxes, slowly
        bounds.observe(1, 0.1)
    prompt_s = 37 * (0.57 - 0.1) / 16 + 0.1  # what the prompt costs: a step and 36 more tokens at a tree's rate
    assert bounds.compute_s(37) > prompt_s
    assert bounds.call_s(37) > UNMEASURED_RTT_S + FLOOR_S + 2 * prompt_s
    assert bounds.compute_s(1) == pytest.approx(0.57 * 0.95**30)  # one token: a step, the tree fading from it


class _Never:
    """A call gRPC never ends: its result is never ready, whatever deadline it was given."""

    def result(self, timeout=None):
        raise grpc.FutureTimeoutError()

    def cancel(self):
        return True


class _Answered:
    def result(self, timeout=None):
        return None

    def cancel(self):
        return False


class _Stub:
    def __init__(self, probes_answered: bool):
        self.Verify = type("M", (), {"future": staticmethod(lambda *a, **kw: _Never())})
        self.Probe = type("M", (), {"future": staticmethod(lambda *a, **kw: _Answered() if probes_answered
                                                          else _Never())})  # fmt: skip


@pytest.mark.parametrize("probes_answered", [True, False])
def test_a_call_grpc_never_ends_is_abandoned_here(backend, probes_answered):
    """The wait in this process is bounded too: a Verify whose deadline gRPC never fires is lost all the same — a
    lost session (with a new route key) when the server answers a probe, a cut when it does not."""
    verifier = RemoteVerifier(backend[0])
    c = verifier.connection
    try:
        c.route.key, c.stub = "old", _Stub(probes_answered)
        with pytest.raises(SessionLost if probes_answered else LinkDown, match="unanswered within"):
            verifier.verify(DraftTree.chain([5, 9]), timeout_s=0.01)
        assert (c.route.key != "old") == probes_answered
        assert not c.busy  # no call left in flight for the heartbeat to watch
    finally:
        verifier.shutdown()


def test_a_connection_that_lost_a_call_is_not_used_again(backend):
    """A call lost for the link may have left its connection half-read (a silent cut drops bytes mid-stream): the
    next reconnection poll goes over a new connection, not the old one, even where the old would answer."""
    verifier = RemoteVerifier(backend[0])
    c = verifier.connection
    try:
        c.route.key, c.stub = "old", _Stub(probes_answered=False)
        old = c.channel
        with pytest.raises(LinkDown):
            verifier.verify(DraftTree.chain([5, 9]), timeout_s=0.01)
        assert verifier.reachable(timeout_s=5.0)  # (the never-answering stub is gone with its channel)
        assert c.channel is not old
        renewed = c.channel
        assert verifier.reachable(timeout_s=5.0) and c.channel is renewed  # a sound one is kept
    finally:
        verifier.shutdown()


def test_polls_that_keep_failing_wait_longer_each_time(backend):
    """A reconnection poll that fails doubles the next one's time (up to POLL_GROWTH times): on a machine too busy to
    open a connection within a few round trips, polls of a fixed time would fail for ever (seen: 10 minutes
    offline on a restored link, the client at nice 19 beside a training run). An answered poll starts again."""
    from client.net.connection import POLL_GROWTH

    verifier, asked = RemoteVerifier(backend[0]), []
    c = verifier.connection

    def handshake(*args, timeout=None, **kwargs):
        asked.append(timeout)
        return _Answered() if len(asked) == 7 else _Never()

    try:
        real = c.stub
        c.stub = type("S", (), {"Handshake": type("M", (), {"future": staticmethod(handshake)})})()
        c._renew = lambda: None  # keep the recording stub across failed polls
        results = [verifier.reachable(timeout_s=0.001) for _ in range(8)]
        assert results == [False] * 6 + [True, False]
        assert asked == pytest.approx([0.001 * min(2**k, POLL_GROWTH) for k in range(7)] + [0.001])
        c.stub = real
    finally:
        verifier.shutdown()


# --- the client's code: no wait without a bound ---

WAITS = {"result", "wait", "join", "get"}  # a future's, an event's, a thread's, a queue's
NOT_WAITS = {("edge.py", "job.result")}  # Job.result returns at once: the generation has ended
READER = ("remote.py", "_messages")  # the one place a stream is read unbounded: a daemon thread nobody waits on


def unbounded_waits(path: Path) -> list[str]:
    """Calls in ``path`` that may wait with no bound: ``x.result()``, ``x.wait()``, ``x.join()``, ``x.get()`` with no
    timeout (a ``str.join`` has an argument, ``dict.get`` a key; an ``await``ed one is the event loop's), and
    ``next(s)`` or ``for _ in s`` over a gRPC stream (``s`` bound to ``self._start(..., stream=True)``, or such a call
    itself) rather than through ``_messages``."""
    tree = ast.parse(path.read_text())
    awaited, streams, found, reader = set(), set(), [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and (path.name, node.name) == READER:
            reader |= {id(n) for n in ast.walk(node)}
        if isinstance(node, ast.Await):
            awaited.add(id(node.value))
        if isinstance(node, ast.Assign) and is_stream(node.value):
            streams |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in WAITS:
            bounded = node.args or any(k.arg == "timeout" for k in node.keywords)
            if not bounded and id(node) not in awaited and (path.name, ast.unparse(node.func)) not in NOT_WAITS:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        iterated = node.iter if isinstance(node, ast.For) else None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "next" and node.args:
            iterated = node.args[0]
        if id(node) in reader:
            continue
        if (isinstance(iterated, ast.Name) and iterated.id in streams) or is_stream(iterated):
            found.append(f"{path.name}:{node.lineno}: a gRPC stream iterated with no bound: {ast.unparse(iterated)}")
    return found


def is_stream(node) -> bool:
    """``self._start(..., stream=True)``: a gRPC reply stream."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "_start"
            and any(k.arg == "stream" for k in node.keywords))  # fmt: skip


def test_the_client_has_no_wait_without_a_bound(tmp_path):
    paths = [p for p in sorted((ROOT / "client").rglob("*.py")) if "training" not in p.parts]
    found = [w for p in paths for w in unbounded_waits(p)]
    assert not found, "waits with no bound:\n" + "\n".join(found)
    sample = tmp_path / "sample.py"  # what it catches: the waits that hung clients
    sample.write_text("def f(self, future, event, thread, request):\n    future.result()\n    event.wait()\n"
                      "    thread.join()\n    call = self._start('Decode', request, 1.0, stream=True)\n"
                      "    first = next(call)\n    for chunk in call:\n        pass\n"
                      "    future.result(timeout=1.0)\n    ', '.join(['a'])\n")  # fmt: skip
    assert sorted(w.split(": ", 1)[0] for w in unbounded_waits(sample)) == [f"sample.py:{n}" for n in (2, 3, 4, 6, 7)]
