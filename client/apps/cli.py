"""`splitspec generate`: speculative decoding against a server, or the same loop in-process."""

from __future__ import annotations

import argparse
import json
import sys

from client.apps.options import Deprecated, add_connection_arguments, add_mode_argument
from client.apps.private import Renderer, mask
from client.apps.text import Terminal, TextDeltas, note
from client.loop.offline import OFFLINE_CAP
from shared.acceptance import ACCEPTANCE, TYPICAL_DELTA, TYPICAL_EPSILON
from shared.engine.decoder import DTYPES
from shared.engine.models import DEFAULT_MODEL


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True, help="prompt text; '-' reads it from standard input")
    p.add_argument(
        "--private",
        action="append",
        default=[],
        metavar="TEXT",
        help="keep TEXT on this device (repeatable): every occurrence in the prompt, like a <private>...</private> "
        "span in it, reaches the server as a placeholder ([PRIVATE_1], ...) and is put back in the answer here",
    )
    p.add_argument("--chat", action="store_true", help="wrap the prompt as one user message in the chat template")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    where = p.add_mutually_exclusive_group()
    add_connection_arguments(p, where)
    where.add_argument("--local", action="store_true", help="run the target in this process (no gRPC), same loop")
    p.add_argument(
        "--probe-link", action="store_true", help="measure RTT and bandwidth first (implied by --via-netsim)"
    )
    p.add_argument("--baseline", choices=["api"], help="api: the server decodes alone and streams (no drafts)")
    p.add_argument(
        "--drafter",
        default="prompt-lookup",
        help="none, prompt-lookup (default), a model sharing the target's tokenizer (a built-in name such as "
        "qwen2.5-coder-0.5b, a GGUF file or a Hugging Face folder), a trained bundle (moa-tli0, moa-tli1, moa-tli3, "
        "eagle, independent, medusa) or a bundle's path",
    )
    p.add_argument(
        "--payload",
        choices=["kv", "lsa"],
        help="pin how a MoA drafter gets its memory over the network: every layer's KV (kv) or the server "
        "runs the drafter's LSA and ships one vector per token (lsa, ~20x fewer bytes); default: adaptive",
    )
    p.add_argument(
        "--precision",
        choices=["fp32", "fp16", "int8", "int4"],
        help="pin the payload precision (int8/int4: per-row scales; all zstd); default: adaptive",
    )
    p.add_argument(
        "--on-reconnect",
        choices=["verify", "keep", "fail"],
        help="when the link fails, generate offline until the server answers again, then have it verify the "
        "offline tokens (verify, the default: greedy output as if never cut) or take them as they are (keep); "
        "fail: stop with an error instead",
    )
    p.add_argument("--keep-after", type=float, metavar="SECONDS",
                   help="with --on-reconnect verify: a cut longer than this keeps the text made offline as it is "
                        "(as keep does) instead of having the server verify it (default: always verify)")  # fmt: skip
    p.add_argument("--offline-cap", type=float, default=OFFLINE_CAP, metavar="P",
                   help="while offline tokens are to be verified, stop making more once the chance that all of them "
                        "survive falls below P (the drafter's confidence, calibrated by how often the target took its "
                        f"first choices; about (1 - P) / -ln P of the text shown stays; 0: never stop; "
                        f"default {OFFLINE_CAP})")
    p.add_argument("--local-cap", dest="offline_cap", type=float, action=Deprecated, instead="use --offline-cap P")
    p.add_argument("--no-pipeline", action="store_true",
                   help="wait for each verdict before drafting the next tree (default over a link: draft it while "
                        "the last one is verified, guessing its outcome)")
    p.add_argument("--no-chain", action="store_true",
                   help="never send a tree before the verdict it assumes (default over a link: the tree drafted "
                        "ahead for the likeliest outcome is sent at once, chained, and the server verifies it "
                        "straight after the round before where that guess held)")
    p.add_argument("--offline-drafter", metavar="MODEL",
                   help="when the link fails, have this model write the offline tokens instead of --drafter (e.g. "
                        "qwen2.5-coder-0.5b beside moa-tli1: a whole model's text survives a long cut better than a "
                        "drafter's alone); it reads the context at the cut. Default: the drafter itself")
    add_mode_argument(p)
    p.add_argument(
        "--static",
        action="store_true",
        help="no adaptive policy: verify the whole drafted tree (--max-tree-nodes, default 16), the drafter's "
        "first payload spec",
    )
    p.add_argument("--tree-width", type=int, help="trained drafters: EAGLE-2 tree width B")
    p.add_argument("--tree-depth", type=int, help="trained drafters: EAGLE-2 tree depth D")
    p.add_argument(
        "--max-tree-nodes",
        type=int,
        help="pin the nodes verified per round (default: adaptive, at most 64; 16 with --static)",
    )
    p.add_argument("--draft-tokens", type=int, default=10, help="prompt lookup: the longest copy (default 10); "
                   "each is cut to the length its chances pay for")
    p.add_argument(
        "--draft-branches", type=int, default=1, help="prompt lookup: matches merged into a tree (default 1)"
    )
    p.add_argument("--temperature", type=float, help="sample at this temperature (lossless speculative sampling; "
                   "default: greedy decoding)")
    p.add_argument("--greedy", dest="greedy", action=Deprecated, nargs=0, const=True, default=False,
                   instead="greedy decoding is the default (sampling: --temperature T)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus cut when sampling (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="random seed when sampling (default 0)")
    p.add_argument("--acceptance", default="exact", choices=list(ACCEPTANCE),
                   help="how sampled drafts are judged: exact (default; the target's own distribution, lossless) or "
                        "typical (Medusa's typical acceptance: keeps more of a draft, NOT lossless; greedy at "
                        "temperature 0)")  # fmt: skip
    p.add_argument("--typical-epsilon", type=float, default=TYPICAL_EPSILON,
                   help="typical acceptance: the bar p(x) must clear for a confident target "
                        f"(default {TYPICAL_EPSILON})")  # fmt: skip
    p.add_argument("--typical-delta", type=float, default=TYPICAL_DELTA,
                   help=f"typical acceptance: the bar's scale where the target is unsure, delta*exp(-entropy) "
                        f"(default {TYPICAL_DELTA})")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help="target (--local) or its tokenizer (remote); default smollm2-135m"
    )
    p.add_argument("--cache-dir", help="where converted models are kept")
    p.add_argument("--device", default="cpu", help="--local only: cpu or cuda (default cpu)")
    p.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPES)],
                   help="the in-process target's (--local, or a trained drafter's frozen parts) and the drafter's: "
                        "auto (default, with --weights auto) = the one path this model is served on on this machine, "
                        "whatever the drafter and as `serve` serves it (`splitspec kernels`); float32 + native "
                        "weights gives transformers' own greedy output")  # fmt: skip
    p.add_argument("--weights", default="auto", choices=["auto", "native", "int8", "int4"],
                   help="the in-process target's projections: auto (measured with --dtype auto), native, or int8/int4 "
                        "with per-token int8 activations on splitspec's CPU kernels (--local: a different served "
                        "target, lossless relative to itself; remote: the TLI layers)")  # fmt: skip
    p.add_argument("--drafter-weights", default="auto", choices=["auto", "native", "int8", "int4"],
                   help="a trained drafter's own projections and draft head: auto (default) = int8 on a CPU when the "
                        "target is int8 or bf16, where it makes a draft step cheaper; a model drafter: auto = the "
                        "path measured fastest for it; drafts change, outputs never")  # fmt: skip
    p.add_argument("--threads", type=int, help="torch CPU threads")


class TextPrinter:
    """Prints text as tokens arrive (each call: the tokens after the last call's, all final), on ``out`` through a
    ``client.apps.text.Terminal``; ``renderer`` (``client.apps.private.Renderer``) names the private texts to put
    back in place of their placeholders. ``SettledPrinter`` and the demo show a whole generation on its terminal."""

    def __init__(self, tokenizer, out=None, renderer: Renderer | None = None):
        self.tokenizer, self.out = tokenizer, out or sys.stdout
        self.secrets = renderer.secrets if renderer is not None else None
        self.deltas = TextDeltas(tokenizer, secrets=self.secrets)
        self.terminal = Terminal(self.out)

    def __call__(self, tokens: list[int]) -> None:
        ids = self.deltas.ids + tokens
        self.terminal(self.deltas.update(ids, [True] * len(ids)))


class SettledPrinter:
    """Shows a generation as ``on_update`` reports it (``client.apps.text.TextDeltas``), on ``text``'s terminal.

    Verified tokens are final, and so are offline ones under ``keep``; under ``verify`` an offline token may still be
    replaced when the server is back: on a terminal it is shown dim meanwhile and rewritten in place (through a
    pipe it waits). The link's events are notes on ``status``; tokens still unverified at the end are printed
    then, with a note.
    """

    def __init__(self, text: TextPrinter, final_offline: bool, status=None):
        self.terminal, self.status = text.terminal, status or sys.stderr
        self.deltas = TextDeltas(text.tokenizer, final_offline=final_offline, secrets=text.secrets)

    def __call__(self, tokens: list[int], verified: list[bool]) -> None:
        self.terminal(self.deltas.update(tokens, verified), self.say)

    def finish(self, tokens: list[int], verified: list[bool]) -> None:
        self.terminal(self.deltas.update(tokens, verified, final=True), self.say)

    def say(self, event: str) -> None:
        note(event, self.status)


def stats_line(gen) -> str:
    s = gen.stats
    return (
        f"[{s.new_tokens} tokens in {s.wall_s:.2f}s: {s.tokens_per_s:.1f} tok/s, acceptance length "
        f"{s.acceptance_length:.2f}, {s.rounds} rounds, {s.server_calls} server calls, "
        f"{(s.bytes_sent + s.bytes_received) / 1024:.1f} KiB"
        + (f", rtt {s.rtt_ms:.1f} ms" if s.rtt_ms is not None else "")
        + (f", {s.bandwidth_mbps:.1f} Mbit/s down" if s.bandwidth_mbps is not None else "")
        + (f", link lost {s.disconnects}x: {s.offline_tokens} offline tokens, {s.offline_s:.2f}s offline"
           if s.disconnects else "")
        + f", finish: {gen.finish_reason}]"
    )


def options(args: argparse.Namespace):
    """The flags as ``ClientOptions`` (which check their own combinations)."""
    from client.build import ClientOptions
    from client.net.endpoint import Endpoint
    from shared.acceptance import SamplingParams
    from shared.errors import SplitspecError

    if args.greedy and args.temperature:
        raise SplitspecError(f"--greedy with --temperature {args.temperature:g}: greedy decoding is temperature 0; "
                             "drop one")  # fmt: skip
    try:
        sampling = SamplingParams(temperature=args.temperature or 0.0, top_p=args.top_p, seed=args.seed,
                                  acceptance=args.acceptance, epsilon=args.typical_epsilon,
                                  delta=args.typical_delta)  # fmt: skip
    except ValueError as exc:
        raise SplitspecError(str(exc)) from None
    endpoint = None if args.local else Endpoint.from_files(args.server, args.tls, args.tls_ca, args.tls_cert,
                                                           args.tls_key, args.auth_token_file)  # fmt: skip
    return ClientOptions(
        model=args.model, cache_dir=args.cache_dir, local=args.local, endpoint=endpoint,
        connect_timeout_s=args.connect_timeout, via_netsim=args.via_netsim, probe_link=args.probe_link,
        baseline=args.baseline, drafter=args.drafter, draft_tokens=args.draft_tokens,
        draft_branches=args.draft_branches, tree_width=args.tree_width, tree_depth=args.tree_depth,
        drafter_weights=args.drafter_weights, offline_drafter=args.offline_drafter, payload=args.payload,
        precision=args.precision, mode=args.mode, static=args.static, max_tree_nodes=args.max_tree_nodes,
        pipeline=False if args.no_pipeline else None, chain=not args.no_chain, on_reconnect=args.on_reconnect,
        keep_after_s=args.keep_after, offline_cap=args.offline_cap, sampling=sampling, device=args.device,
        dtype=args.dtype, weights=args.weights,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Flags in, one generation, its text (or one JSON object) out."""
    import torch

    from client.build import Client
    from shared.engine.models import encode_prompt
    from shared.errors import SplitspecError

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.max_new_tokens < 1:
        raise SplitspecError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    opts = options(args)
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not text:
        raise SplitspecError("empty prompt: pass --prompt TEXT")
    try:  # everything from here on, the server and the drafter included, sees the masked prompt only
        text, secrets = mask(text, args.private)
    except ValueError as exc:
        raise SplitspecError(str(exc)) from None
    with Client(opts) as client:
        if args.local and not args.json:
            print(f"splitspec: {client.target.name} on {client.target.describe()}", file=sys.stderr)
        prompt_ids = encode_prompt(client.tokenizer, text, args.chat)
        stream = None
        if not args.json:
            stream = SettledPrinter(TextPrinter(client.tokenizer, renderer=secrets.renderer()),
                                    final_offline=client.resilience.on_reconnect == "keep")  # fmt: skip
        gen = client.generate(prompt_ids, args.max_new_tokens, on_update=stream)
        if stream:
            stream.finish(gen.token_ids, gen.verified)
        if args.json:
            print(json.dumps(report(args, client, gen, secrets)))
        else:
            print(file=sys.stdout)
            print(stats_line(gen), file=sys.stderr)
    return 0


def report(args: argparse.Namespace, client, gen, secrets) -> dict:
    """``--json``'s object: the text, the tokens, how they were made and what it cost."""
    target = client.target
    return {
        "text": secrets.render(client.tokenizer.decode(gen.token_ids, skip_special_tokens=True)),
        "token_ids": gen.token_ids,  # the masked prompt's run
        "private_spans": len(secrets),
        "finish_reason": gen.finish_reason,
        "drafter": "api" if args.baseline == "api" else client.drafter.name,
        "acceptance": client.options.sampling.acceptance,  # "typical": not the target's own distribution
        "verifier": "local" if args.local else "remote",
        "served": {"dtype": str(target.dtype).removeprefix("torch."), "weights": target.weights}
        if args.local else None,  # the path the target ran on: the same whatever the drafter
        "network": args.via_netsim,
        "payload": None if args.local or not gen.spec else {"form": gen.spec.form, "precision": gen.spec.precision},
        "stats": gen.stats.as_dict(),
        "verified": gen.verified,
        "unverified_tokens": len(gen.verified) - sum(gen.verified),  # offline tokens never checked
    }
