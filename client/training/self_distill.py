"""Self-distillation (Medusa, §3.3): training data in the target's own words.

A drafter is judged by how often it guesses what *the target* says next, but ShareGPT's answers
were written by another model; where the target would have answered differently, a drafter learns
contexts it never meets when drafting. So the target answers the training prompts itself — each
conversation's opening (system and) user turn, in the same shuffled order as ``TrainingStream``,
never an evaluation prompt — and the answers become sequences of the usual ``(ids, loss_mask)`` form,
which ``write_shards`` stores like any other and every drafter trains on.

Generation runs on the serving engine (``TargetSession`` steps through ``Transformer.forward_many``,
as the server's batcher does): ``batch`` sequences per forward, a finished one replaced by the next
prompt at once, so the forward stays full.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from client.training.datasets import MIN_ASSISTANT_TOKENS, TrainingStream, encode_chat, is_contaminated
from shared.acceptance import SamplingParams
from shared.errors import SplitspecError

MIN_ANSWER_ROOM = 64  # a prompt must leave this many tokens of seq_len for its answer (a quarter of a short seq_len)


def opening(messages: list[dict]) -> list[dict] | None:
    """The conversation up to its first user turn (with a system message before it, if any); None if it has none."""
    for i, message in enumerate(messages):
        if message["role"] == "user":
            return messages[: i + 1]
        if message["role"] != "system":
            return None
    return None


def prompts(tokenizer, seq_len: int, seed: int = 0, skip: int = 0,
            conversations: Sequence[list[dict]] | None = None) -> Iterator[tuple[int, list[int]]]:  # fmt: skip
    """(stream position after it, prompt ids) for each usable opening, in ``TrainingStream``'s order for ``seed``."""
    order = TrainingStream(tokenizer, seq_len, seed=seed, skip=skip, conversations=conversations)
    for _ in range(len(order.conversations)):
        position = order.position
        messages = order.conversation_at(position)
        order.position += 1
        head = opening(messages)
        if head is None or is_contaminated(messages):
            continue
        ids, _ = encode_chat(tokenizer, head, answer_prompt=True)
        if len(ids) + min(MIN_ANSWER_ROOM, seq_len // 4) <= seq_len:
            yield position + 1, ids
    raise SplitspecError(f"no usable prompt in a whole pass over {len(order.conversations)} conversations")


class SelfDistillStream:
    """An endless stream of ``(ids, loss_mask)``: a training prompt and the target's answer (mask 1 on the answer).

    ``temperature`` 0 answers greedily (what greedy drafting meets); above it, a draw from the target at that
    temperature, seeded per prompt. Answers end at an end-of-turn token or when the sequence fills ``seq_len``.
    ``position`` is the stream position after the newest prompt whose answer was returned (answers come back in
    the order they finish: a stream resumed there skips the few prompts that were still being answered).
    """

    def __init__(self, target, seq_len: int, seed: int = 0, skip: int = 0, batch: int = 64,
                 temperature: float = 0.0, conversations: Sequence[list[dict]] | None = None):  # fmt: skip
        if batch < 1:
            raise SplitspecError(f"self-distillation needs a batch of at least one sequence, got {batch}")
        self.target, self.seq_len, self.batch, self.temperature = target, seq_len, batch, temperature
        self.prompts = prompts(target.tokenizer, seq_len, seed, skip, conversations)
        self.position = skip
        self.stop = set(target.eos_token_ids) | set(target.tokenizer.all_special_ids)
        self.live: list[tuple[int, int, object]] = []  # (position, prompt length, session)
        self.done: list[tuple[int, list[int], list[int]]] = []
        self.generated = 0  # answer tokens made so far

    def __iter__(self) -> SelfDistillStream:
        return self

    def __next__(self) -> tuple[list[int], list[int]]:
        while not self.done:
            self._fill()
            self._step()
        position, ids, mask = self.done.pop(0)
        self.position = max(self.position, position)
        return ids, mask

    def _fill(self) -> None:
        while len(self.live) < self.batch:
            position, ids = next(self.prompts)
            session = self.target.session(SamplingParams(temperature=self.temperature, seed=position))
            session.prefill(ids)
            self.live.append((position, len(ids), session))
            self._finish_if_done(len(self.live) - 1)

    @torch.inference_mode()
    def _step(self) -> None:
        sessions = [session for _, _, session in self.live]
        engine = self.target.engine
        hidden = engine.forward_many([session.decode_step().part for session in sessions])
        logits = engine.logits(torch.cat(hidden))
        for i, session in enumerate(sessions):
            session.pick(logits[i : i + 1])
        self.generated += len(self.live)
        for i in reversed(range(len(self.live))):
            self._finish_if_done(i)

    def _finish_if_done(self, i: int) -> None:
        position, prompt, session = self.live[i]
        tokens = session.tokens
        if tokens[-1] not in self.stop and len(tokens) < self.seq_len:
            return
        del self.live[i]
        if len(tokens) - prompt >= MIN_ASSISTANT_TOKENS:
            self.done.append((position, list(tokens), [0] * prompt + [1] * (len(tokens) - prompt)))
