"""Hostile requests against a running server, while a canary session keeps decoding: nothing may break.

Random and hostile requests on every RPC — garbage bytes, NaN/inf sampling, huge sizes and counts,
trees with bad parents, unknown and other clients' session ids, rollbacks, payload specs that make
no sense, streams abandoned halfway. Every answer must be a clear refusal or a success: never
INTERNAL or UNKNOWN, never a dead server; after each burst the canary (greedy) must still decode
exactly what the target decodes alone. The suite runs a few hundred requests
(``tests/test_fuzz.py``); ``make fuzz`` runs ``--requests`` (default 10,000) against the real target.

Run:  .venv/bin/python -m bench.fuzz [--requests 10000] [--seed 0] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import collections
import math
import random
import sys
import time
from dataclasses import dataclass, field

import grpc

from shared.tree import DraftTree
from shared.wire import splitspec_pb2 as pb
from shared.wire import splitspec_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["SplitSpec"].full_name
METHODS = ("Handshake", "OpenSession", "Verify", "FetchPayload", "CloseSession", "Complete", "Probe")
NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
TIMEOUT = 60.0


@dataclass
class Tally:
    requests: int = 0
    codes: collections.Counter = field(default_factory=collections.Counter)
    bad: list[str] = field(default_factory=list)  # INTERNAL/UNKNOWN answers: each is a bug
    canary_checks: int = 0
    seconds: float = 0.0


class Canary:
    """A greedy session that must keep decoding exactly the target's own tokens, whatever else happens."""

    def __init__(self, stub, prompt: list[int], reference: list[int]):
        self.stub, self.reference = stub, reference
        reply = stub.OpenSession(pb.OpenSessionRequest(prompt_ids=prompt), timeout=TIMEOUT)
        self.id, self.length, self.tokens = reply.session_id, reply.length, [reply.first_token]

    def step(self) -> None:
        n = len(self.tokens)
        guess = self.reference[n : n + 2]
        tree = DraftTree.chain(guess) if len(guess) == 2 else DraftTree()
        reply = self.stub.Verify(pb.VerifyRequest(session_id=self.id, tokens=tree.tokens, parents=tree.parents,
                                                  length=self.length), timeout=TIMEOUT)  # fmt: skip
        self.tokens += [tree.tokens[i] for i in reply.accepted] + [reply.bonus_token]
        self.length = reply.length
        if self.tokens != self.reference[: len(self.tokens)]:
            raise AssertionError(f"the canary diverged at token {len(self.tokens)}: {self.tokens[-4:]}")

    @property
    def done(self) -> bool:
        return len(self.tokens) + 3 >= len(self.reference)


class Fuzzer:
    def __init__(self, channel: grpc.Channel, vocab: int, seed: int = 0):
        self.channel, self.vocab, self.rng = channel, vocab, random.Random(seed)
        self.stub = pb_grpc.SplitSpecStub(channel)
        self.raw = {m: channel.unary_unary(f"/{SERVICE}/{m}") for m in METHODS}
        self.sessions: list[tuple[str, int]] = []  # (id, length) of sessions this fuzzer opened

    # --- hostile values ---------------------------------------------------------------------------

    def token(self) -> int:
        r = self.rng.random()
        return self.rng.randrange(self.vocab) if r < 0.8 else self.rng.choice([self.vocab, 2**31, 2**32 - 1])

    def tokens(self, most: int = 40) -> list[int]:
        n = self.rng.choice([0, 1, 2, self.rng.randrange(most), 5000]) if self.rng.random() < 0.3 else \
            self.rng.randrange(1, most)  # fmt: skip
        return [self.token() for _ in range(n)]

    def number(self) -> float:
        return self.rng.choice([0.0, 0.7, 1.0, -1.0, 1e-45, 1e38, math.inf, -math.inf, math.nan, 2.0])

    def sampling(self) -> pb.Sampling:
        return pb.Sampling(temperature=self.number(), top_p=self.number(), seed=self.rng.randrange(2**64))

    def spec(self) -> pb.PayloadSpec:
        return pb.PayloadSpec(form=self.rng.choice(["", "kv", "lsa", "hidden", "x" * 50, "KV"]),
                              precision=self.rng.choice(["", "fp16", "int4", "fp64", "\x00"]),
                              tli_layers=self.rng.choice([0, 1, 3, 1000, 2**31]),
                              drafter=self.rng.choice(["", "moa-tli1", "../x", "a" * 300]))  # fmt: skip

    def session_id(self, others: list[str]) -> str:
        choices = ["", "nope", "s" * 20_000, "\x00\x01", *(s for s, _ in self.sessions[-3:]), *others]
        return self.rng.choice(choices)

    def tree(self) -> tuple[list[int], list[int]]:
        tokens = self.tokens(20)
        r = self.rng.random()
        if r < 0.6:
            parents = [self.rng.randrange(-1, i) for i in range(len(tokens))]
        else:  # bad ones: forward references, too short, out of range
            n = len(tokens) + self.rng.choice([0, 1])
            parents = [self.rng.choice([-2, i, i + 1, 2**30, -(2**30)]) for i in range(n)]
        return tokens, parents

    # --- one request ------------------------------------------------------------------------------

    def request(self, others: list[str]) -> tuple[str, grpc.StatusCode]:
        """Send one random request; (what it was, the status it got)."""
        kind = self.rng.choice([*METHODS, "garbage", "open-real", "verify-real", "abandon-stream"])
        try:
            if kind == "garbage":
                method = self.rng.choice(METHODS)
                body = bytes(self.rng.randrange(256) for _ in range(self.rng.randrange(1, 64)))
                if method in ("FetchPayload", "Complete"):
                    raw = self.channel.unary_stream(f"/{SERVICE}/{method}")
                    list(raw(body, timeout=TIMEOUT))
                else:
                    self.raw[method](body, timeout=TIMEOUT)
                return f"garbage {method}", grpc.StatusCode.OK
            if kind == "Handshake":
                self.stub.Handshake(pb.HandshakeRequest(tokenizer_fingerprint=self.rng.choice(["", "x" * 9000]),
                                                        drafter=self.rng.choice(["", "moa-tli1", "x" * 400, "../a"])),
                                    timeout=TIMEOUT)  # fmt: skip
            elif kind in ("OpenSession", "open-real"):
                prompt = self.tokens() if kind == "OpenSession" else [self.rng.randrange(self.vocab) for _ in range(6)]
                reply = self.stub.OpenSession(pb.OpenSessionRequest(
                    prompt_ids=prompt, sampling=self.sampling() if kind == "OpenSession" else None,
                    payload=self.spec() if kind == "OpenSession" else None), timeout=TIMEOUT)  # fmt: skip
                self.sessions.append((reply.session_id, reply.length))
            elif kind in ("Verify", "verify-real"):
                tokens, parents = self.tree() if kind == "Verify" else ([], [])
                sid = self.session_id(others) if kind == "Verify" or not self.sessions else self.sessions[-1][0]
                length = self.rng.choice([0, 1, 5, 2**31]) if kind == "Verify" else 0
                self.stub.Verify(pb.VerifyRequest(session_id=sid, tokens=tokens, parents=parents, length=length,
                                                  payload=self.spec() if kind == "Verify" else None),
                                 timeout=TIMEOUT)  # fmt: skip
            elif kind == "FetchPayload":
                start, end = self.rng.choice([(0, 1), (5, 2), (0, 2**31), (2**32 - 1, 2**32 - 1), (0, 3)])
                stream = self.stub.FetchPayload(pb.FetchPayloadRequest(session_id=self.session_id(others), start=start,
                                                                       end=end, spec=self.spec()), timeout=TIMEOUT)
                list(stream)
            elif kind == "CloseSession":
                self.stub.CloseSession(pb.CloseSessionRequest(session_id=self.session_id(others)), timeout=TIMEOUT)
            elif kind == "Complete":
                stream = self.stub.Complete(pb.CompleteRequest(
                    prompt_ids=self.tokens(), sampling=self.sampling(),
                    max_new_tokens=self.rng.choice([0, 1, 3, 2**31, 2**32 - 1]),
                    stop_token_ids=[self.token()]), timeout=TIMEOUT)  # fmt: skip
                list(stream)
            elif kind == "abandon-stream":
                stream = self.stub.Complete(pb.CompleteRequest(prompt_ids=[5, 6, 7], max_new_tokens=500),
                                            timeout=TIMEOUT)  # fmt: skip
                next(stream, None)
                stream.cancel()
            elif kind == "Probe":
                self.stub.Probe(pb.ProbeRequest(payload=bytes(self.rng.choice([0, 10, 100_000])),
                                                reply_bytes=self.rng.choice([0, 10, 2**31, 2**63])),
                                timeout=TIMEOUT)  # fmt: skip
            return kind, grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return kind, exc.code()
        except ValueError:  # a value the client library itself refuses to encode (e.g. an out-of-range int)
            return kind, grpc.StatusCode.OK


def run(channel: grpc.Channel, vocab: int, requests: int, canary: Canary, seed: int = 0, every: int = 25,
        others: list[str] | None = None, progress=None) -> Tally:  # fmt: skip
    """``requests`` hostile requests, the canary stepping every ``every``; the tally of answers."""
    fuzzer, tally = Fuzzer(channel, vocab, seed), Tally()
    start = time.perf_counter()
    for i in range(requests):
        kind, code = fuzzer.request(others or [])
        tally.requests += 1
        tally.codes[code.name] += 1
        if code in NEVER:
            tally.bad.append(f"{kind}: {code.name}")
        if i % every == every - 1 and not canary.done:
            canary.step()
            tally.canary_checks += 1
        if progress:
            progress()
    tally.seconds = time.perf_counter() - start
    return tally


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="smollm2-135m")
    args = p.parse_args(argv)
    import tempfile
    from pathlib import Path

    from tqdm import tqdm

    from shared.engine.models import load_target
    from shared.server_process import ServerChild

    target = load_target(args.model, dtype="auto")
    prompt = [target.tokenizer.bos_token_id or 1] + target.tokenizer.encode("Tell me about the sea.")
    session = target.session()
    session.prefill(prompt)
    while len(session.tokens) < len(prompt) + 400:
        session.verify(DraftTree())
    reference = session.tokens[len(prompt):]
    with tempfile.TemporaryDirectory() as wd:
        child = ServerChild(["--model", args.model, "--max-sessions", "64", "--max-context", "1024"], Path(wd))
        child.start()
        try:
            with grpc.insecure_channel(child.address) as channel:
                canary = Canary(pb_grpc.SplitSpecStub(channel), prompt, reference)
                bar = tqdm(total=args.requests, desc="fuzz", unit="req", file=sys.stderr)
                tally = run(channel, target.vocab_size, args.requests, canary, args.seed, progress=bar.update)
                bar.close()
                rss = next((line.split()[1] for line in Path(f"/proc/{child.process.pid}/status").read_text()
                            .splitlines() if line.startswith("VmRSS")), "?")  # fmt: skip
        finally:
            child.stop()
    print(f"{tally.requests} requests in {tally.seconds:.1f}s; statuses {dict(tally.codes.most_common())}; "
          f"canary checked {tally.canary_checks}x, exact; INTERNAL/UNKNOWN: {len(tally.bad)}; server RSS {rss} kB")
    for line in tally.bad[:20]:
        print("  BUG:", line)
    return 1 if tally.bad else 0


if __name__ == "__main__":
    sys.exit(main())
