"""Draft trees and attention masks: the one place that knows how a tree is laid out, masked and positioned.

A tree is a list of drafted tokens plus, for each, the index of its parent. Parent ``-1`` is
the *root*: the newest committed token, whose KV is not yet in the target's cache. Parents
always come before their children, so a node's index is larger than its parent's; that single
rule makes every tree walk a forward scan and lets the verifier build the mask in one pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ROOT = -1


@dataclass
class DraftTree:
    """Drafted tokens and their parents (``-1`` = the root token)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    # the drafter's cumulative log-probability of each node, when it has one (never sent: the
    # client's adaptive policy reads it to decide how much of the tree is worth verifying)
    scores: list[float] | None = None
    # a copy's chance that each node is kept (its path taken), as earlier copies held against the text that came
    # (``shared.lookup.CopyRecord``); None for a drafted tree, or a copy with several branches (never sent either)
    kept: list[float] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def head(self, k: int) -> DraftTree:
        """The first ``k`` nodes: itself a tree when nodes come parents first (EAGLE-2's rank order)."""
        return DraftTree(self.tokens[:k], self.parents[:k], None if self.scores is None else self.scores[:k],
                         None if self.kept is None else self.kept[:k])

    def descendants(self, node: int) -> list[int]:
        """The nodes under ``node`` (``ROOT``: every node), in the tree's order: ``subtree(node)``'s nodes by their
        index in this tree."""
        under, found = {node}, []
        for i in range(node + 1, len(self.tokens)):
            if self.parents[i] in under:
                under.add(i)
                found.append(i)
        return found

    def subtree(self, node: int) -> DraftTree:
        """The nodes under ``node`` as a tree rooted at it (its children hang from the root), in the same order, scores
        counted from it: the tree a drafter would have drafted had ``node`` been committed (rank order kept)."""
        nodes = self.descendants(node)
        index = {node: ROOT} | {i: k for k, i in enumerate(nodes)}
        tokens, parents = [self.tokens[i] for i in nodes], [index[self.parents[i]] for i in nodes]
        base = self.scores[node] if self.scores is not None and node != ROOT else 0.0
        scores = None if self.scores is None else [self.scores[i] - base for i in nodes]
        held = self.kept[node] if self.kept is not None and node != ROOT else 1.0
        kept = None if self.kept is None or held <= 0 else [self.kept[i] / held for i in nodes]
        return DraftTree(tokens, parents, scores, kept)

    def chain_of_firsts(self) -> list[int]:
        """From the root down, each node's first child (in rank order its likeliest): the path a confident target
        takes, node indices, ending at a leaf."""
        path, at = [], ROOT
        for i, parent in enumerate(self.parents):
            if parent == at:
                path.append(i)
                at = i
        return path

    @classmethod
    def chain(cls, tokens: list[int]) -> DraftTree:
        """A linear draft: each token is the child of the one before."""
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    def follow(self, tokens: list[int]) -> list[int]:
        """The nodes along ``tokens`` from the root, as far as the tree has them: what a target that chose
        ``tokens`` would accept (greedy), node indices from the root down."""
        path, at = [], ROOT
        for token in tokens:
            at = next((i for i, (t, p) in enumerate(zip(self.tokens, self.parents, strict=True))
                       if p == at and t == token), None)  # fmt: skip
            if at is None:
                break
            path.append(at)
        return path

    def add(self, token: int, parent: int = ROOT) -> int:
        """Append a node and return its index."""
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        return len(self.tokens) - 1


def validate_tree(tokens: list[int], parents: list[int], vocab_size: int, max_nodes: int) -> None:
    """Raise ValueError naming the first problem with a tree received from elsewhere."""
    if len(tokens) != len(parents):
        raise ValueError(f"tree has {len(tokens)} tokens but {len(parents)} parent indices; expected equal counts")
    if len(tokens) > max_nodes:
        raise ValueError(f"tree has {len(tokens)} nodes, over the limit of {max_nodes}")
    for i, (tok, par) in enumerate(zip(tokens, parents, strict=True)):
        if not 0 <= tok < vocab_size:
            raise ValueError(f"token id {tok} at node {i} is outside the vocabulary [0, {vocab_size})")
        if not ROOT <= par < i:
            raise ValueError(f"parent index {par} of node {i} must be -1 (root) or a smaller node index")


def depths(parents: list[int]) -> list[int]:
    """Depth of each node; children of the root have depth 1."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p == ROOT else out[p] + 1)
    return out


def children(parents: list[int]) -> list[list[int]]:
    """Children of each node, root first: ``result[0]`` is the root's, ``result[i + 1]`` node i's."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        out[p + 1].append(i)
    return out


def path_to(parents: list[int], node: int) -> list[int]:
    """Node indices from the root's child down to ``node`` (inclusive)."""
    path = []
    while node != ROOT:
        path.append(node)
        node = parents[node]
    return path[::-1]


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """Boolean [n+1, n+1] mask over root + nodes: True where a row may attend to a column.

    Row/column 0 is the root; a node sees the root, its ancestors and itself.
    """
    n = len(parents)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[0, 0] = True
    for i, p in enumerate(parents):
        mask[i + 1] = mask[p + 1]
        mask[i + 1, i + 1] = True
    return mask


def tree_mask(parents: list[int], prefix_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean [1, n+1, prefix_len+n+1] mask (True = may attend) for root + nodes written after a cached
    prefix: everything in the prefix, then each node's ancestors and itself (the root sees itself)."""
    n = len(parents)
    allowed = torch.ones(n + 1, prefix_len + n + 1, dtype=torch.bool)
    allowed[:, prefix_len:] = ancestor_mask(parents)
    return allowed[None].to(device)


def tree_attention_mask(
    parents: list[int], prefix_len: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """The same mask in transformers' additive form, [1, 1, n+1, prefix_len+n+1] (0 = may attend): for
    checking the engine against a transformers model fed the same tree."""
    allowed = tree_mask(parents, prefix_len)[0]
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None].to(device)


def tree_positions(parents: list[int], prefix_len: int) -> list[int]:
    """Absolute positions of root + nodes: the root sits at ``prefix_len``, a node at prefix_len + depth."""
    return [prefix_len] + [prefix_len + d for d in depths(parents)]


def causal_mask(n: int, device=None) -> torch.Tensor:
    """[1, n, n]: each of n tokens sees itself and the ones before it."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()[None]


def causal_from(start: int, n: int, device=None) -> torch.Tensor:
    """[1, n, start + n]: n new tokens at slots start.. see every slot before them and themselves causally."""
    mask = torch.ones(n, start + n, dtype=torch.bool, device=device)
    mask[:, start:] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return mask[None]


def node_mask(parents: list[int], new: int, visible: int, slots: list[int], total: int, device=None) -> torch.Tensor:
    """[1, new, total] mask for the last ``new`` draft nodes: every slot < ``visible`` plus each node's path.

    ``parents`` holds the parent of every draft node of the tree so far (an index into the same
    list, or -1 under the committed context); ``slots`` where each node's KV sits in the cache.
    """
    mask = torch.zeros(new, total, dtype=torch.bool)
    mask[:, :visible] = True
    for row, node in enumerate(range(len(parents) - new, len(parents))):
        while node >= 0:
            mask[row, slots[node]] = True
            node = parents[node]
    return mask[None].to(device)
