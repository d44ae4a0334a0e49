"""The seeded random model (pure), and the deterministic numbers both models draw from.

`RandomModel` is `random` mode's tiny numpy "language model": its logits over a restricted
vocabulary are a hash of (seed, last few token ids), and it reports what SGLang's sampler reports:
logprobs are true log-softmax values after penalties, logit bias and temperature, before top-k /
top-p / min-p truncation (`truncation_mask`), which only decides what may be sampled. The hashes
(`_hash64`, `_ids_hash`) make a fresh server replay the same numbers; `_f32` rounds logprobs so
they survive float32 storage exactly.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.fake.contract import GenParams


def _hash64(*parts: Any) -> int:
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def _ids_hash(ids: Sequence[int]) -> int:
    return int.from_bytes(
        hashlib.blake2b(np.asarray(ids, dtype=np.int64).tobytes(), digest_size=8).digest(), "little"
    )


def _f32(x: float) -> float:
    return float(np.float32(x))


@dataclass
class Step:
    """One generated token: its id, its logprob, and the top alternatives [(logprob, id)]."""

    token_id: int
    logprob: float
    top: list[tuple[float, int]] = field(default_factory=list)


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x[np.isfinite(x)]) if np.isfinite(x).any() else 0.0
    z = x - m
    return z - np.log(np.sum(np.exp(z)))


def truncation_mask(logprobs: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Which tokens survive top-k, top-p and min-p (SGLang's order: top-k, then top-p, then min-p)."""
    probs = np.exp(logprobs)
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros(len(probs), dtype=bool)
    k = len(probs) if top_k < 0 else min(top_k, len(probs))
    kept = order[:k]
    if top_p < 1.0:
        p = probs[kept] / probs[kept].sum()
        cum = np.cumsum(p)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        n = int(np.searchsorted(cum - p, top_p, side="left"))
        kept = kept[: max(1, n)]
    if min_p > 0.0:
        kept = kept[probs[kept] >= min_p * probs[kept].max()]
    keep[kept] = True
    return keep


class RandomModel:
    """A tiny seeded "language model": the logits over a restricted vocabulary are a hash of
    (seed, last few token ids); eos gets a fixed share of the mass at temperature 1."""

    def __init__(
        self,
        seed: int,
        vocab_ids: Iterable[int],
        eos_id: int,
        *,
        eos_probability: float = 1 / 24,
        context_window: int = 4,
        scale: float = 3.0,
    ) -> None:
        ordinary = sorted(set(vocab_ids) - {eos_id})
        if not ordinary:
            raise ValueError("the random model needs at least one ordinary token id")
        self.seed = seed
        self.eos_id = eos_id
        self.ids = np.array([*ordinary, eos_id], dtype=np.int64)
        self.eos_index = len(ordinary)
        self.index_of = {int(t): i for i, t in enumerate(self.ids)}
        self.context_window = context_window
        self.scale = scale
        self.eos_bonus = float(np.log(eos_probability / (1 - eos_probability)))

    def logits(self, context: Sequence[int]) -> np.ndarray:
        """Raw logits (float64) over `self.ids` after `context`."""
        tail = tuple(int(t) for t in context[-self.context_window :])
        rng = np.random.default_rng(_hash64("logits", self.seed, tail))
        x = rng.standard_normal(len(self.ids)) * self.scale
        others = np.delete(x, self.eos_index)
        m = others.max()
        x[self.eos_index] = m + np.log(np.exp(others - m).sum()) + self.eos_bonus
        return x

    def distribution(
        self,
        context: Sequence[int],
        params: GenParams,
        output_counts: Counter[int] | None = None,
        n_generated: int = 0,
    ) -> np.ndarray:
        """Log-probabilities over `self.ids` that the next token is sampled from, as SGLang reports
        them: penalties and logit bias applied, divided by temperature, log-softmaxed (top-k/top-p
        truncation happens after, when sampling)."""
        x = self.logits(context)
        if output_counts:
            for tid, count in output_counts.items():
                i = self.index_of.get(tid)
                if i is None:
                    continue
                x[i] -= params.frequency_penalty * count + params.presence_penalty
                if params.repetition_penalty != 1.0:
                    x[i] = x[i] / params.repetition_penalty if x[i] > 0 else x[i] * params.repetition_penalty
        for tid, bias in params.logit_bias.items():
            i = self.index_of.get(tid)
            if i is not None:
                x[i] += bias
        if n_generated < params.min_new_tokens:
            x[self.eos_index] = -np.inf
            for tid in params.stop_token_ids:
                i = self.index_of.get(tid)
                if i is not None:
                    x[i] = -np.inf
        return log_softmax(x / params.temperature)

    def step(
        self,
        context: Sequence[int],
        params: GenParams,
        rng: np.random.Generator,
        output_counts: Counter[int],
        n_generated: int,
        top_n: int = 0,
    ) -> Step:
        lp = self.distribution(context, params, output_counts, n_generated)
        keep = truncation_mask(lp, params.top_k, params.top_p, params.min_p)
        if params.top_k == 1:
            i = int(np.argmax(lp))
        else:
            p = np.where(keep, np.exp(lp), 0.0)
            i = int(rng.choice(len(p), p=p / p.sum()))
        top: list[tuple[float, int]] = []
        if top_n > 0:
            order = np.argsort(-lp, kind="stable")[:top_n]
            top = [(_f32(lp[j]), int(self.ids[j])) for j in order]
        return Step(int(self.ids[i]), _f32(lp[i]), top)


def random_vocab(tokenizer: Tokenizer, size: int, seed: int) -> list[int]:
    """`size` ordinary token ids (printable text, no special or tag tokens), chosen by `seed`."""
    tag = re.compile(r"^<[^<>\s]+>$")
    chosen: list[int] = []
    for tid in np.random.default_rng(seed).permutation(tokenizer.vocab_size):
        tid = int(tid)
        if tid in tokenizer.eos_token_ids:
            continue
        s = tokenizer.decode([tid], skip_special_tokens=True)
        if not s or "\ufffd" in s or tag.match(s) or any(ord(c) < 32 and c not in "\n\t" for c in s):
            continue
        chosen.append(tid)
        if len(chosen) >= size:
            break
    return chosen
