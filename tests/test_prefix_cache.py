"""The server's prefix cache (``server.prefixes``): a conversation's next turn prefills only what is new, gives the
tokens a cold prefill gives, and never reuses another caller's prefix."""

from __future__ import annotations

import pytest
import torch

from client.build import Client, ClientOptions, Shared
from client.drafters import make_drafter
from client.loop.decode import generate
from client.net.api import api_complete
from client.net.endpoint import Endpoint
from client.net.remote import RemoteVerifier
from client.verifiers import LocalVerifier, first_spec
from server.limits import ServerLimits
from server.service import build_server
from shared.acceptance import SamplingParams
from shared.engine.models import load_target
from shared.engine.prefixes import BLOCK, MIN_TOKENS, PrefixCache, block_hashes
from shared.tree import DraftTree
from tests.conftest import served, wait_until

WORDS = ("the cat sat on the mat and looked at the dog who was sleeping by the warm fire in the old house near the "
         "river where the children played every day after school until the sun went down")  # fmt: skip


@pytest.fixture(scope="module")
def int8_target(tiny_model_dir):
    """A target whose rows are independent of each other (splitspec's kernels): where prefixes are reused."""
    return load_target(str(tiny_model_dir), dtype="float32", weights="int8")


def kv(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 1, 2, n, 4, generator=g), torch.randn(2, 1, 2, n, 4, generator=g)


def test_the_longest_cached_run_is_found_by_blocks_and_checked_token_by_token():
    cache = PrefixCache(1 << 20)
    conversation = list(range(100, 200))
    k, v = kv(90)
    assert cache.put("", conversation, k, v)
    reuse = cache.take("", conversation[:70] + [7, 8, 9])
    assert reuse.length == 70 and torch.equal(reuse.k, k[:, :, :, :70]) and torch.equal(reuse.v, v[:, :, :, :70])
    assert cache.take("", conversation[:20] + [1] * 40) is None  # shorter than MIN_TOKENS shared
    assert cache.take("", [5] * 80) is None
    whole = cache.take("", conversation[:90])
    assert whole.length == 89  # all but the prompt's last token: its state picks the next one
    assert (cache.hit_tokens, cache.miss_tokens) == (70 + 89, 3 + 60 + 80 + 1)
    assert len(block_hashes(conversation)) == len(conversation) // BLOCK and MIN_TOKENS <= 70


def test_a_prefix_belongs_to_its_caller():
    cache = PrefixCache(1 << 20)
    tokens = list(range(64))
    cache.put("alice", tokens, *kv(64))
    assert cache.take("bob", tokens + [1]) is None
    assert cache.take("", tokens + [1]) is None
    assert cache.take("alice", tokens + [1]).length == 64


def test_the_next_turn_replaces_the_turn_it_extends_and_the_budget_evicts_the_least_recently_used():
    one = kv(64)[0]
    entry_bytes = 2 * one.numel() * one.element_size()
    cache = PrefixCache(3 * entry_bytes)
    turn1 = list(range(64))
    cache.put("", turn1, *kv(64))
    cache.put("", turn1 + list(range(500, 532)), *kv(96))  # the same conversation, one turn on
    assert len(cache) == 1 and cache.take("", turn1 + [9]).length == 64
    others = [list(range(1000 * i, 1000 * i + 64)) for i in (1, 2, 3)]
    cache.put("", others[0], *kv(64))
    cache.take("", turn1 + [9])  # the conversation was used after others[0]: others[0] goes first
    cache.put("", others[1], *kv(64))
    cache.put("", others[2], *kv(64))
    assert cache.evictions >= 1 and cache.nbytes <= cache.max_bytes
    assert cache.take("", others[0] + [9]) is None and cache.take("", others[2] + [9]).length == 64
    assert not PrefixCache(0).put("", turn1, *kv(64))  # off


def test_a_block_two_conversations_share_stays_found_when_one_goes():
    cache = PrefixCache(1 << 20)
    system = list(range(64))
    a, b = system + list(range(300, 340)), system + list(range(700, 740))
    cache.put("", a, *kv(len(a)))
    cache.put("", b, *kv(len(b), seed=1))
    cache._drop(max(cache._entries))  # b, which answered for the shared blocks
    assert cache.take("", a + [1]).length == len(a)


@pytest.mark.parametrize("path", ["int8", "bf16"])
def test_a_reused_prefix_gives_the_bits_of_a_cold_prefill(tiny_model_dir, path):
    target = load_target(str(tiny_model_dir), dtype="float32", weights="int8") if path == "int8" else load_target(
        str(tiny_model_dir), dtype="bfloat16", weights="native")  # fmt: skip
    assert target.rows_independent
    ids = target.tokenizer(WORDS)["input_ids"]
    first = target.session()
    first.prefill(ids[:40])
    for _ in range(6):
        first.verify(DraftTree())  # six plain steps: their KV computed a row at a time
    prompt = first.tokens + ids[40:50]
    cold, warm = target.session(feature_kinds={"hidden"}), target.session(feature_kinds={"hidden"})
    a = cold.prefill(prompt, chunk=16)
    n = first.cached_len
    warm.reuse(first.cache.k[:, :, :, :n].clone(), first.cache.v[:, :, :, :n].clone())
    b = warm.prefill(prompt, chunk=16)
    assert b.features.start == n and torch.equal(a.features.hidden[n:], b.features.hidden)
    assert torch.equal(cold.cache.k[:, :, :, : len(prompt)], warm.cache.k[:, :, :, : len(prompt)])
    assert a.new_tokens == b.new_tokens


def test_fp32_on_torch_does_not_reuse(tiny_model_dir):
    target = load_target(str(tiny_model_dir), dtype="float32", weights="native")
    assert not target.rows_independent
    server, _, service = build_server(target, "127.0.0.1", 0, ServerLimits())
    try:
        assert service.prefixes.max_bytes == 0
    finally:
        server.stop(grace=None)
        service.close()


def conversation(client_generate, tokenizer, turns: int = 3, new: int = 12) -> list[list[int]]:
    """Each turn: the whole conversation so far plus a new user line, as chat apps send it."""
    ids = tokenizer(WORDS)["input_ids"]
    history, outputs = [], []
    for turn in range(turns):
        history = history + ids[turn * 12 : turn * 12 + 36]
        out = client_generate(history, new)
        outputs.append(out)
        history = history + out
    return outputs


@pytest.mark.parametrize("drafter", ["none", "prompt-lookup"])
def test_a_conversation_over_the_server_gives_the_cache_off_tokens_and_prefills_only_what_is_new(int8_target,
                                                                                                 drafter):
    shared = Shared(None, int8_target.tokenizer, int8_target.fingerprint)
    runs = {}
    for mb in (0, 64):
        with served(int8_target, max_context=512, prefix_cache_mb=mb) as (address, service):
            told = []  # what the server told the client it reused, turn by turn
            with Client(ClientOptions(server=address, drafter=drafter), shared) as client:
                def turn(prompt, n, client=client, service=service, told=told):
                    wait_until(lambda: len(service.sessions) == 0)  # the last turn's close has landed
                    gen = client.generate(prompt, n)
                    told.append(gen.stats.reused_tokens)
                    return gen.token_ids

                runs[mb] = (conversation(turn, int8_target.tokenizer), service.prefixes.hit_tokens,
                            service.prefixes.miss_tokens)  # fmt: skip
            assert sum(told) == service.prefixes.hit_tokens and told[0] == 0 and (mb == 0) == (told[1] == 0)
    (off, off_hits, off_misses), (on, hits, misses) = runs[0], runs[64]
    plain = conversation(lambda p, n: generate(LocalVerifier(int8_target), make_drafter("none"), p, n).token_ids,
                         int8_target.tokenizer)  # fmt: skip
    assert on == off == plain
    assert off_hits == 0 and hits > 0 and misses < off_misses


def test_the_api_stream_reuses_its_callers_prefixes_only(int8_target):
    tokens = {"a" * 32: "alice", "b" * 32: "bob"}
    server, port, service = build_server(int8_target, "127.0.0.1", 0, ServerLimits(max_context=512), tokens=tokens)
    server.start()
    address = f"127.0.0.1:{port}"
    remotes = {name: RemoteVerifier(Endpoint(address, token=t)) for t, name in tokens.items()}
    try:
        prompt = int8_target.tokenizer(WORDS)["input_ids"][:40]
        first = api_complete(remotes["alice"], prompt, 8).token_ids
        wait_until(lambda: len(service.prefixes) == 1)
        longer = prompt + first + [int8_target.tokenizer("and")["input_ids"][-1]]
        hits = service.prefixes.hit_tokens
        bob, alice = api_complete(remotes["bob"], longer, 8), api_complete(remotes["alice"], longer, 8)
        assert bob.token_ids == alice.token_ids
        assert service.prefixes.hit_tokens - hits == len(prompt) + len(first) - 1  # alice's, not bob's
        assert (bob.stats.reused_tokens, alice.stats.reused_tokens) == (0, len(prompt) + len(first) - 1)
        plain = generate(LocalVerifier(int8_target), make_drafter("none"), longer, 8).token_ids
        assert api_complete(remotes["alice"], longer, 8).token_ids == plain
    finally:
        for remote in remotes.values():
            remote.shutdown()
        server.stop(grace=None)
        service.close()


def test_a_model_drafters_next_turn_runs_only_what_is_new_and_drafts_as_a_cold_one(int8_target):
    from client.drafters.model import ModelDrafter

    ids = int8_target.tokenizer(WORDS)["input_ids"]
    warm, cold = (ModelDrafter(int8_target, width=2, depth=3, vocab=None, floor=0.0) for _ in range(2))
    first = generate(LocalVerifier(int8_target), warm, ids[:30], 10).token_ids
    turn2 = ids[:30] + first + ids[30:40]
    fed = []
    run = warm.engine.forward_many
    warm.engine.forward_many = lambda parts: fed.append(sum(len(p.ids) for p in parts)) or run(parts)
    try:
        warm.prepare(turn2)
    finally:
        del warm.engine.forward_many
    assert fed == [len(turn2) - warm_held(first)]  # from where the last sequence's cache and the prompt part
    cold.prepare(turn2)
    for drafter in (warm, cold):
        drafter.begin(turn2 + [ids[-1]])
    a, b = warm.propose(6), cold.propose(6)
    assert (a.tokens, a.parents) == (b.tokens, b.parents)


def warm_held(first: list[int]) -> int:
    """Tokens of turn 2 the drafter's cache already holds: turn 1's prompt and all but the newest of its output."""
    return 30 + len(first) - 1


def test_a_conversations_turns_share_a_route_key_so_a_cluster_sends_them_to_its_prefix():
    from server.routing import owner
    from shared.channel import CONVERSATION_TOKENS, route_key

    turn1 = list(range(100, 100 + CONVERSATION_TOKENS + 5))
    turn2 = turn1 + [7, 8, 9] + list(range(300, 340))
    assert route_key(turn1) == route_key(turn2) != route_key([1] + turn1)
    replicas = ["replica-a", "replica-b", "replica-c"]
    assert owner(route_key(turn1), replicas) == owner(route_key(turn2), replicas)
    short = turn1[: CONVERSATION_TOKENS - 1]
    assert route_key(short) != route_key(short)  # too short to name a conversation: a session's own, drawn at random


def test_a_conversation_keeps_its_route_key_for_its_next_turn_however_short_the_first():
    from client.net.connection import Route
    from shared.channel import CONVERSATION_TOKENS, route_key

    route = Route()
    short = list(range(100, 130))  # a first turn too short for a key of its own: a random one
    route.follow(short)
    first = route.key
    route.follow(short + list(range(200, 260)))  # the next turn goes on from it: the same replica
    assert route.key == first
    route.move()  # a lost call moved the session to another replica: the conversation follows it there
    moved = route.key
    route.follow(short + list(range(200, 280)))
    assert route.key == moved != first
    other = list(range(500, 500 + CONVERSATION_TOKENS + 4))  # another conversation: its own key
    route.follow(other)
    assert route.key == route_key(other)


def test_a_local_conversation_reuses_its_last_turn_and_gives_plain_decodings_tokens(int8_target):
    shared = Shared(int8_target, int8_target.tokenizer)
    with Client(ClientOptions(local=True, drafter="prompt-lookup"), shared) as client:
        outputs = conversation(lambda p, n: client.generate(p, n).token_ids, int8_target.tokenizer)
        prefixes = client.verifier.prefixes
        assert prefixes.hit_tokens > 0 and prefixes.max_bytes > 0
    plain = conversation(lambda p, n: generate(LocalVerifier(int8_target), make_drafter("none"), p, n).token_ids,
                         int8_target.tokenizer)  # fmt: skip
    assert outputs == plain


def test_two_hundred_conversations_stay_within_the_budget_and_each_next_turn_finds_its_own():
    one = kv(64)[0]
    cache = PrefixCache(20 * 2 * one.numel() * one.element_size())  # room for ~20 short conversations
    held = []
    for c in range(200):
        turn1 = [c] * 8 + list(range(1000 + 64 * c, 1000 + 64 * c + 56))
        cache.put(str(c % 3), turn1, *kv(64, seed=c))
        assert cache.take(str(c % 3), turn1 + [1, 2]).length == 64  # the next turn, at once
        held.append(cache.nbytes)
    assert max(held) <= cache.max_bytes and cache.evictions >= 180 and len(cache) <= 20


def test_the_edge_hands_a_conversations_next_turn_the_client_that_holds_it_within_its_memory(tiny_target,
                                                                                             tiny_model_dir,
                                                                                             tiny_server):
    from client.apps.edge_pool import Edge
    from client.drafters.model import ModelDrafter

    def edge(idle_mb: int) -> Edge:
        return Edge(tiny_server[0], lambda: ModelDrafter(tiny_target, vocab=None), model=str(tiny_model_dir),
                    idle_mb=idle_mb)  # fmt: skip

    roomy = edge(64)
    a, b = roomy.take(), roomy.take()
    a.history, b.history = list(range(10, 60)), list(range(100, 150))
    roomy.release(a)
    roomy.release(b)  # b is the one idle the shortest
    assert roomy.take(list(range(10, 60)) + [7]) is a  # a's conversation goes on: a, whatever came after
    roomy.close()
    tight = edge(0)  # no room to keep a conversation: only the newest idle client stays
    a, b = tight.take(), tight.take()
    assert a.drafter.held_bytes() > 0
    tight.release(a)
    tight.release(b)
    assert tight.take() is b and tight.take() is not a
    tight.close()


def test_a_drafter_fed_hidden_states_gets_the_reused_prefixs_too(int8_target):
    """EAGLE reads the target's final states (payload form hidden): a reused prefix brings the states kept with it,
    so its drafts, and the output, are as with a cold prefill."""
    from tests.test_eagle_independent import make_drafter as eagle_drafter
    from tests.test_eagle_independent import make_model

    shared = Shared(None, int8_target.tokenizer, int8_target.fingerprint)
    runs = {}
    for mb in (0, 64):
        with served(int8_target, max_context=512, prefix_cache_mb=mb) as (address, service):
            drafter = eagle_drafter(make_model(int8_target, "eagle"), width=2, depth=3)
            with Client(ClientOptions(server=address, static=True), shared, drafter) as client:
                def turn(prompt, n, client=client, service=service):
                    wait_until(lambda: len(service.sessions) == 0)
                    gen = client.generate(prompt, n)
                    assert gen.spec.form == "hidden"
                    return gen.token_ids

                runs[mb] = (conversation(turn, int8_target.tokenizer), service.prefixes.hit_tokens)
    assert runs[0][0] == runs[64][0] and runs[0][1] == 0 and runs[64][1] > 0


@pytest.mark.parametrize("kind,opening", [("eagle", "open"), ("moa", "open"), ("eagle", "stream"), ("moa", "stream")])
def test_a_feature_drafters_next_turn_gets_only_the_new_features_and_drafts_as_a_cold_one(int8_target, kind, opening):
    """EAGLE and MoA keep the last turn's features and their own caches: the opening asks the server for the features
    after them only (``payload_from``), and every tree of the turn is the one a cold drafter, sent them all, drafts."""
    from client.drafters.eagle import EagleDrafter
    from client.drafters.moa import MoADrafter
    from tests.test_eagle_independent import make_model
    from tests.test_moa import make_moa

    def fresh():
        if kind == "eagle":
            return EagleDrafter(make_model(int8_target, "eagle"), width=2, depth=3)
        return MoADrafter(make_moa(int8_target, 1), width=2, depth=3)

    ids = int8_target.tokenizer(WORDS)["input_ids"]
    with served(int8_target, max_context=512) as (address, _):
        remotes = [RemoteVerifier(Endpoint(address)) for _ in range(2)]
        try:
            warm, cold = fresh(), fresh()
            first = generate(remotes[0], warm, ids[:30], 10).token_ids
            turn2 = ids[:30] + first + ids[30:40]
            spec = first_spec(remotes[0], warm.payload_specs())
            held = warm.keep_for(turn2)
            assert held == 30 + len(first) - 1  # all but the answer's last token, whose features never came
            sent, starts = [], []
            for drafter, remote, kept in ((warm, remotes[0], held), (cold, remotes[1], 0)):
                before = remote.counters.prefill_payload_bytes
                if opening == "open":
                    opened = remote.open(turn2, SamplingParams(), spec=spec, held=kept)
                    drafter.begin(turn2 + opened.new_tokens, opened.features)
                    starts.append(opened.features.start)
                else:  # a Decode that opens: the first chunk brings no features, a later one the prompt's
                    chunks = remote.open_decode(turn2, SamplingParams(), 3, [], spec=spec, held=kept)
                    opened = next(chunks)
                    drafter.begin(turn2 + opened.new_tokens, opened.features)
                    for verdict in chunks:
                        drafter.absorb(verdict.new_tokens, verdict.features)
                        if verdict.features is not None and len(starts) == len(sent):  # the first features
                            starts.append(verdict.features.start)
                sent.append(remote.counters.prefill_payload_bytes - before)
            assert starts == [held, 0] and 0 < sent[0] < sent[1]  # the features of the 11 new tokens on, not of all
            for _ in range(4):  # every tree the same, and the verdicts fed alike
                tree = warm.propose(8)
                assert (tree.tokens, tree.parents) == ((t := cold.propose(8)).tokens, t.parents) and len(tree)
                for drafter, remote in ((warm, remotes[0]), (cold, remotes[1])):
                    verdict = remote.verify(tree, spec=spec)
                    drafter.absorb(verdict.new_tokens, verdict.features)
        finally:
            for remote in remotes:
                remote.shutdown()


def test_the_prefix_cache_takes_at_most_a_share_of_the_host_memory_available(int8_target, monkeypatch):
    """``--prefix-cache-mb`` is a ceiling: a host with less memory to spare gets ``PREFIX_SHARE`` of what it has."""
    import server.service

    assert server.service.host_free_bytes() > 2**20  # this machine's, read from /proc/meminfo
    for host, want in ((64 * 2**20, int(64 * 2**20 * server.service.PREFIX_SHARE)), (64 * 2**30, 1024 * 2**20)):
        monkeypatch.setattr(server.service, "host_free_bytes", lambda host=host: host)
        with served(int8_target, max_context=512, prefix_cache_mb=1024) as (_, service):
            assert service.prefixes.max_bytes == want
