"""A full server refuses a new session with a retry hint (RESOURCE_EXHAUSTED, ``grpc-retry-pushback-ms``).

Before: the client gave up at the first refusal, 0.18 s into a generation, though the server had said when to
come back. Now the opening calls wait for a place, never longer than the hint per wait nor past their own
budget (``admission_s``), say that they wait, and give up with the server's refusal when the budget ends.
"""

from __future__ import annotations

import threading
import time

import pytest

from client.drafters import make_drafter
from client.loop.decode import generate
from client.net.failures import ServerFull
from client.net.remote import RemoteVerifier
from shared.acceptance import SamplingParams
from tests.conftest import start_server

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture
def full(tiny_target):
    """A server with one place, held by a session that is never idle long enough to be evicted (30 s);
    yields (address, the holder's verifier)."""
    server, address, service = start_server(tiny_target, max_sessions=1, max_tree_nodes=16, max_context=128,
                                            evict_idle_s=30)  # fmt: skip
    holder = RemoteVerifier(address)
    holder.open(PROMPT, SamplingParams())
    yield address, holder
    holder.shutdown()
    server.stop(grace=None)
    service.close()


def test_a_generation_waits_for_a_place_and_gets_it_once_the_holder_closes(full):
    address, holder = full
    notes: list[str] = []
    client = RemoteVerifier(address, admission_s=20, say=notes.append)
    closer = threading.Timer(0.5, holder.close)
    try:
        began = time.monotonic()
        closer.start()
        gen = generate(client, make_drafter("prompt-lookup"), PROMPT, 4)
        waited = time.monotonic() - began
    finally:
        closer.cancel()
        client.shutdown()
    assert len(gen.token_ids) == 4
    assert 0.45 < waited < 8, waited  # admitted after the close, well before the 30 s hint or the budget
    assert len(notes) == 1 and "RESOURCE_EXHAUSTED" in notes[0] and "waiting up to" in notes[0], notes


def test_an_open_gives_up_with_the_refusal_when_its_budget_is_shorter_than_the_wait(full):
    address, _ = full
    notes: list[str] = []
    client = RemoteVerifier(address, admission_s=0.6, say=notes.append)
    try:
        began = time.monotonic()
        refusal = r"RESOURCE_EXHAUSTED: .*retry in [0-9.]+s; gave up after \d+ tries"
        with pytest.raises(ServerFull, match=refusal) as info:
            client.open(PROMPT, SamplingParams())
        waited = time.monotonic() - began
    finally:
        client.shutdown()
    assert 0.55 < waited < 4, waited  # its own budget, not the server's 30 s hint
    assert 0 < info.value.retry_s <= 30
    tries = int(info.value.args[0].rsplit("gave up after ", 1)[1].split()[0])
    assert 2 <= tries <= 32  # backed off: several tries, not a spin
    assert len(notes) == 1


def test_a_streamed_open_waits_too_and_gives_up_at_its_budget(full):
    """The Decode call that opens its session (the default ``auto`` mode's first stretch) is refused before its
    first token: the same wait, then the same error."""
    address, _ = full
    client = RemoteVerifier(address, admission_s=0.4, say=lambda message: None)
    try:
        began = time.monotonic()
        stream = client.open_decode(PROMPT, SamplingParams(), 4, [])
        with pytest.raises(ServerFull, match="RESOURCE_EXHAUSTED"):
            next(stream)
        waited = time.monotonic() - began
        assert not client.connection.busy  # nothing left in flight for a heartbeat to watch
    finally:
        client.shutdown()
    assert 0.35 < waited < 4, waited
    assert client.counters.server_calls >= 2  # each try crossed the link and is counted
