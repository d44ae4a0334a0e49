"""Generation (pure): `Engine` runs either model over one tokenizer to a finished `Generation`.

It applies SGLang's stop logic in its order (`Req.update_finish_state`: stop strings, then stop
tokens / eos, then length), forces the scripted reply (or, with a `json_schema`, the minimal
instance) token by token, and detokenizes as SGLang's detokenizer does (stop trimming, text held
back while it may end inside a stop string). Nothing here knows about HTTP or time: `serving.py`
releases a generation's tokens to clients.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.fake.config import FakeBackendConfig
from polar_mitm.fake.contract import GenParams
from polar_mitm.fake.json_schema import minimal_json_instance
from polar_mitm.fake.model import RandomModel, Step, _f32, _hash64, _ids_hash, random_vocab
from polar_mitm.fake.script import scripted_logprob, scripted_reply


@dataclass
class Generation:
    """A finished generation, before detokenization."""

    output_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[float, int]]]
    finish_reason: dict[str, Any]


class Engine:
    """Both models plus SGLang's stop logic, over one tokenizer."""

    def __init__(self, config: FakeBackendConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.rules = config.rules()
        im_end = tokenizer.token_id("<|im_end|>")
        if im_end is None and not tokenizer.eos_token_ids:
            raise ValueError(f"tokenizer {tokenizer.path!r} has no eos token; the fake backend needs one")
        self.reply_eos = im_end if im_end is not None else min(tokenizer.eos_token_ids)
        self.eos_ids = frozenset(tokenizer.eos_token_ids) | {self.reply_eos}
        self._random: RandomModel | None = None
        think_end = tokenizer.token_id("</think>")
        self.think_end_id = think_end if config.reasoning_parser else None

    @property
    def random_model(self) -> RandomModel:
        if self._random is None:
            vocab = random_vocab(self.tokenizer, self.config.random_vocab_size, self.config.seed)
            self._random = RandomModel(
                self.config.seed, vocab, self.reply_eos, eos_probability=self.config.random_eos_probability
            )
        return self._random

    def reply_ids(self, prompt_ids: Sequence[int], params: GenParams) -> list[int]:
        """The scripted reply's token ids, eos included."""
        prompt_text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        text = scripted_reply(self.rules, prompt_text, params.json_schema)
        return [*self.tokenizer.encode(text), self.reply_eos]

    def generate(
        self, prompt_ids: Sequence[int], params: GenParams, *, top_n: int = 0, draw: int = 0
    ) -> Generation:
        """Generate to the end; `draw` picks the random model's sampling stream for this prompt
        (see `FakeBackendState.next_draw`)."""
        max_new = params.max_new_tokens
        if max_new is None:
            max_new = max(0, self.config.context_length - len(prompt_ids))
        if max_new == 0:
            return Generation([], [], [], {"type": "length", "length": 0})
        forced: list[int] | None = None
        if self.config.mode == "scripted":
            forced = self.reply_ids(prompt_ids, params)
        elif params.json_schema is not None:
            # Constrained decoding leaves one legal token per step: its logprob is 0.
            forced = [
                *self.tokenizer.encode(json.dumps(minimal_json_instance(params.json_schema))),
                self.reply_eos,
            ]
        rng = np.random.default_rng(
            [
                self.config.seed & 0xFFFFFFFF,
                draw & 0xFFFFFFFFFFFFFFFF,
                _ids_hash(prompt_ids),
            ]
        )
        stop_tails = [len(self.tokenizer.encode(s)) + 1 for s in params.stop]
        tail_len = max(stop_tails, default=0)
        out: list[int] = []
        lps: list[float] = []
        tops: list[list[tuple[float, int]]] = []
        counts: Counter[int] = Counter()
        context = list(prompt_ids)
        while True:
            i = len(out)
            if forced is not None:
                tid = forced[i % len(forced)]
                if self.config.mode == "scripted":
                    step = Step(
                        tid, scripted_logprob(self.config.seed, i, tid), self._scripted_top(tid, i, top_n)
                    )
                else:
                    step = Step(tid, 0.0, [(0.0, tid)] if top_n else [])
            else:
                step = self.random_model.step(context, params, rng, counts, i, top_n)
            out.append(step.token_id)
            lps.append(step.logprob)
            tops.append(step.top)
            counts[step.token_id] += 1
            context.append(step.token_id)
            finish = self._check_finished(out, params, tail_len, max_new)
            if finish is not None:
                return Generation(out, lps, tops, finish)

    def _check_finished(
        self, out: list[int], params: GenParams, tail_len: int, max_new: int
    ) -> dict[str, Any] | None:
        # SGLang's order (Req.update_finish_state): stop strings, then stop tokens / eos, then length.
        if params.stop:
            tail = self.tokenizer.decode(out[-tail_len:])
            for s in params.stop:
                if s and s in tail:
                    return {"type": "stop", "matched": s}
        last = out[-1]
        if not params.ignore_eos and (last in params.stop_token_ids or last in self.eos_ids):
            return {"type": "stop", "matched": last}
        if len(out) >= max_new:
            return {"type": "length", "length": max_new}
        return None

    def _scripted_top(self, tid: int, position: int, top_n: int) -> list[tuple[float, int]]:
        if top_n <= 0:
            return []
        lp = scripted_logprob(self.config.seed, position, tid)
        rest = max(1e-12, 1.0 - float(np.exp(lp)))
        top = [(lp, tid)]
        vocab = max(2, self.tokenizer.vocab_size)
        for j in range(top_n - 1):
            alt = (tid + 1 + _hash64("alt", self.config.seed, position, j) % (vocab - 1)) % vocab
            top.append((_f32(max(-1e4, np.log(rest) - (j + 1) * np.log(2.0))), int(alt)))
        top.sort(key=lambda t: -t[0])
        return top

    # --- detokenization, as SGLang's detokenizer does it --------------------------------------

    def output_text(self, gen: Generation, params: GenParams) -> str:
        ids = gen.output_ids
        matched = gen.finish_reason.get("matched")
        if isinstance(matched, int) and not params.no_stop_trim and ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
        if isinstance(matched, str):
            pos = text.find(matched)
            if pos != -1:
                text = text[: pos + len(matched)] if params.no_stop_trim else text[:pos]
        return text

    def partial_text(self, ids: Sequence[int], params: GenParams) -> str | None:
        """Text of an unfinished generation, or None while it ends inside a possible stop string
        (SGLang holds such chunks back)."""
        text = self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens).rstrip("\ufffd")
        for s in params.stop:
            if any(text.endswith(s[:n]) for n in range(1, len(s) + 1)):
                return None
        return text

    def reasoning_tokens(self, output_ids: Sequence[int]) -> int:
        if self.think_end_id is None or self.think_end_id not in output_ids:
            return 0
        return list(output_ids).index(self.think_end_id) + 1
