"""Link cuts with a tree in flight: many generations, each cut while a pipelined round's Verify is under way.

A `splitspec serve` child hosts the target; netsim puts a link in front of it. Each generation (a held-out prompt,
greedy, pipelined rounds: the drafter is drafting ahead of the verdict when the link goes) has its link cut as its
k-th Verify starts (k random), loudly (connections closed) or silently (every byte dropped), and restored after a
random delay; the generation goes on offline and settles when the link is back. Every output must equal plain
decoding's: nothing lost, nothing duplicated, nothing changed. Bounded: ``--runs`` generations, each within the
decode loop's own bounds.

Chained rounds (the tree drafted ahead sent before the verdict it assumes, the default) let a cut find two trees in
flight; ``--no-chain``: one at most.

Run:  .venv/bin/python -m bench.cuts [--runs 100] [--drafters moa-tli1,eagle] [--profile 4g] [--no-chain]
Writes cuts.json and cuts.md under --out (default bench/results/cuts).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
from pathlib import Path

from tqdm import tqdm

from bench.common import environment, finish, start
from bench.single import load_prompts
from client.drafters import make_drafter
from client.loop.decode import Settings, generate
from client.loop.offline import Backoff, Resilience
from client.net.remote import RemoteVerifier
from client.verifiers import LocalVerifier
from shared.engine.models import DEFAULT_MODEL, load_target
from shared.errors import SplitspecError
from shared.server_process import server_child

REPO = Path(__file__).resolve().parent.parent


def cut_on_call(verifier: RemoteVerifier, link, call_no: int, down_s: float, silent: bool) -> None:
    """Cut ``link`` as the ``call_no``-th Verify starts (the call then in flight; chained ones counted too) and restore
    it ``down_s`` later."""
    verifier.__dict__.pop("verify", None)
    verifier.__dict__.pop("verify_after", None)
    calls = []

    def counted(original):
        def call(*args, **kw):
            calls.append(1)
            if len(calls) == call_no:
                link.cut(silent=silent)
                threading.Timer(down_s, link.restore).start()
            return original(*args, **kw)

        return call

    verifier.verify, verifier.verify_after = counted(verifier.verify), counted(verifier.verify_after)


def main(argv: list[str] | None = None) -> int:
    from netsim import Netsim, simulated_link

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=100, help="generations, each cut once (default 100)")
    p.add_argument("--drafters", default="moa-tli1,eagle,prompt-lookup", help="comma list, used in turn")
    p.add_argument("--profile", default="4g", help="netsim profile of the link (default 4g)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-chain", action="store_true", help="no chained rounds: one tree in flight at most")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cuts")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be >= 1")
    start(args.threads)
    rng = random.Random(args.seed)
    target = load_target(args.model, dtype="auto")
    prompts = load_prompts(target.tokenizer, 3)
    plain = {q.id: generate(LocalVerifier(target), make_drafter("none"), q.ids, args.max_new_tokens).token_ids
             for q in prompts}  # fmt: skip
    names = [n.strip() for n in args.drafters.split(",") if n.strip()]
    drafters = {n: make_drafter(n, target=target) for n in names}
    rows, failures = [], []
    with tempfile.TemporaryDirectory() as tmp, Netsim.start_own() as netsim, \
            server_child(["--model", args.model, "--threads", str(args.threads), "--max-sessions", "64",
                          "--session-ttl", "30"], Path(tmp)) as upstream:  # fmt: skip
        with simulated_link(upstream, args.profile, netsim=netsim) as link:
            verifiers = {n: RemoteVerifier(link.address, fingerprint=target.fingerprint, drafter=d)
                         for n, d in drafters.items()}  # fmt: skip
            try:
                for i in tqdm(range(args.runs), desc="cuts", unit="run", file=sys.stderr):
                    name, q = names[i % len(names)], prompts[rng.randrange(len(prompts))]
                    call_no, down_s, silent = rng.randint(2, 8), rng.uniform(0.05, 0.6), rng.random() < 0.5
                    cut_on_call(verifiers[name], link, call_no, down_s, silent)
                    row = {"run": i, "drafter": name, "prompt": q.id, "cut_at_call": call_no,
                           "down_s": round(down_s, 3), "silent": silent, "disconnects": 0, "offline_tokens": 0,
                           "guesses": 0, "guesses_held": 0, "chained_held": 0, "exact": False,
                           "error": None}  # fmt: skip
                    try:
                        gen = generate(
                            verifiers[name], drafters[name], q.ids, args.max_new_tokens,
                            Settings(
                                resilience=Resilience(backoff=Backoff(base_s=0.02, cap_s=0.2, seed=i)),
                                chain=not args.no_chain,
                            ),
                        )  # fmt: skip
                    except SplitspecError as exc:  # a failed generation is a failure too, and the next run goes on
                        row["error"] = str(exc)
                    else:
                        s = gen.stats
                        exact = gen.token_ids == plain[q.id] and all(gen.verified)
                        row.update(disconnects=s.disconnects, offline_tokens=s.offline_tokens, guesses=s.guesses,
                                   guesses_held=s.guesses_held, chained_held=s.chained_held, exact=exact)
                    rows.append(row)
                    if not row["exact"]:
                        failures.append(i)
                        how = "silent" if silent else "loud"
                        tqdm.write(f"FAILED: run {i} ({name}, {q.id}, cut at call {call_no}, {how}): "
                                   f"{row['error'] or 'output differs from plain decoding'}", file=sys.stderr)
            finally:
                for v in verifiers.values():
                    v.shutdown()
    cut = [r for r in rows if r["disconnects"]]
    env = environment(args.threads)
    md = (f"# Link cuts with a tree in flight\n\n`{env['command']}`\n\n{env['date']}, {args.model}, netsim "
          f"{args.profile}, {env['cpu']}. {len(rows)} generations (≤{args.max_new_tokens} tokens, greedy, pipelined "
          f"rounds{'' if args.no_chain else ', chained'}), each with its link cut as a random Verify (2nd–8th) "
          "started, loud or silent, for 0.05–0.6 s.\n\n"
          "| drafter | runs | runs cut | offline tokens | guesses held / made | rounds chained | exact |\n"
          "|---|---:|---:|---:|---:|---:|---:|\n")
    for name in names:
        mine = [r for r in rows if r["drafter"] == name]
        md += (f"| {name} | {len(mine)} | {sum(r['disconnects'] > 0 for r in mine)} | "
               f"{sum(r['offline_tokens'] for r in mine)} | {sum(r['guesses_held'] for r in mine)} / "
               f"{sum(r['guesses'] for r in mine)} | {sum(r['chained_held'] for r in mine)} | "
               f"{sum(r['exact'] for r in mine)}/{len(mine)} |\n")  # fmt: skip
    md += f"\n{len(cut)} generations saw the cut; {len(rows) - len(failures)} of {len(rows)} outputs exact."
    result = {"environment": env, "args": {**vars(args), "out": str(args.out)}, "runs": rows, "failures": failures}
    finish(args.out, "cuts", result, md, png=False)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
