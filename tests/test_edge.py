"""`splitspec edge` as apps use it: the official `openai` client over a real socket, against a tiny server."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from concurrent import futures

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.apps.edge import app
from client.apps.edge_pool import Edge
from client.apps.text import TextDeltas
from client.drafters.moa import MoADrafter
from netsim import simulated_link
from tests.conftest import served, start_server, wait_until
from tests.test_cli import splitspec
from tests.test_moa import make_moa

PROMPT = "w5 w9 w14 w5 w9 w21 w33 w40 w41 w5 w9"


def plain(url: str, method: str = "GET", body: bytes | None = None, timeout: float = 30):
    """(status, decoded JSON or text) of one plain HTTP request."""
    host, path = url.removeprefix("http://").split("/", 1)
    conn = http.client.HTTPConnection(host, timeout=timeout)
    conn.request(method, "/" + path, body, {"Content-Type": "application/json"} if body else {})
    reply = conn.getresponse()
    data = reply.read().decode()
    conn.close()
    try:
        return reply.status, json.loads(data)
    except ValueError:
        return reply.status, data


def serve(edge: Edge):
    """The edge's app on a free loopback port, in a thread; yields its /v1 URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app(edge), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


@pytest.fixture(scope="module")
def tiny_server(tiny_target):
    with served(tiny_target, max_sessions=16, max_tree_nodes=16, max_context=256, session_ttl_s=60.0) as running:
        yield running


@pytest.fixture(scope="module")
def edge_url(tiny_server, tiny_model_dir):
    edge = Edge(tiny_server[0], "prompt-lookup", model=str(tiny_model_dir))
    server, thread, url = serve(edge)
    yield url
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def client(edge_url):
    return openai.OpenAI(base_url=edge_url, api_key="unused", max_retries=0, timeout=60)


def cli_text(tiny_server, tiny_model_dir, chat: bool, tokens: int = 24) -> str:
    args = ["generate", "--prompt", PROMPT, "--json", "--server", tiny_server[0], "--model",
            str(tiny_model_dir), "--max-new-tokens", str(tokens), *(["--chat"] if chat else [])]  # fmt: skip
    out = splitspec(*args)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["text"]


def test_streamed_chat_equals_generate_and_reports_usage(client, tiny_server, tiny_model_dir):
    want = cli_text(tiny_server, tiny_model_dir, chat=True)
    stream = client.chat.completions.create(
        model=str(tiny_model_dir), messages=[{"role": "user", "content": PROMPT}], max_tokens=24, temperature=0,
        stream=True, stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want and text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    usage = chunks[-1].usage
    assert usage.completion_tokens <= 24 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    assert chunks[-1].model_extra["splitspec"]["server_calls"] >= 1


def test_plain_chat_and_completions_equal_generate(client, tiny_server, tiny_model_dir):
    reply = client.chat.completions.create(model=str(tiny_model_dir), messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=24, temperature=0)  # fmt: skip
    assert reply.choices[0].message.content == cli_text(tiny_server, tiny_model_dir, chat=True)
    made = reply.model_extra["splitspec"]
    assert reply.usage.completion_tokens >= 1 and made["rounds"] + made["streamed_tokens"] >= 1
    done = client.completions.create(model=str(tiny_model_dir), prompt=PROMPT, max_tokens=24, temperature=0)
    assert done.choices[0].text == cli_text(tiny_server, tiny_model_dir, chat=False)
    streamed = client.completions.create(model=str(tiny_model_dir), prompt=PROMPT, max_tokens=24, temperature=0,
                                         stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text


def test_a_stop_sequence_ends_the_text_before_it(client, tiny_model_dir):
    def ask(**kw):
        return client.completions.create(model=str(tiny_model_dir), prompt=PROMPT, max_tokens=24, temperature=0, **kw)

    full = ask().choices[0].text
    words = full.split()
    assert len(words) > 4
    stop = words[3]
    cut = ask(stop=[stop, "never-there"])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_sampling_with_a_seed_is_reproducible(client, tiny_model_dir):
    def ask():
        return client.completions.create(model=str(tiny_model_dir), prompt=PROMPT, max_tokens=16, temperature=1.0,
                                          top_p=0.9, seed=11).choices[0].text  # fmt: skip

    assert ask() == ask()


def test_typical_acceptance_is_opt_in_and_named_in_the_reply(client, tiny_model_dir):
    """``"splitspec": {"acceptance": "typical"}`` samples under Medusa's rule; the reply says which rule made it."""
    def ask(**extension):
        return client.completions.create(model=str(tiny_model_dir), prompt=PROMPT, max_tokens=8, temperature=1.0,
                                         seed=3, extra_body={"splitspec": extension})  # fmt: skip

    assert ask().model_extra["splitspec"]["acceptance"] == "exact"
    typical = ask(acceptance="typical")
    assert typical.model_extra["splitspec"]["acceptance"] == "typical" and typical.usage.completion_tokens == 8
    with pytest.raises(openai.BadRequestError) as info:
        ask(acceptance="medusa")
    assert "splitspec.acceptance must be one of exact, typical" in info.value.body["message"]


def test_bad_requests_get_openai_shaped_errors(client, edge_url, tiny_model_dir):
    model = str(tiny_model_dir)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "w1"}])
    assert info.value.body["code"] == "model_not_found" and "gpt-17" in info.value.body["message"]
    for bad in ({"temperature": 5}, {"max_tokens": 0}, {"n": 2}, {"top_p": "x"}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "w1"}], **bad)
        assert info.value.body["param"] == next(iter(bad)) and info.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[{"role": "robot", "content": "w1"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[])
    status, body = plain(f"{edge_url}/chat/completions", "POST", b"{not json")
    assert status == 400 and "not JSON" in body["error"]["message"]
    assert plain(f"{edge_url}/chat/completions")[0] == 405
    status, body = plain(f"{edge_url}/nowhere")
    assert status == 404 and body["error"]["type"] == "invalid_request_error"


HOSTILE = [  # (route, body): each must be answered with an OpenAI-shaped 4xx, never a 5xx or a generation
    ("chat/completions", b"{not json"),
    ("chat/completions", b"[]"),
    ("chat/completions", b'"hello"'),
    ("chat/completions", b"\xff\xfe\x00"),
    ("chat/completions", {}),
    ("chat/completions", {"messages": "w1"}),
    ("chat/completions", {"messages": [{"role": "user", "content": 7}]}),
    ("chat/completions", {"messages": [{"role": "robot", "content": "w1"}]}),
    ("chat/completions", {"messages": [{"role": "user", "content": "w1"}], "max_tokens": 10**12}),
    ("chat/completions", {"messages": [{"role": "user", "content": "w1"}], "max_tokens": -1}),
    ("chat/completions", {"messages": [{"role": "user", "content": "w1"}], "max_tokens": "10"}),
    ("chat/completions", {"messages": [{"role": "user", "content": "w1"}], "temperature": 1e309}),
    ("chat/completions", {"messages": [{"role": "user", "content": "w1"}], "top_p": 0}),
    ("chat/completions", {"messages": [{"role": "user", "content": "w1"}], "n": 5}),
    ("chat/completions", {"messages": [{"role": "user", "content": "w1"}], "stop": ["a", "b", "c", "d", "e"]}),
    ("chat/completions", {"messages": [{"role": "user", "content": "w1"}], "stream_options": 3}),
    ("chat/completions", {"messages": [{"role": "user", "content": "w1"}], "seed": -5}),
    ("chat/completions", {"messages": [{"role": "user", "content": "w1"}], "splitspec": {"acceptance": "any"}}),
    ("completions", {"prompt": [10**9]}),
    ("completions", {"prompt": None}),
    ("completions", {"prompt": "w1", "model": "gpt-17"}),
    ("completions", b"{" + b'"prompt": "' + b"w" * (5 << 20) + b'"}'),
]


@pytest.mark.parametrize("route, body", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_requests_get_openai_shaped_4xx(edge_url, tiny_model_dir, route, body):
    if isinstance(body, dict):
        body = json.dumps({"model": str(tiny_model_dir), **body}).encode()
    status, reply = plain(f"{edge_url}/{route}", "POST", body, timeout=60)
    assert 400 <= status < 500, (status, reply)
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error


def test_models_health_and_metrics(client, edge_url, tiny_model_dir):
    assert [m.id for m in client.models.list()] == [str(tiny_model_dir)]
    root = edge_url.removesuffix("/v1")
    health = plain(f"{root}/health")[1]
    assert health["status"] == "ok" and health["server_serving"] is True
    client.completions.create(model=str(tiny_model_dir), prompt=PROMPT, max_tokens=4, temperature=0)
    metrics = plain(f"{root}/metrics/")[1]
    assert 'splitspec_edge_requests_total{route="completions",status="200"}' in metrics
    assert "splitspec_edge_tokens_total" in metrics


def test_several_requests_at_once(client, tiny_model_dir):
    results = {}

    def ask(i):
        results[i] = client.completions.create(model=str(tiny_model_dir), prompt=PROMPT, max_tokens=16,
                                               temperature=0).choices[0].text  # fmt: skip

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 3 and len(set(results.values())) == 1


def test_a_cut_during_a_streamed_reply_still_ends_exactly(tiny_target, tiny_server, tiny_model_dir, netsim_server):
    """The link to the server is cut once the answer streams and restored 0.5 s later: offline generation
    (MoA TLI) bridges it, the server verifies the offline tokens, and the stream ends with the exact greedy
    text and [DONE]."""
    want = cli_text(tiny_server, tiny_model_dir, chat=False, tokens=48)
    with simulated_link(tiny_server[0], "5g", netsim=netsim_server) as link:  # real RTTs: rounds remain at the cut
        edge = Edge(link.address, lambda: MoADrafter(make_moa(tiny_target, 1), width=3, depth=3),
                    model=str(tiny_model_dir))  # fmt: skip
        server, thread, url = serve(edge)
        try:
            body = {"model": str(tiny_model_dir), "prompt": PROMPT, "max_tokens": 48, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
            events, cut = [], False
            conn = http.client.HTTPConnection(url.removeprefix("http://").split("/")[0], timeout=60)
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            reply = conn.getresponse()
            assert reply.status == 200
            while line := reply.readline():
                line = line.decode().strip()
                if not line.startswith("data: "):
                    continue
                events.append(line.removeprefix("data: "))
                if not cut and len(events) == 2:  # the answer streams: cut the link
                    link.cut()
                    threading.Timer(0.5, link.restore).start()
                    cut = True
            conn.close()
        finally:
            server.should_exit = True
            thread.join(timeout=10)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == want
    stats = chunks[-1]["splitspec"]
    assert stats["disconnects"] >= 1 and stats["offline_tokens"] >= 1 and stats["unverified_tokens"] == 0


def test_settled_text_holds_back_what_may_change():
    class Words:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(f"w{i}" for i in ids)

    s = TextDeltas(Words(), stop=["w7 w8"], final_offline=False)
    assert s.update([1, 2, 3], [True, True, False]).settled == "w1 w2"  # the offline token waits
    assert s.update([1, 2, 3, 7], [True] * 4).settled == " w3 "  # "w7" may begin the stop sequence: held back
    assert s.update([1, 2, 3, 7, 9], [True] * 5).settled == "w7 w9"
    assert not s.stopped
    assert s.update([1, 2, 3, 7, 9, 7, 8, 5], [True] * 8).settled == " " and s.stopped
    assert s.update([1, 2, 3, 7, 9, 7, 8, 5, 6], [True] * 9).settled == ""


def test_private_spans_never_reach_the_prompt_the_server_gets(tiny_server, tiny_model_dir):
    """The edge masks markers in any message and whole messages flagged private before encoding."""
    from client.apps.openai_request import parse

    edge = Edge(tiny_server[0], "none", model=str(tiny_model_dir))
    body = {"model": str(tiny_model_dir), "messages": [
        {"role": "system", "content": "w77 w78", "private": True},
        {"role": "user", "content": "w5 <private>w99</private> w6"}]}  # fmt: skip
    ids, secrets = edge.prompt_ids(parse(body, chat=True, model=str(tiny_model_dir)))
    vocab = edge.tokenizer.get_vocab()
    assert not {vocab["w77"], vocab["w78"], vocab["w99"]} & set(ids) and vocab["w5"] in ids
    assert secrets.render("[PRIVATE_1] [PRIVATE_2]") == "w77 w78 w99"


def test_the_edge_command_serves_until_stopped(tiny_server, tiny_model_dir):
    """`splitspec edge` as a process: it announces its URL, answers, and stops on SIGTERM."""
    import signal
    import subprocess
    import sys

    from tests.test_cli import ROOT

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "edge", "--server", tiny_server[0], "--model",
                             str(tiny_model_dir), "--port", str(port)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert f"http://127.0.0.1:{port}/v1" in proc.stdout.readline()
        deadline, status = time.monotonic() + 30, None
        while status != 200 and time.monotonic() < deadline:
            try:
                status, body = plain(f"http://127.0.0.1:{port}/v1/models")
            except OSError:
                time.sleep(0.1)
        assert status == 200 and body["data"][0]["id"] == str(tiny_model_dir)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)


class ScriptedEdge:
    """An ``Edge`` whose generation is a script of the decode loop's updates: two tokens verified, the link cut
    (two offline tokens), the server back (it keeps the first offline token and replaces the second), one more."""

    def __init__(self, model_dir):
        from client.apps.edge_pool import Counters
        from client.loop.offline import Resilience
        from shared.engine.models import load_tokenizer

        self.tokenizer, self.model, self.drafter_name = load_tokenizer(str(model_dir)), str(model_dir), "scripted"
        self.resilience, self.counters = Resilience(), Counters()
        a, b, c, d, e, f = self.tokenizer.convert_tokens_to_ids(["w1", "w2", "w3", "w4", "w5", "w6"])
        self.script = [([a, b], [True] * 2), ([a, b, c], [True, True, False]),
                       ([a, b, c, d], [True, True, False, False]), ([a, b, c, e], [True] * 4),
                       ([a, b, c, e, f], [True] * 5)]  # fmt: skip

    def prompt_ids(self, ask):
        from client.apps.private import Secrets

        return [0], Secrets()

    def generate(self, ask, prompt_ids, on_update, stop_when, on_start=lambda: None):
        from client.loop.decode import Generation, GenerationStats

        on_start()
        for tokens, verified in self.script:
            on_update(tokens, verified)
        return Generation(tokens, verified, "length", GenerationStats())


def test_provisional_text_streams_only_to_an_app_that_asks_for_it(tiny_model_dir):
    edge = ScriptedEdge(tiny_model_dir)
    server, thread, url = serve(edge)
    try:
        app = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "w1"}]
        plain_chunks = list(app.chat.completions.create(model=edge.model, messages=messages, stream=True))
        asked = list(app.chat.completions.create(model=edge.model, messages=messages, stream=True,
                                                 extra_body={"splitspec": {"provisional": True}}))  # fmt: skip
        with pytest.raises(openai.BadRequestError) as info:
            app.chat.completions.create(model=edge.model, messages=messages,
                                        extra_body={"splitspec": {"provisional": 1}})  # fmt: skip
        assert info.value.body["param"] == "splitspec"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    for chunks in (plain_chunks, asked):  # the content is the final text, the replaced offline token never in it
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "w1 w2 w3 w5 w6"
    assert not any((c.model_extra or {}).get("splitspec") for c in plain_chunks)
    assert not any("w4" in c.model_dump_json() for c in plain_chunks)
    extension = [c.model_extra["splitspec"] for c in asked if (c.model_extra or {}).get("splitspec")]
    assert [x["provisional"] for x in extension] == [" w3", " w3 w4", ""]  # shown, grown, then settled
    assert extension[0]["events"][0].startswith("no answer from the server: generating offline")
    assert extension[2]["events"] == ["server back: it verified the 2 offline tokens and kept the first 1"]


LONG_S = 600.0  # what a held check, a held generation and a check's deadline are given: longer than any test


class HeldHealth(health_pb2_grpc.HealthServicer):
    """A server's health service: SERVING at once until ``hold`` is set, then each check held until ``release`` (a
    server too busy to answer); ``asked`` counts the checks."""

    def __init__(self):
        self.hold, self.held, self.release = threading.Event(), threading.Event(), threading.Event()
        self.asked = 0

    def Check(self, request, context):
        self.asked += 1
        if self.hold.is_set():
            self.held.set()
            self.release.wait(LONG_S)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


@contextlib.contextmanager
def health_server(servicer: HeldHealth):
    """A gRPC server on a free loopback port with just ``servicer``: yields its address."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        servicer.release.set()
        server.stop(grace=None)


class HeldEdge(ScriptedEdge):
    """A ``ScriptedEdge`` whose generations stop after their first update until ``release`` is set: streams held open.
    Its /health checks the server at ``address``, a check waiting up to ``LONG_S`` for it."""

    def __init__(self, model_dir, address: str):
        from client.apps.edge_pool import ServerHealth
        from client.net.endpoint import Endpoint

        super().__init__(model_dir)
        self.server, self.health = address, ServerHealth(Endpoint(address), timeout_s=LONG_S)
        self.release = threading.Event()
        self.held = threading.Semaphore(0)  # one per generation that reached its hold

    def generate(self, ask, prompt_ids, on_update, stop_when, on_start=lambda: None):
        on_start()
        on_update(*self.script[0])
        self.held.release()
        self.release.wait(timeout=LONG_S)
        return super().generate(ask, prompt_ids, on_update, stop_when)


def test_health_answers_while_streams_and_the_servers_health_check_are_held(tiny_model_dir):
    """12 streams held mid-generation and the server holding every health check: /health answers all the same, from
    the latest check the server answered (SERVING) — it waits for neither: both are released only after it answered
    (asked on /health's own path, the check waited for the server, up to its deadline, and said it was not serving).
    The process has one more thread per stream (its generation's) and none more in the event loop's executor (a
    thread waiting per stream had /health wait for the streams to end)."""
    streams, checks = 12, HeldHealth()
    with health_server(checks) as address:
        edge = HeldEdge(tiny_model_dir, address)
        server, thread, url = serve(edge)
        root, texts, opened = url.removesuffix("/v1"), {}, threading.Semaphore(0)
        body = json.dumps({"model": edge.model, "prompt": "w1", "stream": True})

        def stream(i: int) -> None:
            conn = http.client.HTTPConnection(root.removeprefix("http://"), timeout=LONG_S)
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            reply, events = conn.getresponse(), []
            while len(events) < 100 and (line := reply.readline()) and line.strip() != b"data: [DONE]":
                if line.startswith(b"data: "):
                    events.append(json.loads(line.removeprefix(b"data: ")))
                    if len(events) == 1:
                        opened.release()
            conn.close()
            texts[i] = "".join(e["choices"][0]["text"] for e in events)

        clients = [threading.Thread(target=stream, args=(i,), name=f"test-stream-{i}", daemon=True)
                   for i in range(streams)]  # fmt: skip
        try:
            first = plain(f"{root}/health")[1]  # waits for the first check; the checking thread exists now
            assert first["server_serving"] is True and first["server_checked_s"] >= 0, first
            before = set(threading.enumerate())  # (the objects: a thread that ended may leave its ident to a new one)
            checks.hold.set()
            assert checks.held.wait(30), "no check reached the server after the hold"
            for t in clients:
                t.start()
            assert all(edge.held.acquire(timeout=30) for _ in range(streams)), "the generations did not all begin"
            assert all(opened.acquire(timeout=30) for _ in range(streams)), "the streams did not all open"
            status, health = plain(f"{root}/health", timeout=LONG_S)
            assert not edge.release.is_set() and not checks.release.is_set()  # answered with both still held
            new = [t.name for t in threading.enumerate() if t not in before and not t.name.startswith("test-")]
        finally:
            edge.release.set()
            checks.release.set()
            for t in clients:
                if t.ident is not None:  # started
                    t.join(timeout=30)
            server.should_exit = True
            thread.join(timeout=10)
            edge.health.close()
    assert status == 200 and health["server_serving"] is True, health
    assert new.count("splitspec-edge-generation") == streams
    assert [name for name in new if name.startswith("asyncio")] == []  # the loop's default executor did not grow
    assert texts == {i: "w1 w2 w3 w5 w6" for i in range(streams)}


def test_the_servers_health_is_checked_only_while_health_is_asked(tiny_model_dir):
    """``ServerHealth`` on a clock of the test's: it checks while /health was asked within ``idle_s``; then it stops,
    and the next /health waits for a fresh check rather than answer from a stale one."""
    from client.apps.edge_pool import ServerHealth
    from client.net.endpoint import Endpoint

    now, checks = [0.0], HeldHealth()
    with health_server(checks) as address:
        health = ServerHealth(Endpoint(address), every_s=0.01, idle_s=10.0, clock=lambda: now[0])
        try:
            assert health.latest().result(timeout=30) == (True, 0.0)  # the first check, made at once
            wait_until(lambda: health.checks >= 3)  # and more, while /health was asked within idle_s
            now[0] = 10.0  # idle_s since /health was last asked
            wait_until(lambda: not health._latest.done())  # stopped: the latest answer is stale
            asked = checks.asked
            assert health.latest().result(timeout=30) == (True, 10.0)  # a fresh check, made when asked again
            assert checks.asked > asked
        finally:
            health.close()


def test_requests_in_a_row_share_one_connection_until_it_breaks(tiny_target, tiny_model_dir, monkeypatch):
    """One Handshake on the server for several requests (streamed or not, chat or not); a connection that fails (the
    server went away) is closed, and the request after it opens a new one to the server back on the same port."""
    from server.limits import ServerLimits
    from server.service import SplitSpecService, build_server

    handshakes, real = [], SplitSpecService.Handshake

    def counted(self, request, context):
        handshakes.append(request.client)
        return real(self, request, context)

    monkeypatch.setattr(SplitSpecService, "Handshake", counted)
    limits = dict(max_sessions=4, max_tree_nodes=16, max_context=256, min_tree_nodes=16)
    grpc_server, address, _ = start_server(tiny_target, **limits)
    edge = Edge(address, "prompt-lookup", model=str(tiny_model_dir))
    server, thread, url = serve(edge)
    app = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
    model, messages = str(tiny_model_dir), [{"role": "user", "content": PROMPT}]
    try:
        first = app.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
        streamed = app.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == first
        app.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
        list(app.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0, stream=True))
        assert handshakes == ["splitspec"]
        grpc_server.stop(grace=None).wait(timeout=10)
        with pytest.raises(openai.APIStatusError) as info:
            app.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
        assert info.value.status_code == 502 and handshakes == ["splitspec"]
        port = int(address.rsplit(":", 1)[1])
        grpc_server, bound, _ = build_server(tiny_target, "127.0.0.1", port, ServerLimits(**limits))
        assert bound == port
        grpc_server.start()
        assert app.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text == first
        assert handshakes == ["splitspec"] * 2
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        grpc_server.stop(grace=None)
        edge.close()


def test_a_prompt_longer_than_the_context_is_openais_context_length_exceeded(client, edge_url, tiny_model_dir):
    """The server's context is 256 tokens: a longer prompt is a 400 ``context_length_exceeded`` before any stream
    begins (a 2 M-character prompt too), not a 502 from the server's refusal."""
    model = str(tiny_model_dir)
    long = " ".join(f"w{i % 200}" for i in range(300))
    asks = [lambda: client.completions.create(model=model, prompt=long, max_tokens=4),
            lambda: client.completions.create(model=model, prompt=long, max_tokens=4, stream=True),
            lambda: client.chat.completions.create(model=model, messages=[{"role": "user", "content": long}],
                                                   max_tokens=4, stream=True)]  # fmt: skip
    for i, ask in enumerate(asks):
        with pytest.raises(openai.BadRequestError) as info:
            ask()
        error = info.value.body
        assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error"
        assert "maximum context length is 256 tokens" in error["message"]
        assert error["param"] == ("messages" if i == 2 else "prompt")
        assert "your prompt is 300 tokens" in error["message"] or i == 2  # (the chat's template adds some)
    huge = json.dumps({"model": model, "prompt": "w1 " * 700_000, "max_tokens": 4}).encode()  # 2.1 M characters
    status, body = plain(f"{edge_url}/completions", "POST", huge, timeout=120)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert "your prompt is 700000 tokens" in body["error"]["message"]


def test_max_tokens_past_the_context_is_a_400_and_none_asked_fits(client, tiny_model_dir):
    """A ``max_tokens`` that cannot fit after the prompt (10**12: it once generated until the context was full) is
    OpenAI's 400 naming ``max_tokens``; a request that names none gets what fits."""
    model = str(tiny_model_dir)
    for huge in (10**12, 250):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=model, prompt=PROMPT, max_tokens=huge, temperature=0)
        error = info.value.body
        assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
        assert "maximum context length is 256 tokens" in error["message"]
        assert f"{huge} in the completion" in error["message"]
    near = " ".join(f"w{i % 200}" for i in range(250))  # 250 prompt tokens: 6 fit, fewer than the default 256
    done = client.completions.create(model=model, prompt=near, temperature=0)
    assert done.usage.completion_tokens <= 6 and done.choices[0].finish_reason in ("length", "stop")


def test_a_prompt_of_token_ids_is_the_prompt_they_encode(client, edge_url, tiny_model_dir):
    """``"prompt": [ids]`` (and a batch of one: ``[[ids]]``) completes as the text those ids encode; other shapes,
    and ids outside the vocabulary, are 400s naming the prompt."""
    from shared.engine.models import load_tokenizer

    model = str(tiny_model_dir)
    ids = load_tokenizer(model)(PROMPT)["input_ids"]

    def ask(prompt):
        return client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)

    want = ask(PROMPT)
    for prompt in (ids, [ids]):
        got = ask(prompt)
        assert got.choices[0].text == want.choices[0].text and got.choices[0].text
        assert got.usage.prompt_tokens == want.usage.prompt_tokens == len(ids)
    for bad in ([], [[]], [ids, ids], [1, "w1"], [-1], [1.5], [True], {"ids": ids}, [10**9]):
        status, body = plain(f"{edge_url}/completions", "POST", json.dumps({"model": model, "prompt": bad}).encode())
        assert status == 400 and body["error"]["param"] == "prompt", (bad, body)
        assert body["error"]["type"] == "invalid_request_error"
    assert "token id 1000000000 is outside the tokenizer's vocabulary" in body["error"]["message"]


def test_sigterm_ends_a_generation_waiting_for_a_vanished_server_and_the_edge_exits(
    tiny_server, netsim_server, tiny_model_dir
):
    """The link goes for good mid-stream and the generation waits for the server (up to 600 s by default); SIGTERM
    ends it — the stream gets its last chunk — and `splitspec edge` exits 0 instead of waiting with it: the process is
    waited for a tenth of what the generation would wait (a bounded wait, not a measurement)."""
    import signal
    import subprocess
    import sys

    from netsim.profiles import apply_profile
    from tests.test_cli import ROOT

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with simulated_link(tiny_server[0], "lte", netsim=netsim_server) as link:
        edge = subprocess.Popen([sys.executable, "-m", "shared.cli", "edge", "--server", link.address, "--model",
                                 str(tiny_model_dir), "--port", str(port), "--mode", "draft"], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            url, deadline, status = f"http://127.0.0.1:{port}/v1", time.monotonic() + 120, None
            while status != 200 and time.monotonic() < deadline and edge.poll() is None:
                try:
                    status, _ = plain(f"{url}/models", timeout=5)
                except OSError:
                    time.sleep(0.2)
            assert status == 200, "the edge never came up"
            first, chunks, failed = threading.Event(), [], []

            def stream():
                app = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
                try:
                    for chunk in app.completions.create(model=str(tiny_model_dir), prompt=PROMPT, max_tokens=200,
                                                        temperature=0, stream=True):  # fmt: skip
                        chunks.append(chunk)
                        first.set()
                except Exception as exc:  # noqa: BLE001 - reported below
                    failed.append(exc)
                    first.set()

            reader = threading.Thread(target=stream, daemon=True)
            reader.start()
            assert first.wait(60) and not failed, failed
            apply_profile(netsim_server.client, link.name, "offline")  # the server is gone, for good
            time.sleep(2.0)  # (not a bound: time for the edge to notice and park the generation)
            assert edge.poll() is None and reader.is_alive(), "the generation ended before the signal"
            edge.send_signal(signal.SIGTERM)
            code = edge.wait(timeout=60)  # (TimeoutExpired: the edge waited with the generation)
            reader.join(timeout=30)
        finally:
            if edge.poll() is None:
                edge.kill()
                edge.wait()
    assert code == 0, edge.stderr.read()[-2000:]
    assert not reader.is_alive() and not failed, failed
    assert chunks[-1].choices[0].finish_reason is not None  # a clean end, not a cut connection
