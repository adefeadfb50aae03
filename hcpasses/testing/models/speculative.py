"""Greedy speculative decoding with the MTP drafter (EAGLE style: draft with the drafter, verify with the target).

One round, with ``t`` the last emitted token (not yet run through the target) at position N and the
drafter caught up to position N-1 (its last row predicted ``d_1``, the token at N+1):

1. draft: ``d_1`` = argmax of that row; draft step j >= 2 runs the drafter on its own output streams of
   step j-1 and ``d_{j-1}``, one row, and takes ``d_j``;
2. verify: the target runs ``[t, d_1, ..., d_k]`` in one forward; ``g_i`` = its argmax after each;
3. accept the longest prefix with ``d_i == g_i`` (a drafts) and emit ``g_1..g_{a+1}``: the accepted drafts
   and the bonus token ``g_{a+1}``;
4. roll back: the target keeps positions up to N+a; the drafter drops its rows of draft steps >= 2 (they
   read drafter streams in place of target states) and catches up on positions N..N+k with the target's
   states and tokens ``g_1..g_{k+1}`` (for i <= a these are the emitted tokens), keeps rows up to N+a and
   takes row N+a for the next round's ``d_1``. Rows after N+a are wasted work, but causal attention hides
   them from row N+a, and every catch-up has the same k+1 rows: one compiled graph, CUDA-graph friendly.

Every emitted token is the target's own greedy choice, so the output is exactly the target's greedy decoding
(:func:`greedy_decode`). The loop calls three step functions (:class:`StepFunctions`: prefill, draft,
verify) that a caller may wrap with ``torch.compile``. ``recompute=True`` runs every step on the whole
sequence from empty caches instead (no cache reuse, no rollback of cached tensors): the reference for the
cached mode.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .decoder import DecoderCache, HCDecoder, truncate_cache
from .mtp import MTPDrafter

DRAFT_STEPS = 2

StepOutput = tuple[torch.Tensor, torch.Tensor, DecoderCache]  # logits [T, vocab], state or streams, grown cache


class PrefillResult(NamedTuple):
    """The prompt through both models: logits, the drafter's output streams ``[T, n*S]`` and both caches."""

    target_logits: torch.Tensor
    drafter_logits: torch.Tensor
    drafter_streams: torch.Tensor
    target_cache: DecoderCache
    drafter_cache: DecoderCache


def next_token_ids(input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The token after each of ``input_ids``: the rest of the prompt, then the target's greedy next token."""
    return torch.cat([input_ids[1:], logits[-1:].argmax(-1)])


def prefill_step(
    target: HCDecoder,
    drafter: MTPDrafter,
    input_ids: torch.Tensor,
    target_cache: DecoderCache,
    drafter_cache: DecoderCache,
) -> PrefillResult:
    """Target then drafter over a prompt; the drafter's row i reads the target's state i and token i+1."""
    logits, state, target_cache = target.step(input_ids, target_cache)
    drafter_logits, streams, drafter_cache = drafter.step(state, next_token_ids(input_ids, logits), drafter_cache)
    return PrefillResult(logits, drafter_logits, streams, target_cache, drafter_cache)


@dataclass(frozen=True)
class StepFunctions:
    """What the loop calls: ``prefill(ids, target_cache, drafter_cache)``, ``draft(state, next_ids, cache)``
    (the drafter's step) and ``verify(ids, cache)`` (the target's step)."""

    prefill: Callable[[torch.Tensor, DecoderCache, DecoderCache], PrefillResult]
    draft: Callable[[torch.Tensor, torch.Tensor, DecoderCache], StepOutput]
    verify: Callable[[torch.Tensor, DecoderCache], StepOutput]

    @classmethod
    def eager(cls, target: HCDecoder, drafter: MTPDrafter) -> StepFunctions:
        """The plain eager steps of these models."""
        return cls(functools.partial(prefill_step, target, drafter), drafter.step, target.step)

    def compiled(self, backend: Any) -> StepFunctions:
        """Each step through ``torch.compile(backend=backend)``.

        Draft and verify steps get dynamic shapes from the start (the cache length changes every call; the
        loop marks their few row counts static); the prefill gets torch.compile's default, static for the
        first prompt length and dynamic once another one comes.
        """
        return StepFunctions(
            torch.compile(self.prefill, backend=backend),
            torch.compile(self.draft, backend=backend, dynamic=True),
            torch.compile(self.verify, backend=backend, dynamic=True),
        )


@dataclass
class SpecStats:
    """Per verify step, how many of its ``draft_steps`` drafts were accepted (the bonus token is no draft)."""

    draft_steps: int
    accepted_per_step: list[int] = field(default_factory=list)

    @property
    def verify_steps(self) -> int:
        return len(self.accepted_per_step)

    @property
    def drafted(self) -> int:
        return self.draft_steps * self.verify_steps

    @property
    def accepted(self) -> int:
        return sum(self.accepted_per_step)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafted tokens."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accept_length(self) -> float:
        """Tokens emitted per verify step: accepted drafts plus the bonus token."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    def summary(self) -> dict[str, float]:
        """The counts and the two rates, for reports."""
        return {
            "verify_steps": self.verify_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accept_length": self.mean_accept_length,
        }


@dataclass
class SpecResult:
    """The generated tokens (prompt excluded) and the acceptance statistics."""

    tokens: list[int]
    stats: SpecStats


class _Session:
    """One model's side of the loop: runs new rows and rolls back, on a cache or by recomputing everything.

    ``step(*rows, cache) -> (logits, out, cache)``. Recompute mode keeps every input row so far and runs the
    step on all of them from the empty cache each time, returning the rows of the new inputs.
    """

    def __init__(self, step: Callable[..., StepOutput], empty_cache: DecoderCache, recompute: bool) -> None:
        self.step, self.empty_cache, self.recompute = step, empty_cache, recompute
        self.cache = empty_cache
        self.inputs: list[torch.Tensor] = []
        self.length = 0

    def run(self, *rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits, state or streams)`` of the new rows, which then count as processed."""
        # Dynamo guards a view input on its base (sizes, storage offset): fresh rows keep one graph per shape.
        rows = tuple(r.clone() for r in rows)
        n_rows = rows[0].shape[0]
        self.length += n_rows
        if not self.recompute:
            # A decode step has one of a few row counts (1..k+1); only the cache length grows. Static rows keep
            # a compiled step below the SP threshold in one unsharded graph, and fit CUDA graphs.
            for row in rows:
                torch._dynamo.mark_static(row, 0)
            logits, out, self.cache = self.step(*rows, self.cache)
            return logits, out
        self.inputs = (
            [torch.cat([old, new]) for old, new in zip(self.inputs, rows, strict=True)] if self.inputs else list(rows)
        )
        logits, out, _ = self.step(*self.inputs, self.empty_cache)
        return logits[-n_rows:], out[-n_rows:]

    def resume(self, cache: DecoderCache, length: int) -> None:
        """Continue from a cache made elsewhere (the fused prefill)."""
        self.cache, self.length = cache, length

    def truncate(self, length: int) -> None:
        """Forget every row after the first ``length``."""
        self.length = length
        if self.recompute:
            self.inputs = [rows[:length] for rows in self.inputs]
        else:
            self.cache = truncate_cache(self.cache, length)


def _prefill(
    steps: StepFunctions, target: _Session, drafter: _Session, prompt: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target logits, drafter logits and drafter streams of the prompt; both sessions hold the prompt after."""
    if target.recompute:  # the fused prefill grows caches; recompute mode keeps inputs, so run the models apart
        logits, state = target.run(prompt)
        drafter_logits, streams = drafter.run(state.flatten(1), next_token_ids(prompt, logits))
        return logits, drafter_logits, streams
    out = steps.prefill(prompt, target.cache, drafter.cache)
    target.resume(out.target_cache, prompt.shape[0])
    drafter.resume(out.drafter_cache, prompt.shape[0])
    return out.target_logits, out.drafter_logits, out.drafter_streams


def _draft(drafter: _Session, logits: torch.Tensor, streams: torch.Tensor, draft_steps: int) -> torch.Tensor:
    """``draft_steps`` top-1 drafts ``[k]`` from the drafter's last row (``logits [vocab]``, ``streams [1, n*S]``)."""
    drafts = [logits.argmax(-1, keepdim=True)]
    for _ in range(draft_steps - 1):
        step_logits, streams = drafter.run(streams, drafts[-1])
        drafts.append(step_logits[-1:].argmax(-1))
    return torch.cat(drafts)


def _round(
    target: _Session, drafter: _Session, pending: torch.Tensor, logits: torch.Tensor, streams: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One draft / verify / accept / roll-back round after the last emitted token ``pending [1]``.

    Returns the emitted tokens ``[a+1]`` and the drafter's last logits ``[vocab]`` and streams ``[1, n*S]``.
    """
    drafts = _draft(drafter, logits, streams, k)
    verify_logits, state = target.run(torch.cat([pending, drafts]))
    greedy = verify_logits.argmax(-1)  # the target's own token after pending and after each draft
    accepted = int(torch.cumprod(drafts == greedy[:k], 0).sum())
    emitted = greedy[: accepted + 1]  # the accepted drafts equal greedy[:accepted]; greedy[accepted] is the bonus
    target.truncate(target.length - (k - accepted))
    drafter.truncate(drafter.length - (k - 1))
    caught_up = drafter.length + accepted + 1
    drafter_logits, streams = drafter.run(state.flatten(1), greedy)
    drafter.truncate(caught_up)
    return emitted, drafter_logits[accepted], streams[accepted : accepted + 1]


def speculative_decode(
    target: HCDecoder,
    drafter: MTPDrafter,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    steps: StepFunctions | None = None,
    recompute: bool = False,
    draft_steps: int = DRAFT_STEPS,
) -> SpecResult:
    """Greedy speculative decoding: ``max_new_tokens`` tokens after ``prompt [T]`` and the acceptance stats.

    ``steps`` defaults to the eager steps of the two models; ``recompute`` reruns every step on the whole
    sequence (see the module docstring). The first token comes from the prefill, the rest from rounds.
    """
    if max_new_tokens < 1 or draft_steps < 1:
        raise ValueError(f"max_new_tokens and draft_steps must be >= 1, got {max_new_tokens}, {draft_steps}")
    steps = steps or StepFunctions.eager(target, drafter)
    target_session = _Session(steps.verify, target.empty_cache(), recompute)
    drafter_session = _Session(steps.draft, drafter.empty_cache(), recompute)
    target_logits, drafter_logits, streams = _prefill(steps, target_session, drafter_session, prompt)
    emitted = target_logits[-1:].argmax(-1)
    tokens = emitted.tolist()
    stats = SpecStats(draft_steps)
    logits, streams = drafter_logits[-1], streams[-1:]
    while len(tokens) < max_new_tokens:
        emitted, logits, streams = _round(target_session, drafter_session, emitted[-1:], logits, streams, draft_steps)
        stats.accepted_per_step.append(emitted.shape[0] - 1)
        tokens.extend(emitted.tolist())
    return SpecResult(tokens[:max_new_tokens], stats)


def greedy_decode(
    target: Callable[[torch.Tensor], torch.Tensor], prompt: torch.Tensor, max_new_tokens: int
) -> list[int]:
    """The target's own greedy continuation: ``target(ids) -> logits`` on the whole sequence per new token."""
    ids = prompt
    for _ in range(max_new_tokens):
        ids = torch.cat([ids, target(ids)[-1:].argmax(-1)])
    return ids[prompt.shape[0] :].tolist()
