"""MoA's Layer Self-Attention, the one piece of a drafter that may run on either side of the wire.

A verified token's K and V from every target layer form a short sequence (positions = layer
indices); one bidirectional block mixes them, a mean pools them and a linear map gives one
memory vector per token. In payload form ``kv`` the client runs it on the all-layer KV the
server ships (~23 KB per token at fp16 for SmolLM2); in form ``lsa`` the server runs it and ships
the memory vector alone (~1.1 KB). The client's MoA drafter *is* a LayerSelfAttention plus its
other parts, so both sides load the same weights under the same names from the same bundle.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import nn

from shared.bundles import read_bundle, read_weights
from shared.engine.layers import Block, RMSNorm
from shared.errors import SplitspecError

WEIGHTS = ("lsa_in.", "lsa_proj.", "layer_pos", "lsa.", "to_memory.")  # what LSA owns in a MoA bundle


class LayerSelfAttention(nn.Module):
    def __init__(self, num_layers: int, kv_width: int, hidden_size: int, lsa_dim: int, lsa_heads: int,
                 lsa_mlp_hidden: int, eps: float):  # fmt: skip
        super().__init__()
        self.lsa_in = RMSNorm(kv_width, eps)
        self.lsa_proj = nn.Linear(kv_width, lsa_dim)
        self.layer_pos = nn.Parameter(torch.zeros(num_layers, lsa_dim))
        self.lsa = Block(lsa_dim, lsa_heads, lsa_heads, lsa_dim // lsa_heads, lsa_mlp_hidden, eps)
        self.to_memory = nn.Linear(lsa_dim, hidden_size)
        nn.init.normal_(self.layer_pos, std=0.02)

    @staticmethod
    def dims(model_config: dict) -> dict:
        """The constructor's arguments from a MoA bundle's ``model`` config."""
        keys = ("num_layers", "kv_width", "hidden_size", "lsa_dim", "lsa_heads", "lsa_mlp_hidden", "eps")
        return {k: model_config[k] for k in keys}

    def memory(self, kv: torch.Tensor) -> torch.Tensor:
        """[..., L, Ekv] per-layer KV of verified tokens -> [..., E] memory vectors."""
        shape = kv.shape[:-2]
        if kv.numel() == 0:  # no tokens: a drafter that holds every feature of a prompt asks for none
            return kv.new_zeros(*shape, self.to_memory.out_features)
        x = self.lsa_proj(self.lsa_in(kv.reshape(-1, *kv.shape[-2:]))) + self.layer_pos
        x = self.lsa(x, mask=None, rope=None)  # bidirectional over the layers
        return self.to_memory(x.mean(dim=1)).view(*shape, -1)


def load_lsa(path: Path, target, device=None, dtype: torch.dtype | None = None) -> tuple[LayerSelfAttention, dict]:
    """The LSA of the MoA bundle at ``path``, checked against ``target``; refuses non-MoA bundles."""
    config = read_bundle(path, target)
    if config["kind"] != "moa":
        raise SplitspecError(f"drafter bundle {path} is a {config['kind']!r} drafter; only MoA bundles have an LSA")
    lsa = LayerSelfAttention(**LayerSelfAttention.dims(config["model"]))
    state = {k: v for k, v in read_weights(path).items() if k.startswith(WEIGHTS)}
    missing, unexpected = lsa.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SplitspecError(f"{path}: LSA weights do not fit: missing {missing}, unexpected {unexpected}")
    return lsa.to(device or target.device, dtype or target.dtype).eval(), config


def weights_digest(path: Path) -> str:
    """A short hash of a bundle's weights file: two sides naming one bundle must hold the same weights."""
    digest = hashlib.sha256()
    with open(Path(path) / "weights.safetensors", "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]
