"""Private prompt spans: masking and rendering, and the guarantee checked on every byte that crosses the link."""

from __future__ import annotations

import io
import json
import random
import socket
import threading

import pytest

from client.apps.private import mask, mask_messages
from client.drafters.base import NoDrafter
from client.drafters.moa import MoADrafter
from client.drafters.prompt_lookup import PromptLookup
from client.loop.decode import Settings, generate
from client.loop.offline import Backoff, Resilience
from client.net.remote import RemoteVerifier
from client.verifiers import LocalVerifier
from shared.engine.models import encode_messages, encode_prompt
from shared.payload import PayloadSpec
from shared.wire import splitspec_pb2 as pb
from tests.conftest import start_server
from tests.test_cli import splitspec
from tests.test_moa import make_moa
from tests.test_resilient import cut_on_round

# ---------------------------------------------------------------------------------------------- masking, rendering


def test_spans_and_literals_become_placeholders_and_render_back():
    text = "Dear <private>Ann Lee</private>, your PIN 4711 is ready. Ann Lee, keep 4711 safe."
    masked, secrets = mask(text, ["4711"])
    assert masked == "Dear [PRIVATE_1], your PIN [PRIVATE_2] is ready. [PRIVATE_1], keep [PRIVATE_2] safe."
    assert len(secrets) == 2 and secrets  # a marked text is masked wherever it occurs, marked or not
    assert secrets.render(masked) == text.replace("<private>", "").replace("</private>", "")
    assert secrets.render("Hello [PRIVATE_1]!") == "Hello Ann Lee!"  # where the target copied the placeholder
    assert "Ann" not in repr(secrets) and "4711" not in repr(secrets)
    plain, none = mask("nothing private here [PRIVATE_1]")
    assert plain == "nothing private here [PRIVATE_1]" and not none and none.render(plain) == plain


def test_markers_are_case_insensitive_span_lines_and_leave_the_whitespace_around():
    masked, secrets = mask("a <PRIVATE>b\nc</Private> d")
    assert masked == "a [PRIVATE_1] d" and secrets.render(masked) == "a b\nc d"
    masked, secrets = mask("Dear <private> Ann\n</private>, Ann")  # the text is what else is masked: "Ann"
    assert masked == "Dear  [PRIVATE_1]\n, [PRIVATE_1]" and secrets.render(masked) == "Dear  Ann\n, Ann"


def test_placeholders_written_in_the_input_are_not_reused():
    text = "[PRIVATE_1] and [PRIVATE_3] are mine; <private>x1</private> and <private>x2</private> are secret"
    masked, secrets = mask(text)
    assert masked == "[PRIVATE_1] and [PRIVATE_3] are mine; [PRIVATE_2] and [PRIVATE_4] are secret"
    assert secrets.placeholders == ["[PRIVATE_2]", "[PRIVATE_4]"]
    assert secrets.render(masked) == "[PRIVATE_1] and [PRIVATE_3] are mine; x1 and x2 are secret"


def test_overlapping_and_nested_private_texts_are_masked_as_one():
    masked, secrets = mask("abcde and abc and John Smithson", ["abc", "cde", "John Smith"])
    assert masked == "[PRIVATE_1] and [PRIVATE_2] and [PRIVATE_3]son"  # no byte of "cde" stays in sight
    assert secrets.render(masked) == "abcde and abc and John Smithson"
    masked, _ = mask("Smith, John Smith", ["Smith", "John Smith"])  # the longer text wins where both start
    assert masked == "[PRIVATE_1], [PRIVATE_2]"


@pytest.mark.parametrize(
    "text, literals, message",
    [
        ("a <private>secret", (), "prompt: <private> at character 2 is never closed"),
        ("a secret</private>", (), "prompt: </private> at character 8 closes no <private>"),
        ("<private>se<private>cret</private></private>", (), "inside the span opened at character 0"),
        ("a <private> \n</private> b", (), "prompt: the private span at character 2 is empty"),
        ("a secret", ["secret", " "], "private text #2 must be non-blank text, got ' '"),
    ],
)
def test_malformed_spans_are_errors_naming_where_never_what(text, literals, message):
    with pytest.raises(ValueError, match=message) as err:
        mask(text, literals)
    assert "secret" not in str(err.value)  # errors end up in logs


def test_messages_are_masked_as_one_conversation():
    messages = [
        {"role": "system", "content": "99-1234", "private": True},
        {"role": "user", "content": "Is <private>Ann</private> on account 99-1234?", "name": "u"},
        {"role": "assistant", "content": "Ann is.", "private": False},
    ]
    masked, secrets = mask_messages(messages)
    assert masked == [
        {"role": "system", "content": "[PRIVATE_1]"},
        {"role": "user", "content": "Is [PRIVATE_2] on account [PRIVATE_1]?", "name": "u"},
        {"role": "assistant", "content": "[PRIVATE_2] is."},
    ]
    assert messages[0]["private"] is True  # the caller's messages are left as they were
    assert [secrets.render(m["content"]) for m in masked] == ["99-1234", "Is Ann on account 99-1234?",
                                                              "Ann is."]  # fmt: skip
    with pytest.raises(ValueError, match=r"messages\[1\].content: <private> at character 0 is never closed"):
        mask_messages([{"role": "user", "content": "hi"}, {"role": "user", "content": "<private>x"}])
    with pytest.raises(ValueError, match=r"messages\[0\].content: a private message must have text"):
        mask_messages([{"role": "user", "content": " ", "private": True}])
    with pytest.raises(ValueError, match=r"messages\[0\].content must be a string, got list"):
        mask_messages([{"role": "user", "content": [{"type": "text", "text": "x"}]}])


def test_a_stream_never_shows_half_a_placeholder_nor_a_placeholder_for_a_secret():
    texts = [f"w{i}" for i in range(12)]  # 12 secrets: [PRIVATE_1] is a prefix of [PRIVATE_1x] until its "]"
    _, secrets = mask(" ".join(f"<private>{t}</private>" for t in texts))
    output = "a [PRIVATE_1] b [PRIVATE_12][PRIVATE_10] [PRIV [PRIVATE_99] c [PRIVATE_"  # target text, as it streams
    rendered = secrets.render(output)
    assert rendered == "a w0 b w11w9 [PRIV [PRIVATE_99] c [PRIVATE_"
    rng = random.Random(0)
    for trial in range(200):
        cuts = sorted(rng.sample(range(1, len(output)), rng.randint(0, 12))) if trial else list(range(1, len(output)))
        renderer, shown = secrets.renderer(), ""
        for a, b in zip([0, *cuts], [*cuts, len(output)], strict=True):
            shown += renderer.feed(output[a:b])
            assert rendered.startswith(shown), (trial, shown)  # what is shown is final: never a placeholder
        assert shown + renderer.flush() == rendered
    stream = mask("no secrets")[1].renderer()
    assert stream.feed("[PRIVATE_") == "[PRIVATE_" and stream.flush() == ""  # nothing to wait for


class Pieces:
    """A tokenizer stand-in for TextPrinter: token i decodes to PIECES[i]."""

    PIECES = ["Dear ", "[PRIV", "ATE_", "1", "]", ", hi", "[PRIVATE_2", "]", "."]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.PIECES[i] for i in ids)


def test_the_cli_stream_renders_placeholders_split_across_tokens():
    from client.apps.cli import SettledPrinter, TextPrinter

    _, secrets = mask("<private>Ann</private> <private>Bo</private>")
    out = io.StringIO()
    stream = SettledPrinter(TextPrinter(Pieces(), out, secrets.renderer()), final_offline=False, status=io.StringIO())
    tokens = list(range(len(Pieces.PIECES)))
    for n in range(1, len(tokens) + 1):
        stream(tokens[:n], [True] * n)
        assert "Dear Ann, hiBo.".startswith(out.getvalue())  # never a piece of a placeholder
    stream.finish(tokens, [True] * len(tokens))
    assert out.getvalue() == "Dear Ann, hiBo."


# ------------------------------------------------------------------------------- the guarantee, on the link's bytes


class RecordingProxy:
    """A loopback TCP relay that keeps every byte it passes, both ways; ``cut`` closes its connections and refuses
    new ones (accepts and closes them) until ``restore``, as netsim's cut does."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sent, self.received = bytearray(), bytearray()  # client to server, server to client
        self.lock = threading.Lock()
        self.live: set[socket.socket] = set()
        self.down = self.closed = False
        self.acceptor = threading.Thread(target=self._accept, daemon=True, name="recording-proxy")
        self.acceptor.start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            client.settimeout(None)
            try:
                if self.down:
                    raise ConnectionRefusedError("the link is cut")
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.live |= {client, server}
            for src, dst, record in ((client, server, self.sent), (server, client, self.received)):
                threading.Thread(target=self._pump, args=(src, dst, record), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bytearray) -> None:
        try:
            while data := src.recv(65536):
                with self.lock:
                    record.extend(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._close(src, dst)

    def _close(self, *sockets: socket.socket) -> None:
        for s in sockets:
            with self.lock:
                self.live.discard(s)
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes the pump blocked on it
            except OSError:
                pass
            s.close()

    def cut(self, silent: bool = False) -> None:
        assert not silent, "this proxy only cuts by closing"
        self.down = True
        with self.lock:
            live = list(self.live)
        self._close(*live)

    def restore(self) -> None:
        self.down = False

    def close(self) -> None:
        self.cut()
        self.closed = True
        self.acceptor.join()
        self.listener.close()


@pytest.fixture(scope="module")
def recording_server(tiny_target):
    """A server of its own that keeps every request it received (handlers wrapped before they are registered)."""
    import server.service as service_module

    received: list = []

    def recorded(handler):
        def handle(request, context):
            received.append(request)
            return handler(request, context)

        return handle

    class Recording(service_module.SplitSpecService):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            for method in pb.DESCRIPTOR.services_by_name["SplitSpec"].methods:
                setattr(self, method.name, recorded(getattr(self, method.name)))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(service_module, "SplitSpecService", Recording)
        server, address, _ = start_server(tiny_target, max_sessions=32, max_tree_nodes=16, max_context=128,
                                          session_ttl_s=60.0)  # fmt: skip
    yield address, received
    server.stop(grace=None)


SECRET = "w201 w202 w203 w204 w205"  # words of the tiny vocabulary: the span has real token ids
PROMPTS = {
    "text": f"w5 w9 w14 <private>{SECRET}</private> w5 w9 w21 w33 w40 {SECRET} w41 w5 w9",
    "chat": [{"role": "system", "content": SECRET, "private": True},
             {"role": "user", "content": f"w5 w9 w14 w5 w9 w21 <private>{SECRET}</private> w33 w5 w9"}],
}  # fmt: skip
NEW = 32


def masked_prompt(tokenizer, name: str):
    """The prompt's ids after masking, its secrets, and the ids it would have had unmasked."""
    prompt = PROMPTS[name]
    if name == "chat":
        masked, secrets = mask_messages(prompt)
        unmasked = [{"role": m["role"], "content": m["content"].replace("<private>", "").replace("</private>", "")}
                    for m in prompt]  # fmt: skip
        return encode_messages(tokenizer, masked), secrets, encode_messages(tokenizer, unmasked)
    masked, secrets = mask(prompt)
    return encode_prompt(tokenizer, masked, False), secrets, encode_prompt(tokenizer, secrets.render(masked), False)


def varints(ids: list[int]) -> bytes:
    """``ids`` as protobuf packs a repeated int field: how they would look on the wire."""
    out = bytearray()
    for v in ids:
        while v >= 0x80:
            out.append(v & 0x7F | 0x80)
            v >>= 7
        out.append(v)
    return bytes(out)


def has_run(seq, run: list[int]) -> bool:
    seq = list(seq)
    return any(seq[i : i + len(run)] == run for i in range(len(seq) - len(run) + 1))


def token_lists(request) -> list[list[int]]:
    """Every repeated integer field of a request (prompt ids, draft trees, settlement chains, ...)."""
    return [list(v) for f, v in request.ListFields() if f.is_repeated and isinstance(v[0], int)]


def remote_run(tiny_target, address: str, ids: list[int], drafter: str):
    """One generation through a recording proxy whose link is cut at the third round for 0.3 s."""
    proxy = RecordingProxy(address)
    spec = PayloadSpec("kv", "fp16") if drafter == "moa" else PayloadSpec()
    made = {"none": NoDrafter, "prompt-lookup": PromptLookup,
            "moa": lambda: MoADrafter(make_moa(tiny_target, 1), width=3, depth=3)}[drafter]()  # fmt: skip
    verifier = RemoteVerifier(proxy.address, spec=spec)
    try:
        cut_on_round(verifier, proxy, 3, 0.3)
        resilience = Resilience(backoff=Backoff(base_s=0.02, cap_s=0.2, seed=1), max_offline_s=30)
        gen = generate(verifier, made, ids, NEW, Settings(max_tree_nodes=8, resilience=resilience))
    finally:
        verifier.shutdown()
        proxy.close()
    return gen, bytes(proxy.sent), bytes(proxy.received)


@pytest.mark.parametrize("drafter", ["none", "prompt-lookup", "moa"])
@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_no_byte_of_a_private_span_crosses_the_link(tiny_target, recording_server, prompt, drafter):
    """Across a cut and the settlement after it: the link carries neither the private text nor its token ids,
    no request the server received holds them, and the answer is the target's own on the masked prompt."""
    address, received = recording_server
    tokenizer = tiny_target.tokenizer
    secret_ids = tokenizer(SECRET)["input_ids"]
    ids, secrets, unmasked = masked_prompt(tokenizer, prompt)
    assert len(secret_ids) == 5 and has_run(unmasked, secret_ids) and not has_run(ids, secret_ids)
    local = generate(LocalVerifier(tiny_target), NoDrafter(), ids, NEW)
    assert not has_run(local.token_ids, secret_ids)  # else the target itself would say it: nothing to test

    first = len(received)
    gen, sent, got = remote_run(tiny_target, address, ids, drafter)
    requests = received[first:]

    for wire in (sent, got):
        assert SECRET.encode() not in wire and varints(secret_ids) not in wire
    assert any(isinstance(r, pb.OpenSessionRequest) and list(r.prompt_ids) == ids for r in requests)
    assert not any(has_run(tokens, secret_ids) for r in requests for tokens in token_lists(r))
    s = gen.stats
    assert s.disconnects >= 1 and s.reconnects == s.disconnects
    if drafter == "moa":  # the drafter always has a token to offer: offline generation and a settlement chain
        assert s.offline_tokens >= 1 and s.settle_calls >= 1
    assert gen.token_ids == local.token_ids and all(gen.verified)
    decode = tokenizer.decode
    assert secrets.render(decode(gen.token_ids, skip_special_tokens=True)) == secrets.render(
        decode(local.token_ids, skip_special_tokens=True))  # fmt: skip


def test_the_recorder_sees_an_unmasked_prompt(tiny_target, recording_server):
    """The control: the same prompt sent unmasked is caught both on the link and by the server."""
    address, received = recording_server
    secret_ids = tiny_target.tokenizer(SECRET)["input_ids"]
    _, _, unmasked = masked_prompt(tiny_target.tokenizer, "text")
    first = len(received)
    _, sent, _ = remote_run(tiny_target, address, unmasked, "prompt-lookup")
    assert varints(secret_ids) in sent
    assert any(has_run(tokens, secret_ids) for r in received[first:] for tokens in token_lists(r))


# ------------------------------------------------------------------------------------------------------- the CLI


def test_cli_generate_masks_the_prompt_and_renders_the_answer(tiny_model_dir, tiny_target):
    prompt = "w1 w2 <private>w7 w8</private> w3 w1 w2 w9 w10 w11"
    common = ["generate", "--local", "--model", str(tiny_model_dir), "--prompt", prompt, "--private", "w9 w10",
              "--chat", "--max-new-tokens", "12", "--dtype", "float32"]  # fmt: skip
    masked, secrets = mask(prompt, ["w9 w10"])
    assert masked == "w1 w2 [PRIVATE_1] w3 w1 w2 [PRIVATE_2] w11"
    expected = generate(LocalVerifier(tiny_target), NoDrafter(), encode_prompt(tiny_target.tokenizer, masked, True), 12)
    text = secrets.render(tiny_target.tokenizer.decode(expected.token_ids, skip_special_tokens=True))

    proc = splitspec(*common, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["token_ids"] == expected.token_ids and out["text"] == text and out["private_spans"] == 2
    proc = splitspec(*common)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == text + "\n" and "w7" not in proc.stderr and "w9" not in proc.stderr


def test_cli_a_malformed_span_is_one_clear_line_without_the_private_text(tiny_model_dir, capsys):
    from shared.cli import main

    assert main(["generate", "--local", "--model", str(tiny_model_dir), "--prompt", "w1 <private>w7 w8"]) == 2
    err = capsys.readouterr().err
    assert err == "splitspec: error: prompt: <private> at character 3 is never closed; end the span with </private>\n"
