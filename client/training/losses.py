"""What each drafter is trained to minimise, on one frozen target forward (``TargetBatch``).

Losses live here, beside the training loop, so that the drafter modules are inference only. All are
distillation: KL(target ‖ drafter) on the next-token distribution (what greedy and speculative
acceptance reward), plus, for the drafters that predict the target's hidden states (EAGLE, MoA), a
SmoothL1 feature loss with weight 1 and the KL at ``KL_WEIGHT`` (as EAGLE's and MoA's code do).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from client.drafters.eagle import Eagle
from client.drafters.independent import Independent
from client.drafters.medusa import TOP_K, Medusa
from client.drafters.moa import MoA
from client.training.teacher import TargetBatch
from shared.tree import causal_mask

FEATURE_NOISE = 0.1  # EAGLE's training inputs get U(-0.1, 0.1) added to the true features, as EAGLE does
SEGMENT = (6, 15)  # MoA's draft lengths k ∈ [6, 15) for "variable future length"
LONG_SEGMENT = (32, 65)  # with --long-drafts: the horizon of generating alone after a disconnection

KL_WEIGHT = 0.1  # on the distillation loss; the feature loss has weight 1 (as in EAGLE's and MoA's code)
HEAD_DECAY = 0.8  # Medusa head k's loss weight is HEAD_DECAY^(k-1): far heads are hard, and wrong more often


def agreement(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """How often the drafter's top-1 token is the target's: what greedy acceptance rewards (a 0-d tensor: reading
    it would wait for the device, so the trainer reads metrics only when it shows them)."""
    return (student_logits.argmax(-1) == teacher_logits.argmax(-1)).float().mean()


def distill_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """KL(p_target || q_drafter) per position, averaged: the drafter learns the target's whole distribution."""
    p_log = F.log_softmax(teacher_logits.float(), dim=-1)
    q_log = F.log_softmax(student_logits.float(), dim=-1)
    return (p_log.exp() * (p_log - q_log)).sum(-1).mean()


def loss(model, tb: TargetBatch, generator: torch.Generator | None = None, on_policy: float = 0.0,
         staircase: float = 0.0, long_drafts: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
    """``model``'s training loss on ``tb`` and its metrics (kl, feat, acc: top-1 agreement with the target), as
    detached 0-d tensors: no host sync per step. ``on_policy``: the weight of a second pass in which an EAGLE
    drafter feeds on its own predicted features (``eagle_loss``); ``staircase``: the probability that a MoA
    sequence's SA sees only its own draft; ``long_drafts``: the share of MoA sequences cut into drafts as long
    as offline generation runs (``moa_loss``)."""
    if model.kind == "eagle":
        return eagle_loss(model, tb, generator, on_policy)
    if model.kind == "moa":
        return moa_loss(model, tb, generator, staircase, long_drafts)
    if model.kind == "medusa":
        return medusa_loss(model, tb)
    return independent_loss(model, tb, generator)


def moa_loss(model: MoA, tb: TargetBatch, generator: torch.Generator | None = None,
             staircase: float = 0.0, long_drafts: float = 0.0) -> tuple[torch.Tensor, dict]:  # fmt: skip
    """λ0·KL(target ‖ drafter) + λ1·SmoothL1 on the predicted hidden state, over random draft segments.

    Variable future length: the sequence is cut into drafts of 6..14 tokens; each draft sees
    the target's memory only up to where it began, and its TLI layers the target's KV before it and
    their own from it on (the stand-ins a drafter has while the server has not answered). For TLI>0
    the feature loss is split between the TLI input (what the drafter predicts) and the final hidden
    state. With probability ``staircase`` a sequence's SA sees only the current draft
    (``MoA.forward_train``); with probability ``long_drafts`` its drafts are 32..64 tokens long, the
    horizon over which a disconnected client generates alone (trees never go past 14).
    """
    L, N = model.cfg.num_layers, model.cfg.tli
    B, T = tb.input_ids.shape
    seg_start = draft_segments(B, T, generator=generator, long_share=long_drafts)
    seg_start = seg_start.to(tb.input_ids.device, non_blocking=True)
    stairs = None
    if staircase > 0:
        device = generator.device if generator is not None else tb.input_ids.device
        stairs = (torch.rand(B, generator=generator, device=device) < staircase).to(tb.input_ids.device)
    hidden = model.forward_train(tb.input_ids, tb.kv, seg_start, staircase=stairs)
    tli_kv = list(zip(tb.keys[L - N :], tb.values[L - N :], strict=True)) if N else None
    out = model.head_train(hidden, seg_start, tli_kv)
    r, c = tb.rows, tb.cols
    logits = model.parts.logits(out[r, c])
    kl = distill_kl(tb.teacher_logits, logits)
    feat = feature_loss(hidden[r, c], tb.hidden[L - N][r, c])
    if N:
        final = feature_loss(model.parts.norm(out[r, c]), tb.hidden[L][r, c])
        feat = (feat + final) / 2
    metrics = {"kl": kl.detach(), "feat": feat.detach(), "acc": agreement(tb.teacher_logits, logits)}
    return KL_WEIGHT * kl + feat, metrics


def eagle_loss(model: Eagle, tb: TargetBatch, generator: torch.Generator | None = None,
               on_policy: float = 0.0) -> tuple[torch.Tensor, dict]:  # fmt: skip
    """SmoothL1(f̂_p, f_p) + 0.1·KL(target ‖ drafter) at the trained positions p >= 1, inputs noised.

    With ``on_policy`` > 0 a second pass feeds every position the drafter's own prediction of the feature
    it is given (f̂_{p-1} instead of f_{p-1}), as its second draft step and every offline step do, and its
    loss is mixed in at that weight: teacher forcing alone never shows EAGLE its own errors (its known
    weakness when it drafts deep or generates offline).
    """
    features = tb.hidden[-1].float()
    noise = torch.rand(features.shape, generator=generator,
                       device=features.device if generator is None else generator.device)  # fmt: skip
    predicted = model.forward_train(features + (2 * noise.to(features.device) - 1) * FEATURE_NOISE, tb.input_ids)
    total, metrics = _eagle_terms(model, tb, predicted, features)
    if on_policy > 0:
        own = torch.cat([features[:, :1], predicted.detach().float()], dim=1)  # own[:, p] = f̂_p for p >= 1
        again, own_metrics = _eagle_terms(model, tb, model.forward_train(own, tb.input_ids), features)
        total = (1 - on_policy) * total + on_policy * again
        metrics["acc_own"] = own_metrics["acc"]
    return total, metrics


def _eagle_terms(model: Eagle, tb: TargetBatch, predicted: torch.Tensor, features: torch.Tensor
                 ) -> tuple[torch.Tensor, dict]:  # fmt: skip
    keep = tb.cols > 0
    rows, cols, teacher = tb.rows[keep], tb.cols[keep], tb.teacher_logits[keep]
    out = predicted[rows, cols - 1]
    feat = F.smooth_l1_loss(out.float(), features[rows, cols])
    logits = model.parts.logits(out)
    kl = distill_kl(teacher, logits)
    return feat + KL_WEIGHT * kl, {"kl": kl.detach(), "feat": feat.detach(), "acc": agreement(teacher, logits)}


def medusa_loss(model: Medusa, tb: TargetBatch) -> tuple[torch.Tensor, dict]:
    """Σ_k 0.8^(k-1)·KL(target ‖ head k): head k at a trained position t learns the target's distribution of token
    t+1+k, i.e. the teacher's logits at position t+k, wherever that position is trained too.

    Metrics: ``acc`` is head 1's agreement, ``acc<k>`` head k's; ``ranks`` [N, K] (uint8, capped at ``TOP_K``)
    is the rank of the target's token among each head's logits at the positions where every head has one,
    scored before this step trains on them — what ``sparse_tree`` builds Medusa's tree from.
    """
    B, T = tb.input_ids.shape
    K = model.cfg.heads
    index = torch.full((B, T + K), -1, dtype=torch.long, device=tb.rows.device)  # teacher row of each position
    index[tb.rows, tb.cols] = torch.arange(tb.tokens, device=tb.rows.device)
    logits = model(tb.hidden[-1][tb.rows, tb.cols])  # [K, M, V]
    total, metrics, ranks, every = 0.0, {}, [], torch.ones_like(tb.rows, dtype=torch.bool)
    for k in range(1, K + 1):
        row = index[tb.rows, tb.cols + k]
        valid = row >= 0
        every &= valid
        teacher, student = tb.teacher_logits[row[valid]], logits[k - 1][valid]
        total = total + HEAD_DECAY ** (k - 1) * distill_kl(teacher, student)
        metrics["acc" if k == 1 else f"acc{k}"] = agreement(teacher, student)
        with torch.no_grad():
            label = tb.teacher_logits[row.clamp_min(0)].argmax(-1, keepdim=True)
            ranks.append((logits[k - 1] > logits[k - 1].gather(-1, label)).sum(-1).clamp_max(TOP_K))
    metrics["ranks"] = torch.stack(ranks, dim=1)[every].to(torch.uint8)
    return total, metrics


def independent_loss(model: Independent, tb: TargetBatch,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:  # fmt: skip
    """KL(target ‖ drafter) at the trained positions; nothing is random, so ``generator`` is unused."""
    B, T = tb.input_ids.shape
    positions = torch.arange(T, device=tb.input_ids.device).expand(B, T)
    hidden = model(tb.input_ids, positions, causal_mask(T, tb.input_ids.device))
    logits = model.parts.logits(hidden[tb.rows, tb.cols])
    kl = distill_kl(tb.teacher_logits, logits)
    return kl, {"kl": kl.detach(), "acc": agreement(tb.teacher_logits, logits)}


def feature_loss(predicted: torch.Tensor, true: torch.Tensor) -> torch.Tensor:
    """SmoothL1 in units of each true state's RMS.

    The residual stream entering layer L-N (what a TLI>0 drafter predicts) is many times larger
    than a normed final state; unscaled, its loss stays in SmoothL1's linear regime and drowns the
    KL term, so TLI>0 drafters learned agreement worse than TLI=0 ones (0.14 vs 0.21 at 613k tokens).
    """
    scale = true.float().pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-6)
    return F.smooth_l1_loss(predicted.float() / scale, true.float() / scale)


def draft_segments(batch: int, length: int, generator: torch.Generator | None = None,
                   long_share: float = 0.0) -> torch.Tensor:  # fmt: skip
    """[B, T] start of the draft each position belongs to: random cuts every 6..14 tokens, random phase;
    with probability ``long_share`` a sequence is cut every 32..64 tokens instead.

    Drawn as one tensor op on the generator's device (no Python loop, no host round trip): segment
    lengths [B, n], their running ends shifted back by a random phase, and each position looked up among them.
    """
    low, high = SEGMENT
    device = generator.device if generator is not None else None
    n = length // low + 4  # enough segments to cover ``length`` whatever the phase
    lengths = torch.randint(low, high, (batch, n), generator=generator, device=device)
    phase = torch.randint(0, high - 1, (batch, 1), generator=generator, device=device)
    if long_share > 0:
        long_low, long_high = LONG_SEGMENT
        longer = torch.rand(batch, 1, generator=generator, device=device) < long_share
        lengths = torch.where(longer, torch.randint(long_low, long_high, (batch, n), generator=generator,
                                                    device=device), lengths)  # fmt: skip
        phase = torch.where(longer, torch.randint(0, long_high - 1, (batch, 1), generator=generator,
                                                  device=device), phase)  # fmt: skip
    ends = lengths.cumsum(1) - phase
    starts = (ends - lengths).clamp_min(0)
    positions = torch.arange(length, device=ends.device).expand(batch, length).contiguous()
    return starts.gather(1, torch.searchsorted(ends, positions, right=True))
