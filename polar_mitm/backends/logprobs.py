"""What an engine's logprobs are the logprobs of, and whether that is the distribution a turn
sampled from. A trainer's importance ratio divides by these numbers: they must be the sampling
distribution's, or the turn's sampling settings must not change it.

The modes, in our words (read from each engine's sampler and checked against real engines):

- `sampling`: the distribution the token was drawn from, after temperature, top-k/top-p and
  penalties. vLLM with `--logprobs-mode processed_logprobs` (its sampler takes log_softmax of the
  logits after temperature and the top-k/top-p mask, so the kept tokens renormalize).
- `tempered`: after temperature, before top-k/top-p. SGLang 0.5.23 (its sampler returns
  log(softmax(logits / T)) and filters top-k/top-p on a sorted copy); greedy requests report
  log_softmax(logits), which is what temperature 1 would.
- `raw`: the model's own distribution, before temperature. vLLM's default (`raw_logprobs`), and
  SGLang with `SGLANG_RETURN_ORIGINAL_LOGPROB=1` (which polar-mitm cannot see from outside).
- `logits`: not logprobs at all (vLLM's `raw_logits`, `processed_logits`): nothing to train on.
"""

from __future__ import annotations

from polar_mitm.neutral import Sampling

MODES = ("sampling", "tempered", "raw", "logits")
VLLM_MODES = {
    "processed_logprobs": "sampling",
    "raw_logprobs": "raw",
    "raw_logits": "logits",
    "processed_logits": "logits",
}
# The mode SGLang 0.5.23 reports in (its sampler; see the module docstring).
SGLANG_MODE = "tempered"
# The flag that makes vLLM report the sampling distribution's logprobs.
VLLM_FLAG = "--logprobs-mode processed_logprobs"


def mismatch(mode: str | None, s: Sampling) -> str | None:
    """Why logprobs in `mode` are not those of the distribution `s` samples from (None: they are,
    or the mode is unknown). Greedy (temperature 0) samples the argmax: its logprobs are read as
    temperature 1's by every mode."""
    if mode in (None, "sampling"):
        return None
    if mode == "logits":
        return "the engine reports logits, not logprobs"
    tempered = s.temperature is not None and s.temperature not in (0, 1)
    truncated = (s.top_p is not None and s.top_p < 1) or (s.top_k is not None and s.top_k > 0)
    if mode == "raw" and tempered:
        return f"the engine reports the model's logprobs before temperature, and this turn samples at {s.temperature:g}"
    if truncated:
        what = f"top_p {s.top_p:g}" if s.top_p is not None and s.top_p < 1 else f"top_k {s.top_k}"
        return f"the engine reports logprobs before top-k/top-p, and this turn samples with {what}"
    return None
