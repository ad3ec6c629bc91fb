"""One way to build a client: ``ClientOptions`` is a configuration checked as a whole, ``Client`` turns it into the
parts a generation needs and owns them: the target (in process) or a connection to the server, the drafter, the
adaptive policy and what to do on a cut.

The CLI, the demo, the edge and the benchmarks build their clients here, so that a flag means the same everywhere
and the wiring lives once. ``client.loop.decode.generate`` stays the loop itself, for tests and for benchmarks that
drive it by hand.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from client.drafters import make_drafter, needs_target
from client.drafters.base import DRAFT_PRECISIONS, Drafter
from client.loop.adaptive import AdaptivePolicy
from client.loop.decode import Generation, Settings, generate
from client.loop.offline import OFFLINE_CAP, Resilience
from client.net.api import api_complete
from client.net.endpoint import Endpoint
from shared.acceptance import SamplingParams
from shared.engine.models import DEFAULT_MODEL
from shared.errors import SplitspecError
from shared.payload import PayloadSpec

MODES = ("auto", "draft", "stream")
ON_RECONNECT = ("verify", "keep", "fail")


@dataclass(frozen=True)
class ClientOptions:
    """How a client generates. Checked when made: a combination that cannot work is an error naming the options,
    before anything loads. The CLI's flags map onto it one to one (``client.apps.cli.options``)."""

    model: str = DEFAULT_MODEL  # the target (local) or its tokenizer (remote)
    cache_dir: str | None = None
    local: bool = False  # the target in this process: the same loop, no server
    server: str = "127.0.0.1:50051"
    endpoint: Endpoint | None = None  # TLS and bearer token, and the address, which then replaces ``server``
    connect_timeout_s: float = 10.0
    rpc_timeout_s: float = 120.0
    via_netsim: str | None = None  # reach the server through a netsim proxy with this link profile
    probe_link: bool = False  # measure RTT and bandwidth before the first generation
    baseline: str | None = None  # "api": the server decodes alone and streams; no drafter
    drafter: str = "prompt-lookup"
    draft_tokens: int = 10  # prompt lookup: tokens copied per match
    draft_branches: int = 1  # prompt lookup: matches merged into a tree
    tree_width: int | None = None  # trained drafters' EAGLE-2 tree
    tree_depth: int | None = None
    drafter_weights: str = "auto"
    offline_drafter: str | None = None  # writes the offline tokens instead of the drafter
    payload: str | None = None  # pin the payload form (kv, lsa)
    precision: str | None = None  # pin the payload precision
    mode: str = "auto"  # who decodes (``client.loop.adaptive``)
    static: bool = False  # no adaptive policy: every round verifies the drafter's whole tree
    max_tree_nodes: int | None = None  # pin the nodes verified per round (default: adaptive, at most 64; 16 static)
    pipeline: bool | None = None  # draft while a Verify is in flight (default: over a link)
    chain: bool = True  # send the tree drafted ahead before the verdict it assumes
    on_reconnect: str | None = None  # verify (default), keep or fail; None: verify, and not pinned by the user
    keep_after_s: float | None = None
    offline_cap: float = OFFLINE_CAP
    heartbeat: bool = True  # probe the server on a connection of its own, to notice a silent cut early
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: tuple[int, ...] | None = None  # None: the target's end-of-sequence tokens; (): none (replays)
    device: str = "cpu"  # the in-process target's and the drafter's
    dtype: str = "auto"
    weights: str = "auto"

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ``SplitspecError`` for a combination that cannot work, naming it."""
        if self.mode not in MODES:
            raise SplitspecError(f"mode {self.mode!r}: expected one of {', '.join(MODES)}")
        if self.baseline not in (None, "api"):
            raise SplitspecError(f"baseline {self.baseline!r}: expected api or none")
        if self.on_reconnect not in (None, *ON_RECONNECT):
            raise SplitspecError(f"on_reconnect {self.on_reconnect!r}: expected one of {', '.join(ON_RECONNECT)}")
        if self.local and self.baseline:
            raise SplitspecError("--baseline api needs a server; drop --local")
        if self.local and self.via_netsim:
            raise SplitspecError("--via-netsim shapes the link to a server; drop --local")
        if self.offline_drafter and (self.local or self.baseline):
            raise SplitspecError("--offline-drafter writes while the link to a server is down: drop --local / "
                                 "--baseline")  # fmt: skip
        if self.local and self.on_reconnect:
            raise SplitspecError("--on-reconnect is about the link to a server; drop --local")
        if self.keep_after_s is not None and (self.keep_after_s < 0 or (self.on_reconnect or "verify") != "verify"):
            raise SplitspecError(f"--keep-after {self.keep_after_s:g}: expected seconds >= 0, with --on-reconnect "
                                 "verify")  # fmt: skip
        if not 0 <= self.offline_cap < 1:
            raise SplitspecError(f"--offline-cap {self.offline_cap:g}: expected a probability in [0, 1)")
        if self.static and self.mode != "auto":
            raise SplitspecError(f"--static verifies every drafted tree whole; --mode {self.mode} needs the adaptive "
                                 "policy: drop one of them")  # fmt: skip
        if self.max_tree_nodes is not None and self.max_tree_nodes < 1:
            raise SplitspecError(f"--max-tree-nodes {self.max_tree_nodes}: expected at least 1")

    @property
    def needs_target(self) -> bool:
        """Whether the target loads in this process: run there (``local``), or a trained drafter reuses its frozen
        embeddings, last layers and head."""
        return self.local or (self.baseline is None and needs_target(self.drafter))


@dataclass(frozen=True)
class Shared:
    """What clients of one configuration share, loaded once: the target (None when it is not in this process), the
    tokenizer and its fingerprint (hashing a vocabulary holds the GIL for ~0.1 s: once, not per connection)."""

    target: object | None
    tokenizer: object | None
    fingerprint: str = ""

    @classmethod
    def load(cls, options: ClientOptions) -> Shared:
        from shared.engine.models import load_target, load_tokenizer
        from shared.engine.target import tokenizer_fingerprint

        target = None
        if options.needs_target:
            target = load_target(options.model, device=options.device, dtype=options.dtype, cache=options.cache_dir,
                                 weights=options.weights)  # fmt: skip
        tokenizer = target.tokenizer if target is not None else load_tokenizer(options.model, options.cache_dir)
        return cls(target, tokenizer, tokenizer_fingerprint(tokenizer))


class Client:
    """One configured client. ``generate`` runs a generation through the decode loop (or, with ``baseline="api"``,
    the server's stream); a client makes any number, one at a time, each starting from what the last one's policy
    learnt (``AdaptivePolicy.for_run``), as a process answering many prompts should."""

    def __init__(self, options: ClientOptions, shared: Shared | None = None, drafter: Drafter | None = None,
                 stopping: threading.Event | None = None) -> None:  # fmt: skip
        """``shared``: parts already loaded (default: loaded from ``options``); ``drafter``: one already made (default:
        made from ``options``); ``stopping``: set when the process stops: a generation waiting for the link ends at
        once, its offline tail unverified."""
        self.options = o = options
        self.shared = shared or Shared.load(options)
        self.drafter = drafter
        if drafter is None and o.baseline is None:
            self.drafter = self._make(o.drafter, width=o.tree_width, depth=o.tree_depth, weights=o.drafter_weights,
                                      **({"num_tokens": o.draft_tokens, "branches": o.draft_branches}
                                         if o.drafter in ("prompt-lookup", "pld") else {}))  # fmt: skip
        writer = None
        if o.offline_drafter:
            writer = self._make(o.offline_drafter)
            if writer.payload_specs():
                raise SplitspecError(f"--offline-drafter {o.offline_drafter} reads the target's features, which a "
                                     "cut keeps away; give a model that reads tokens only (e.g. qwen2.5-coder-0.5b)")
        self.resilience = Resilience(o.on_reconnect or "verify", heartbeat=o.heartbeat, keep_after_s=o.keep_after_s,
                                     offline_cap=o.offline_cap, stop=stopping, offline=writer)  # fmt: skip
        self.policy_type: type[AdaptivePolicy] = AdaptivePolicy
        self.policy: AdaptivePolicy | None = None  # the last generation's: what the next one starts from
        self.history: list[int] = []  # the last generation's prompt and output: a next turn goes on from it
        self._verifier = None
        self._links = contextlib.ExitStack()  # the netsim proxy the connections go through (``via_netsim``)
        self._address: str | None = None  # where connections go: the server's, or that proxy's

    @property
    def target(self):
        return self.shared.target

    @property
    def tokenizer(self):
        return self.shared.tokenizer

    @property
    def connected(self) -> bool:
        return self._verifier is not None

    @property
    def verifier(self):
        """The target in process, or a connection to the server that has done its handshake (opened on first use)."""
        return self.connect()

    def connect(self):
        """The verifier, connected now (and the link probed, where asked) rather than at the first generation."""
        if self._verifier is None:
            self._verifier = self._connect()
        return self._verifier

    def generate(self, prompt_ids: list[int], max_new_tokens: int,
                 on_update: Callable[[list[int], list[bool]], None] | None = None,
                 stop_when: Callable[[list[int], list[bool]], bool] | None = None,
                 sampling: SamplingParams | None = None) -> Generation:  # fmt: skip
        """One generation of up to ``max_new_tokens`` after ``prompt_ids``: ``on_update(tokens, verified)`` sees the
        whole output after every change, ``stop_when(tokens, verified)`` may end it; ``sampling``: this
        generation's (default the options')."""
        if max_new_tokens < 1:
            raise SplitspecError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
        o, verifier = self.options, self.verifier
        sampling = sampling or o.sampling
        stop_ids = None if o.stop_ids is None else list(o.stop_ids)
        self.history = list(prompt_ids)  # (until the output is known: a failed generation leaves only the prompt)
        if o.baseline == "api":
            gen = api_complete(verifier, prompt_ids, max_new_tokens, sampling, stop_ids, on_update)
            self.history += gen.token_ids
            return gen
        specs = verifier.usable(self.pinned_specs())
        policy = None
        if not o.static:
            policy = self.policy_type.for_run(verifier, specs, previous=self.policy, pin_nodes=o.max_tree_nodes,
                                              pin_depth=o.tree_depth, mode=o.mode)  # fmt: skip
            self.policy = policy
        gen = generate(
            verifier, self.drafter, prompt_ids, max_new_tokens,
            Settings(
                sampling=sampling,
                stop_ids=stop_ids,
                max_tree_nodes=o.max_tree_nodes or (16 if o.static else 64),
                policy=policy,
                resilience=self.resilience,
                stop_when=stop_when,
                spec=specs[0] if specs else None,
                pipeline=o.pipeline,
                chain=o.chain,
            ),
            on_update=on_update,
        )  # fmt: skip
        self.history += gen.token_ids
        return gen

    def forget(self, policy_type: type[AdaptivePolicy] | None = None) -> None:
        """The next generation learns afresh (what a warm-up learnt is not the timed run's), under ``policy_type``
        if given (the demo's narrates its switches)."""
        self.policy = None
        self.policy_type = policy_type or self.policy_type

    def pinned_specs(self) -> list[PayloadSpec]:
        """The drafter's payload specs within the pinned payload form and precision; an error if none is left."""
        if self.drafter is None:
            return []
        o = self.options
        specs = self.drafter.payload_specs((o.precision,) if o.precision else DRAFT_PRECISIONS)
        kept = [s for s in specs if o.payload in (None, s.form)]
        if o.payload and not kept:
            modes = ", ".join(sorted({s.form for s in specs})) or "none (it reads only tokens)"
            raise SplitspecError(f"--payload {o.payload}: drafter {self.drafter.name} takes payload form {modes}")
        return kept

    def disconnect(self) -> None:
        """Close the connection (the next generation opens a new one); drafter and policy stay."""
        verifier, self._verifier = self._verifier, None
        if verifier is not None and not self.options.local:
            verifier.shutdown()

    def close(self) -> None:
        self.disconnect()
        self._links.close()
        self._address = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make(self, name: str, **how) -> Drafter:
        o = self.options
        return make_drafter(name, target=self.target, tokenizer=self.tokenizer, device=o.device, **how)

    def _connect(self):
        o = self.options
        if o.local:
            from client.verifiers import LocalVerifier

            return LocalVerifier(self.target)
        from client.net.remote import RemoteVerifier

        endpoint = o.endpoint or Endpoint(o.server)
        if self._address is None:
            self._address = endpoint.address
            if o.via_netsim:
                from netsim import simulated_link

                self._address = self._links.enter_context(simulated_link(endpoint.address, o.via_netsim)).address
        endpoint = replace(endpoint, address=self._address)
        lsa = self.pinned_specs()[0] if o.payload == "lsa" else PayloadSpec()
        verifier = RemoteVerifier(endpoint, fingerprint=self.shared.fingerprint, connect_timeout_s=o.connect_timeout_s,
                                  rpc_timeout_s=o.rpc_timeout_s, drafter=self.drafter, spec=lsa)  # fmt: skip
        if o.probe_link or o.via_netsim:
            verifier.connection.probe_link()
        return verifier
