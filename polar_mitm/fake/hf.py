"""`fake-backend --mode hf --model DIR`: a real Hugging Face causal LM behind the fake's SGLang API.

The scripted and random models answer the shape of SGLang's API; this one answers its numbers:
real forward passes of a `transformers` model (float32, on CPU), real sampling, and the logprobs
of the sampled tokens as SGLang reports them (log-softmax after penalties, logit bias and
temperature, before top-k / top-p / min-p truncation). It is the engine of the closed loop on one
CPU machine: a trainer recomputes the same logprobs with the same weights (`check-logprobs`), and
`POST /update_weights_from_disk` loads the weights the trainer saved, as SGLang does.

- `HFModel`: the model behind `Engine` (the same `step` as `RandomModel`), with its own KV cache
  of the last sequence, so a generation costs one prefill and one token per step, and a turn that
  extends the previous one reuses its prefix.
- `HFEngine`: `Engine` with `HFModel` as its sampler (stop logic, detokenization unchanged).
- `update_weights_from_disk`: SGLang's endpoint (checked against SGLang 0.5.x
  `srt/entrypoints/http_server.py` and `srt/managers/io_struct.py`): body `{"model_path",
  "load_format", "abort_all_requests", "weight_version", …}`; reply `{"success", "message",
  "num_paused_requests"}`, 200 on success and 400 otherwise; the server's `weight_version`
  changes only when the body names one.
- `tiny_causal_lm`: a tiny Qwen2 model over a tokenizer's whole vocabulary, shaped so that it
  writes short replies (a few hundred ordinary tokens and `<|im_end|>` carry the mass), for
  tests, examples and benches that cannot download a model.

torch and transformers are the `[hf]` extra: nothing else in the fake imports them.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.fake.config import FakeBackendConfig
from polar_mitm.fake.contract import GenParams, _json, _read_json
from polar_mitm.fake.engine import Engine
from polar_mitm.fake.model import Step, _f32, random_vocab, truncation_mask
from polar_mitm.fake.serving import _Handlers
from polar_mitm.fake.state import STATE


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - the message is the point
        raise RuntimeError(
            "fake-backend --mode hf needs PyTorch and transformers: pip install 'polar-mitm[hf]'"
        ) from e
    return torch


def load_causal_lm(path: str | Path) -> Any:
    """A causal LM from a directory, in float32 and eval mode (what the trainer loads too)."""
    torch = _torch()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    return model


class HFModel:
    """A causal LM that samples one token at a time, keeping the KV cache of the last sequence."""

    def __init__(self, path: str | Path, vocab_size: int, *, threads: int | None = None) -> None:
        torch = _torch()
        torch.set_num_threads(threads or min(2, os.cpu_count() or 1))
        self.vocab_size = vocab_size
        self.path = str(path)
        self.model = self._check(load_causal_lm(path))
        self._ids: list[int] = []
        self._cache: Any = None
        self._logits: Any = None

    def _check(self, model: Any) -> Any:
        n = model.config.get_text_config().vocab_size
        if n < self.vocab_size:
            raise ValueError(
                f"the model's vocabulary ({n} ids) is smaller than the tokenizer's ({self.vocab_size}): "
                "the proxy would send ids the model has no embedding for"
            )
        return model

    def load(self, path: str | Path) -> None:
        """Replace the weights with those saved at `path` (same architecture and vocabulary)."""
        model = self._check(load_causal_lm(path))
        self.model, self.path = model, str(path)
        self.reset()

    def reset(self) -> None:
        self._ids, self._cache, self._logits = [], None, None

    def next_logits(self, context: Sequence[int]) -> Any:
        """The model's logits (float32 tensor, whole vocabulary) for the token after `context`.
        Reuses the cached prefix it shares with the last sequence."""
        torch = _torch()
        from transformers import DynamicCache

        ids = list(context)
        shared = 0
        for a, b in zip(self._ids, ids, strict=False):
            if a != b:
                break
            shared += 1
        if shared == len(ids) == len(self._ids) and self._logits is not None:
            return self._logits
        keep = min(shared, len(ids) - 1)  # at least one token is fed, to get its logits
        if keep <= 0 or self._cache is None:
            keep, self._cache = 0, DynamicCache(config=self.model.config)
        elif keep < self._cache.get_seq_length():
            # Negative: "remove this many" in transformers 5, "keep all but this many" before.
            self._cache.crop(keep - self._cache.get_seq_length())
            if self._cache.get_seq_length() != keep:
                keep, self._cache = 0, DynamicCache(config=self.model.config)
        with torch.no_grad():
            out = self.model(
                torch.tensor([ids[keep:]], dtype=torch.long),
                cache=self._cache,
                use_cache=True,
                logits_to_keep=1,
            )
        self._cache = out.cache
        self._ids = ids
        self._logits = out.logits[0, -1].float()
        return self._logits

    def distribution(
        self, context: Sequence[int], params: GenParams, counts: Counter[int], n_generated: int, eos: set[int]
    ) -> np.ndarray:
        """Log-probabilities over the tokenizer's ids that the next token is drawn from, as SGLang
        reports them: penalties and logit bias, then temperature, then log-softmax (float32)."""
        torch = _torch()
        x = self.next_logits(context)[: self.vocab_size].clone()
        if counts:
            ids = torch.tensor(list(counts), dtype=torch.long)
            n = torch.tensor([counts[int(i)] for i in ids], dtype=torch.float32)
            x[ids] -= params.frequency_penalty * n + params.presence_penalty
            if params.repetition_penalty != 1.0:
                v = x[ids]
                x[ids] = torch.where(v > 0, v / params.repetition_penalty, v * params.repetition_penalty)
        for tid, bias in params.logit_bias.items():
            if 0 <= tid < self.vocab_size:
                x[tid] += bias
        if n_generated < params.min_new_tokens:
            for tid in {*eos, *params.stop_token_ids}:
                if 0 <= tid < self.vocab_size:
                    x[tid] = -float("inf")
        return torch.log_softmax(x / params.temperature, dim=-1).numpy()

    def step(
        self,
        context: Sequence[int],
        params: GenParams,
        rng: np.random.Generator,
        output_counts: Counter[int],
        n_generated: int,
        top_n: int = 0,
        eos: frozenset[int] = frozenset(),
    ) -> Step:
        lp = self.distribution(context, params, output_counts, n_generated, set(eos))
        if params.top_k == 1:
            i = int(np.argmax(lp))
        else:
            keep = truncation_mask(lp, params.top_k, params.top_p, params.min_p)
            p = np.where(keep, np.exp(lp.astype(np.float64)), 0.0)
            i = int(rng.choice(len(p), p=p / p.sum()))
        top: list[tuple[float, int]] = []
        if top_n > 0:
            order = np.argsort(-lp, kind="stable")[:top_n]
            top = [(_f32(lp[j]), int(j)) for j in order]
        return Step(i, _f32(lp[i]), top)


class _Sampler:
    """`HFModel.step` with the engine's eos ids bound (what `Engine.generate` calls)."""

    def __init__(self, model: HFModel, eos: frozenset[int]) -> None:
        self.model, self.eos = model, eos

    def step(self, context, params, rng, counts, n_generated, top_n=0) -> Step:  # type: ignore[no-untyped-def]
        return self.model.step(context, params, rng, counts, n_generated, top_n, self.eos)


class HFEngine(Engine):
    """`Engine` whose sampler is a real causal LM (`config.model_dir`)."""

    def __init__(self, config: FakeBackendConfig, tokenizer: Tokenizer) -> None:
        super().__init__(config, tokenizer)
        if not config.model_dir:
            raise ValueError("--mode hf needs --model DIR (a Hugging Face causal LM directory)")
        self.hf = HFModel(config.model_dir, tokenizer.vocab_size)
        self._sampler = _Sampler(self.hf, self.eos_ids)

    @property
    def random_model(self) -> Any:  # Engine.generate samples from this
        return self._sampler


async def update_weights_from_disk(request: web.Request) -> web.Response:
    """SGLang's `POST /update_weights_from_disk`: load new weights in place."""
    state = request.app[STATE]
    body, raw, err = await _read_json(request)
    _Handlers(state)._log(request, raw)
    if err is not None:
        return err
    engine = state.engine
    if not isinstance(body, dict) or not isinstance(body.get("model_path"), str) or not body["model_path"]:
        return _json({"success": False, "message": "model_path: Field required (a string)"}, 400)
    if not isinstance(engine, HFEngine):
        return _json(
            {"success": False, "message": "this fake backend has no weights (run it with --mode hf)"}, 400
        )
    paused = 0
    if body.get("abort_all_requests"):
        for flight in state.in_flight.values():
            flight.aborted = True
            paused += 1
    try:
        engine.hf.load(body["model_path"])
    except (OSError, ValueError, RuntimeError) as e:
        return _json(
            {"success": False, "message": f"Failed to update weights: {e}.", "num_paused_requests": paused},
            400,
        )
    state.prompt_cache.clear()  # SGLang flushes its cache after an update (flush_cache defaults to True)
    version = body.get("weight_version")
    if version is not None:
        state.weight_version = str(version)
    return _json(
        {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": paused}
    )


def tiny_causal_lm(
    tokenizer_dir: str | Path,
    out_dir: str | Path,
    *,
    seed: int = 0,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    words: int = 256,
    eos_share: float = 0.15,
) -> Path:
    """Save a tiny Qwen2 causal LM over the tokenizer's whole vocabulary into `out_dir`.

    A random model over 151k ids writes forever (eos is one id in 151k). This one is random too,
    but shaped: one embedding dimension is a constant, so after the final norm one hidden unit is
    nearly constant and its lm_head column acts as a per-token bias: `words` ordinary tokens
    share the mass with `<|im_end|>` (`eos_share` of it at the first step), every other id gets
    about e^-20 of it. The rest of the weights are random and every one gets gradients.
    `heads` attention heads (half as many key/value heads) of `hidden // heads` each: vLLM's CPU
    attention needs 32 or more (hidden 64, 2 heads), SGLang's takes the default's 16."""
    torch = _torch()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = Tokenizer.load(str(tokenizer_dir))
    eos = tok.token_id("<|im_end|>")
    eos = eos if eos is not None else min(tok.eos_token_ids)
    cfg = Qwen2Config(
        vocab_size=tok.vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=65536,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=tok.token_id("<|endoftext|>"),
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        assert isinstance(emb, torch.Tensor)
        emb.normal_(0.0, 0.02)
        emb[:, 0] = 1.0
        head = model.get_output_embeddings().weight
        head.normal_(0.0, 1.0)
        head[:, 0] = 0.0
        unit = float(np.sqrt(hidden))  # the constant unit's value after RMSNorm
        bias = torch.full((tok.vocab_size,), -20.0)
        chosen = random_vocab(tok, words, seed)
        bias[chosen] = 0.0
        bias[eos] = float(np.log(eos_share / (1 - eos_share) * len(chosen)))
        head[:, 0] = bias / unit
    out = Path(out_dir)
    model.save_pretrained(out)
    return out
