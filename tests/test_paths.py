"""The paths matrix: every drafter, on every serving path this machine has (int4, int8, bf16, fp32), locally, over
gRPC and through a link cut, gives exactly the greedy output of plain decoding on the same path.

A path is a served target of its own (low-bit weights are other weights), so each is compared with itself. The
kernel builds (avx512-vnni, avx2, portable) compute the same bits (tests/test_kernels.py), so one build here
stands for all. A path this machine lacks is skipped with the reason.
"""

from __future__ import annotations

import pytest

from client.drafters import make_drafter, prepare_drafter
from client.drafters.base import NoDrafter
from client.drafters.eagle import EagleDrafter
from client.drafters.independent import IndependentDrafter
from client.drafters.medusa import MedusaDrafter
from client.drafters.moa import MoADrafter
from client.loop.decode import Settings, generate
from client.loop.offline import Backoff, Resilience
from client.net.remote import RemoteVerifier
from client.verifiers import LocalVerifier
from netsim import simulated_link
from shared.engine.decoder import DTYPES
from shared.engine.models import load_target
from shared.engine.paths import PATHS, runnable_paths
from tests.conftest import served
from tests.test_eagle_independent import make_model as make_eagle_or_independent
from tests.test_medusa import make_model as make_medusa
from tests.test_moa import make_moa
from tests.test_resilient import cut_on_round

PROMPT = [5, 9, 14, 5, 9, 21, 33, 40, 41, 5, 9, 14, 5]
NEW = 32
DRAFTERS = ["prompt-lookup", "eagle", "independent", "medusa", "moa-tli0", "moa-tli1", "model"]
WHERE = ["local", "remote", "cut"]


@pytest.fixture(scope="module", params=list(PATHS))
def path_target(request, tiny_model_dir):
    """(target on the path, its server's address, its plain greedy output)."""
    path = request.param
    if path not in runnable_paths():
        from shared.engine import kernels

        pytest.skip(f"path {path} is not on this machine: {kernels.unavailable_reason()}")
    dtype, weights = PATHS[path]
    target = load_target(str(tiny_model_dir), dtype=dtype, weights=weights)
    assert target.dtype == DTYPES[dtype] and target.weights == (weights if weights != "native" else "native")
    plain = generate(LocalVerifier(target), NoDrafter(), PROMPT, NEW).token_ids
    with served(target, max_sessions=32, max_tree_nodes=16, max_context=128, min_tree_nodes=16,
                session_ttl_s=60.0) as (address, _):  # fmt: skip
        yield target, address, plain


def drafter_for(name: str, target, model_dir):
    """A random drafter of each kind, made ready for the path as a trained bundle is (``prepare_drafter``); "model":
    the tiny model itself as a whole-model drafter (int8: drafts never change outputs, and no path timing runs)."""
    if name == "prompt-lookup":
        return make_drafter(name)
    if name == "model":
        drafter = make_drafter(str(model_dir), target=target, width=2, depth=3, weights="int8")
        drafter.floor = 0.0  # a random model is unsure of every token: draft as deep as asked
        return drafter
    if name in ("eagle", "independent"):
        model = make_eagle_or_independent(target, name)
    elif name == "medusa":
        model = make_medusa(target)
    else:
        model = make_moa(target, int(name.removeprefix("moa-tli")))
    prepare_drafter(model, target)
    if name == "medusa":
        return MedusaDrafter(model)
    kind = {"eagle": EagleDrafter, "independent": IndependentDrafter}.get(name, MoADrafter)
    return kind(model, width=3, depth=3)


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("name", DRAFTERS)
def test_every_drafter_on_every_path_equals_plain_decoding(path_target, netsim_server, tiny_model_dir, name, where):
    target, address, plain = path_target
    drafter = drafter_for(name, target, tiny_model_dir)
    if where == "local":
        got = generate(LocalVerifier(target), drafter, PROMPT, NEW, Settings(max_tree_nodes=8))
    elif where == "remote":
        verifier = RemoteVerifier(address, drafter=drafter)
        try:
            got = generate(verifier, drafter, PROMPT, NEW, Settings(max_tree_nodes=8))
        finally:
            verifier.shutdown()
    else:
        with simulated_link(address, "none", netsim=netsim_server) as link:
            verifier = RemoteVerifier(link.address, drafter=drafter)
            try:
                cut_on_round(verifier, link, 2, 0.2)
                got = generate(
                    verifier, drafter, PROMPT, NEW,
                    Settings(
                        max_tree_nodes=8,
                        resilience=Resilience("verify", Backoff(base_s=0.02, cap_s=0.2, seed=1)),
                    ),
                )  # fmt: skip
            finally:
                verifier.shutdown()
        assert got.stats.disconnects >= 1, "the cut was not noticed"
    assert got.token_ids == plain, (name, where)
    if where == "local":
        assert got.stats.rounds < len(plain), (name, "drafting never saved a round")
