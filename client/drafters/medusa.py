"""The Medusa drafter (Cai et al., 2024): K decoding heads on the target's last hidden state.

No draft model runs: the target's final (normed) hidden state f_q already predicts token q+1 through
its LM head, and head k — one residual block x + SiLU(W_k x + b_k) before the same frozen LM head —
predicts token q+1+k from the same f_q. A round reads the K heads once, takes each head's top
candidates, and arranges them in a *sparse tree*: the paths of head ranks (r_1, ..., r_d) that were
most often all right on held-out data, measured while training (``sparse_tree``), so the tree spends
its nodes where acceptance is likely. Head k does not see the tokens drafted before it, so a node's
token depends only on its depth and rank — what makes drafting one matmul per head, and what limits
how deep Medusa's drafts survive.

Medusa-1 trains the heads alone on a frozen target: each needs only f_q, which the target computes once
per training token, never a drafter forward per draft step. The heads read the ``hidden`` payload that
the server already sends for EAGLE.

Without the server (a link cut), no new f_q arrives: the heads of the last one still give the next
K tokens (head k for the k-th token after it), after which the drafter has nothing to offer and the
loop waits for the link (``client.loop.offline``).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from client.drafters.base import DRAFT_PRECISIONS, Drafter
from client.drafters.target_parts import DrafterModel, TargetParts
from shared.engine.linear import Linear
from shared.features import Features
from shared.payload import PayloadSpec
from shared.tree import DraftTree

HEADS = 4  # Medusa's default K
TOP_K = 10  # candidates per head a sparse tree may use (Medusa's trees use ranks < 10)
TREE_NODES = 64  # the largest sparse tree kept in a bundle; a round uses its first max_nodes nodes
# before any measurement: rank r at depth d is assumed right with probability 0.6^d / (r+1) — a chain of
# top-1s first, then siblings; a trained bundle replaces it with measured paths
_PRIOR = 0.6


@dataclass
class MedusaConfig:
    hidden_size: int
    heads: int = HEADS
    #: the sparse tree, parents first: each node a path of head ranks from the root, e.g. [0, 1] = head 1's
    #: top token, then head 2's second; with its measured probability of being accepted whole
    tree: list[list[int]] = field(default_factory=list)
    tree_probs: list[float] = field(default_factory=list)

    @classmethod
    def for_target(cls, parts: TargetParts, heads: int = HEADS) -> MedusaConfig:
        tree, probs = prior_tree(heads)
        return cls(parts.hidden_size, heads, tree, probs)

    def to_dict(self) -> dict:
        return asdict(self)


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W starting at zero: a fresh head is the LM head itself (Medusa's initialisation)."""

    def __init__(self, size: int):
        super().__init__()
        self.linear = Linear(size, size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class Medusa(DrafterModel):
    """K residual heads; the target's frozen LM head (cut to the draft vocabulary) in ``parts``."""

    kind = "medusa"
    payload_forms = ("hidden",)  # the target's final hidden states

    def __init__(self, cfg: MedusaConfig, parts: TargetParts):
        super().__init__()
        self.needs_final_state(parts)
        if cfg.heads < 1:
            raise ValueError(f"Medusa needs at least one head, got heads={cfg.heads}")
        self.cfg = cfg
        self.heads = nn.ModuleList(ResBlock(cfg.hidden_size) for _ in range(cfg.heads))
        self.parts = parts

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Logits [K, ..., V] of tokens q+2..q+1+K from final hidden states f_q [..., E] (head k at index k-1).

        One LM-head product for all heads: drafting from one state multiplies K rows by the head, which then
        streams through memory once, not K times."""
        x = features.to(self.parts.norm.weight.dtype)
        return self.parts.logits(torch.stack([head(x) for head in self.heads]))


def prior_tree(heads: int, nodes: int = TREE_NODES) -> tuple[list[list[int]], list[float]]:
    """A tree for heads never measured (``_PRIOR``): the best ``nodes`` paths under an assumed accuracy."""
    scores: dict[tuple[int, ...], float] = {}
    frontier = [((), 1.0)]
    for _ in range(heads):
        frontier = [((*p, r), s * _PRIOR / (r + 1)) for p, s in frontier for r in range(TOP_K)]
        frontier.sort(key=lambda ps: -ps[1])
        frontier = frontier[:nodes]
        scores.update(frontier)
    return _best_paths(scores, nodes)


def sparse_tree(ranks: torch.Tensor, nodes: int = TREE_NODES) -> tuple[list[list[int]], list[float]]:
    """Medusa's sparse tree from data: the ``nodes`` rank paths most often accepted whole, parents first.

    ``ranks`` [N, K]: for N held-out positions, the rank of the target's token among each head's logits
    (>= ``TOP_K``: not among the candidates). A path (r_1..r_d) is accepted at a position when head j's
    rank-r_j token is the target's for every j <= d, so its probability is counted directly — no
    assumption that the heads err independently. A prefix is accepted whenever its path is, so it counts
    at least as often: the best paths always form a tree.
    """
    if ranks.ndim != 2 or not len(ranks):
        raise ValueError(f"sparse_tree needs ranks [N, K] of at least one position, got shape {tuple(ranks.shape)}")
    counts: Counter[tuple[int, ...]] = Counter()
    for row in ranks.tolist():
        path: tuple[int, ...] = ()
        for r in row:
            if r >= TOP_K:
                break
            path = (*path, int(r))
            counts[path] += 1
    return _best_paths({p: c / len(ranks) for p, c in counts.items()}, nodes)


def _best_paths(scores: dict[tuple[int, ...], float], nodes: int) -> tuple[list[list[int]], list[float]]:
    """The ``nodes`` best-scoring paths; ties to the shallower and then the lower ranks (a parent before its child)."""
    best = sorted(scores.items(), key=lambda ps: (-ps[1], len(ps[0]), ps[0]))[:nodes]
    return [list(p) for p, _ in best], [s for _, s in best]


class MedusaDrafter(Drafter):
    """Drafts from the heads of the newest final hidden state it holds.

    The target sends the features of every committed token but the root (which it has not run), so
    normally the newest is f_{root-1}, whose head k predicts the token k after the root. After tokens
    committed without features (offline) the heads of an older f_q still reach ``K - lag`` tokens ahead.
    ``width`` caps the ranks used per head and ``depth`` the tree's depth (EAGLE-2's width does not apply: the
    tree's shape is the one measured in training).
    """

    def __init__(self, model: Medusa, width: int = TOP_K, depth: int | None = None, name: str | None = None):
        self.model = model.eval()
        self.width, self.depth = width, depth or model.cfg.heads
        self.name = name or model.kind
        self.paths = [tuple(p) for p in model.cfg.tree]
        self.probs = list(model.cfg.tree_probs)
        if len(self.probs) != len(self.paths):
            raise ValueError(f"a Medusa tree needs one probability per path: {len(self.paths)} paths, "
                             f"{len(self.probs)} probabilities")  # fmt: skip

    def payload_specs(self, precisions: tuple[str, ...] = DRAFT_PRECISIONS) -> list[PayloadSpec]:
        return [PayloadSpec("hidden", p) for p in precisions]

    def begin(self, tokens: list[int], features: Features | None = None) -> None:
        self.tokens: list[int] = []
        self.feature: torch.Tensor | None = None  # the newest f_q
        self.at = -1  # its position q
        self._heads: tuple[int, torch.Tensor] | None = None  # (q, the heads' top tokens [K, width]) of the last read
        self.absorb(tokens, features)

    def absorb(self, tokens: list[int], features: Features | None = None) -> None:
        self.tokens += tokens
        if features is None or features.hidden is None or not len(features):
            return
        end = features.start + len(features) - 1
        if end >= len(self.tokens):
            raise ValueError(f"features up to position {end} for a sequence of {len(self.tokens)} tokens")
        if end > self.at:
            self.feature, self.at = features.hidden[-1], end

    def rewind(self, n: int) -> None:
        if n > 0:
            self.tokens = self.tokens[:-n]
            if self.at > len(self.tokens) - 2:  # a feature of a forgotten token: the context it saw is gone
                self.feature, self.at, self._heads = None, -1, None

    @torch.inference_mode()
    def _top(self) -> torch.Tensor:
        """The heads' ``width`` best tokens [K, width] for the newest feature (read once per feature)."""
        if self._heads is None or self._heads[0] != self.at:
            logits = self.model(self.feature.to(self.model.parts.norm.weight.device))
            top = logits.topk(min(self.width, logits.shape[-1]), dim=-1).indices
            vocab = self.model.parts.vocab_ids
            self._heads = (self.at, (vocab[top] if vocab is not None else top).cpu())
        return self._heads[1]

    def propose(self, max_nodes: int, depth: int | None = None) -> DraftTree:
        lag = len(self.tokens) - 2 - self.at  # heads already spent on tokens committed since f_q
        if max_nodes < 1 or self.feature is None or lag >= self.model.cfg.heads:
            return DraftTree()
        top = self._top()[lag:]
        limit = min(self.depth if depth is None else depth, len(top))
        tree, index = DraftTree(scores=[]), {(): -1}
        for path, prob in zip(self.paths, self.probs, strict=True):
            if len(path) > limit or path[-1] >= top.shape[1] or path[:-1] not in index:
                continue
            index[path] = tree.add(int(top[len(path) - 1, path[-1]]), index[path[:-1]])
            tree.scores.append(math.log(max(prob, 1e-9)))
            if len(tree) == max_nodes:
                break
        return tree

