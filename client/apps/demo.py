"""`splitspec demo`: the whole system in one command, on this machine.

A server (`splitspec serve`, a child process), a simulated mobile link in front of it (netsim, ``4g``
by default), and this process as the edge client: the MoA drafter (``moa-tli1``: its drafts use the
target's last layer, run here) streams a chat answer verified by the server. Partway through, the
link is cut and restored a few seconds later: the client keeps generating offline with the
drafter's TLI layer, and when the link is back the server verifies the offline tokens (the settlement):
each event is announced as it happens. Then the same prompt through the streaming API baseline over
the same link, cut the same way: it stalls for as long as the cut lasts. A table compares the two.
Everything it starts (server, netsim, timers) is stopped, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from client.apps.options import Deprecated
from client.loop.offline import OFFLINE_CAP
from netsim.profiles import PROFILES
from shared.engine.models import DEFAULT_MODEL
from shared.server_process import SINGLE_TURN, cpus_label, server_child, two_machines

DEMO_PROMPT = "Explain in a few sentences why the sky is blue, then give one everyday example of the same effect."
RESUME_TRIES = 5  # the API baseline's breaks in a row with no token before it gives up (a cut yields tokens between)
RESUME_WAIT_S = 120.0  # how long it waits for the server to come back after a break
WARM_UP_TOKENS = 16  # per side, before the timed runs (see warm_up): past a payload, so the drafter drafts once


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default=DEMO_PROMPT, help="chat prompt to run")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"target model (default {DEFAULT_MODEL})")
    p.add_argument("--cache-dir", help="where converted models are kept")
    p.add_argument("--max-new-tokens", type=int, default=120, help="tokens to generate (default 120)")
    p.add_argument("--drafter", default="moa-tli1", help="drafter to run (default moa-tli1)")
    p.add_argument("--network", default="4g", choices=list(PROFILES), help="simulated link (default 4g)")
    p.add_argument("--cut-after", type=int, default=30, help="cut the link once this many tokens streamed (default 30)")
    p.add_argument("--cut-for", type=float, default=3.0, help="seconds the link stays cut (default 3)")
    p.add_argument("--keep-after", type=float, metavar="SECONDS",
                   help="a cut longer than this keeps the offline text as it is (default: the server verifies it)")
    p.add_argument("--offline-cap", type=float, default=OFFLINE_CAP, metavar="P",
                   help="stop generating offline once the chance that all offline tokens survive verification falls "
                        f"below P (default {OFFLINE_CAP}, as `generate`; 0: offline generation through the whole cut)")
    p.add_argument("--local-cap", dest="offline_cap", type=float, action=Deprecated, instead="use --offline-cap P")
    p.add_argument("--no-baseline", action="store_true", help="skip the streaming API baseline")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for the server (default 300)")


def say(message: str) -> None:
    print(f"\n\033[1m[{message}]\033[0m" if sys.stderr.isatty() else f"\n[{message}]", file=sys.stderr, flush=True)


class Show:
    """Shows a generation on ``text`` (a ``client.apps.cli.TextPrinter``: its ``client.apps.text`` deltas and
    terminal): the settled text, the offline tail dim while the link is cut (on a terminal), the link's events
    narrated. Cuts the link (``link.cut``) once ``cut_after`` tokens are out, restores it ``cut_for`` later.
    Measures the longest wait for more settled text (``longest_stall``) and for any new text on the screen,
    provisional text included (``longest_wait``; while a whole answer is on the screen — ``limit`` tokens, or a stop
    token in ``stop`` — the user waits for no more text, only for the server to confirm it: that time is not a
    wait)."""

    def __init__(self, text, link, cut_after: int, cut_for: float, limit: int, stop: list[int]):
        self.text, self.link, self.cut_after, self.cut_for = text, link, cut_after, cut_for
        self.limit, self.stop, self.whole = limit, set(stop), False
        self.shown = 0  # settled tokens
        self.cut_at: float | None = None
        self.provisional = ""
        self.last_settled = self.last_text = time.perf_counter()
        self.longest_stall = 0.0  # the longest wait for more settled text on the screen
        self.longest_wait = 0.0  # the longest wait for any new text on the screen, settled or provisional

    def cut(self) -> None:
        self.cut_at = time.perf_counter()
        self.link.cut()
        self.text.terminal.aside(lambda: say(f"link cut after {self.shown} tokens (restored in {self.cut_for:g} s)"))
        timer = threading.Timer(self.cut_for, self.restore)
        timer.daemon = True
        timer.start()

    def restore(self) -> None:
        self.link.restore()
        self.text.terminal.aside(lambda: say("link restored"))

    def __call__(self, tokens: list[int], verified: list[bool]) -> None:
        delta = self.text.deltas.update(tokens, verified)
        now = time.perf_counter()
        if delta.settled:
            self.longest_stall = max(self.longest_stall, now - self.last_settled)
            self.last_settled = now
        if delta.settled or (delta.provisional and not self.provisional.startswith(delta.provisional)):
            if not self.whole:
                self.longest_wait = max(self.longest_wait, now - self.last_text)
            self.last_text = now
        self.whole = len(tokens) >= self.limit or bool(tokens and tokens[-1] in self.stop)
        self.provisional = delta.provisional
        self.text.terminal(delta, say)
        self.shown = len(self.text.deltas.ids)
        if self.cut_at is None and self.shown >= self.cut_after:
            self.cut()


def narrated(policy_class):
    """The adaptive policy (``client.loop.adaptive``), saying when it switches between the server decoding and
    drafting."""

    class Narrated(policy_class):
        said = ""

        def plan(self, state):
            plan = super().plan(state)
            stretch = plan.stream
            mode = "stream" if stretch else "draft"
            if mode != self.said:
                if mode == "stream":
                    why = "drafting lost to it" if self.said else "an idle server decodes with no round trip a token"
                    say(f"mode: the server decodes by itself and streams (up to {min(stretch, 9999)} tokens; {why})")
                else:
                    scarce = self.schedule.spare_server()
                    why = "its compute is scarce" if scarce else "trying whether drafting is faster"
                    say(f"mode: drafting on this device, the server verifies ({why})")
                self.said = mode
            return plan

    return Narrated


def api_resuming(remote, prompt_ids: list[int], limit: int, show: Show, tries: int = RESUME_TRIES,
                 wait_s: float = RESUME_WAIT_S, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> dict:  # fmt: skip
    """The streaming API as an app would use it through a cut: the stream breaks, the app waits (at most ``wait_s``)
    for the server and asks again for the rest (the prompt and what it already has). A stream that breaks ``tries``
    times in a row without a token is not a cut but a failure: raised, not retried for ever. Its figures for the
    table."""
    from client.net.api import api_complete
    from shared.errors import SplitspecError

    before, start, out, barren = remote.counters.server_calls, time.perf_counter(), [], 0
    bytes_before = remote.counters.bytes_sent + remote.counters.bytes_received
    while len(out) < limit:
        got: list[int] = []

        def update(tokens: list[int], verified: list[bool], got=got, done=out) -> None:
            got[:] = tokens
            show(done + tokens, [True] * (len(done) + len(tokens)))

        try:
            gen = api_complete(remote, prompt_ids + out, limit - len(out), on_update=update)
            out += gen.token_ids
            break
        except SplitspecError as exc:
            out += got
            barren = 0 if got else barren + 1
            if barren >= tries:
                raise SplitspecError(f"the API stream broke {barren} times in a row before its first token "
                                     f"(last: {exc}); giving up") from None  # fmt: skip
            say(f"the API stream broke after {len(out)} tokens ({exc}): waiting for the server to ask for the rest")
            deadline = clock() + wait_s
            while not remote.reachable(timeout_s=0.5) and clock() < deadline:
                sleep(0.2)
    wall = time.perf_counter() - start
    return {"tokens": len(out), "wall_s": wall, "tok_s": len(out) / wall, "wait_s": show.longest_wait,
            "stall_s": show.longest_stall, "server_calls": remote.counters.server_calls - before,
            "kib": (remote.counters.bytes_sent + remote.counters.bytes_received - bytes_before) / 1024,
            "streamed": f"{len(out)}/{len(out)}", "acceptance_length": "1.00", "offline": "0",
            "verified": f"{len(out)}/{len(out)}"}  # fmt: skip


def warm_up(client, prompt_ids: list[int]) -> None:
    """A few tokens each way, unshown, so that neither timed run pays first-call costs (the server's kernels and
    buffers, the drafter's first forward) that the other then skips; the timed run then learns afresh."""
    from client.net.api import api_complete

    client.generate(prompt_ids, WARM_UP_TOKENS)
    api_complete(client.verifier, prompt_ids, WARM_UP_TOKENS)
    client.forget()


def offline_kept(shown: int, kept: int) -> str:
    """Offline tokens shown during cuts and the share of them the server kept: whether provisional text was worth
    showing."""
    return f"{shown} shown, {kept} kept ({100 * kept / shown:.0f} %)" if shown else "0"


def figures(gen, show: Show) -> dict:
    s = gen.stats
    return {"tokens": s.new_tokens, "wall_s": s.wall_s, "tok_s": s.tokens_per_s, "wait_s": show.longest_wait,
            "stall_s": show.longest_stall, "server_calls": s.server_calls,
            "kib": (s.bytes_sent + s.bytes_received) / 1024, "streamed": f"{s.streamed_tokens}/{s.new_tokens}",
            "acceptance_length": f"{s.acceptance_length:.2f}" if s.acceptance_length else "none drafted",
            "offline": offline_kept(s.offline_tokens, s.offline_kept),
            "verified": f"{sum(gen.verified)}/{len(gen.verified)}"}  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from client.drafters import make_drafter, needs_target
    from netsim import Netsim, simulated_link
    from shared.engine.models import encode_prompt, load_target, load_tokenizer

    trained = needs_target(args.drafter)
    target = load_target(args.model, dtype="auto", cache=args.cache_dir) if trained else None  # converted once
    tokenizer = target.tokenizer if target is not None else load_tokenizer(args.model, args.cache_dir)
    prompt_ids = encode_prompt(tokenizer, args.prompt, True)
    serve_args = ["--model", args.model, *SINGLE_TURN] + (["--cache-dir", args.cache_dir] if args.cache_dir else [])
    cpus = two_machines(1, 1)  # a server machine and a device: a core each, the API baseline on the server's
    if cpus is not None:
        import torch

        torch.set_num_threads(1)
        serve_args += ["--threads", "1"]
    print(f"splitspec demo: starting the server ({args.model}) and a simulated {args.network} link; "
          f"{cpus_label(cpus)} ...", file=sys.stderr, flush=True)  # fmt: skip
    with (
        ThreadPoolExecutor(1, thread_name_prefix="splitspec-drafter") as pool,
        tempfile.TemporaryDirectory(prefix="splitspec-demo-") as workdir,
    ):
        # the drafter loads on this device's core while the server starts on its own
        loading = pool.submit(make_drafter, args.drafter, target=target, tokenizer=tokenizer)
        with (
            server_child(serve_args, Path(workdir), args.startup_timeout, cpus=cpus and cpus[0]) as address,
            Netsim.start_own() as sim,
            simulated_link(address, args.network, netsim=sim) as link,
        ):
            drafter = loading.result(timeout=args.startup_timeout)  # a local load: as long as the server's
            runs = demo_runs(args, address, link, drafter, tokenizer, prompt_ids)
    print("\n", file=sys.stderr)
    print(summary(runs), file=sys.stderr)
    if len(runs) == 2:
        print(verdict(*runs.values()), file=sys.stderr)
    return 0


def demo_runs(args: argparse.Namespace, address: str, link, drafter, tokenizer, prompt_ids: list[int]) -> dict:
    """The split client through the cut, then the streaming API through the same cut: each run's figures."""
    from client.apps.cli import TextPrinter
    from client.build import Client, ClientOptions, Shared
    from client.loop.adaptive import AdaptivePolicy
    from shared.engine.target import tokenizer_fingerprint

    runs = {}
    print(f"splitspec demo: server at {address}, reached through {link.address} ({args.network}); "
          f"drafter {drafter.name} on this device\nprompt: {args.prompt}\n",
          file=sys.stderr, flush=True)  # fmt: skip
    options = ClientOptions(model=args.model, server=link.address, drafter=drafter.name, keep_after_s=args.keep_after,
                            offline_cap=args.offline_cap)  # fmt: skip
    with Client(options, Shared(None, tokenizer, tokenizer_fingerprint(tokenizer)), drafter) as client:
        remote = client.verifier
        warm_up(client, prompt_ids)
        client.forget(narrated(AdaptivePolicy))
        show = Show(TextPrinter(tokenizer), link, args.cut_after, args.cut_for, args.max_new_tokens,
                    remote.eos_token_ids)  # fmt: skip
        gen = client.generate(prompt_ids, args.max_new_tokens, on_update=show)
        show.text(gen.token_ids[show.shown :])
        print(flush=True)
        runs[f"split, {drafter.name}"] = figures(gen, show)
        if not args.no_baseline:
            say(f"the same prompt through the streaming API baseline, over the same {args.network} link, "
                "cut the same way")  # fmt: skip
            show = Show(TextPrinter(tokenizer), link, args.cut_after, args.cut_for, args.max_new_tokens,
                    remote.eos_token_ids)  # fmt: skip
            runs["streaming API"] = api_resuming(remote, prompt_ids, args.max_new_tokens, show)
            print(flush=True)
    return runs


def verdict(split: dict, api: dict) -> str:
    """In plain words, where the split client won against the API on this run and where it did not."""
    speed = round(split["tok_s"] / api["tok_s"], 2) if api["tok_s"] else float("inf")  # judged as printed
    pace = "faster" if speed > 1 else "SLOWER" if speed < 1 else "even"
    wait = "shorter" if split["wait_s"] <= api["wait_s"] else "LONGER"
    return (f"split vs API: {speed:.2f}x the tokens/s ({pace}); longest wait for text "
            f"{split['wait_s']:.1f} s vs {api['wait_s']:.1f} s ({wait}; the split client's counts provisional "
            "text, not the time a whole provisional answer waits for the server)")


ROWS = [("tokens", "tokens", "d"), ("wall s", "wall_s", ".1f"), ("tok/s", "tok_s", ".1f"),
        ("longest wait for text s", "wait_s", ".1f"), ("longest wait for verified text s", "stall_s", ".1f"),
        ("server calls", "server_calls", "d"), ("KiB on the link", "kib", ".0f"),
        ("decoded by the server", "streamed", "s"), ("acceptance length (drafted rounds)", "acceptance_length", "s"),
        ("offline tokens", "offline", "s"), ("verified", "verified", "s")]  # fmt: skip


def summary(runs: dict[str, dict]) -> str:
    """A table of what each run cost and how it went through the cut."""
    rows = [("", *runs)] + [(label, *(format(r[key], fmt) for r in runs.values())) for label, key, fmt in ROWS]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)
