"""`polar_mitm.backends.logprobs.mismatch`: which sampling settings make an engine's reported
logprobs another distribution's than the one the tokens were drawn from."""

from __future__ import annotations

import pytest

from polar_mitm.backends.logprobs import VLLM_MODES, mismatch
from polar_mitm.neutral import Sampling


@pytest.mark.parametrize(
    ("mode", "sampling", "off"),
    [
        # The sampling distribution's logprobs (vLLM processed_logprobs) fit every setting.
        ("sampling", Sampling(temperature=0.5, top_p=0.9, top_k=20), False),
        # Unknown: nothing to say.
        (None, Sampling(temperature=0.5), False),
        # The raw distribution: right at temperature 1 (or unset, or greedy), wrong at any other.
        ("raw", Sampling(), False),
        ("raw", Sampling(temperature=1.0), False),
        ("raw", Sampling(temperature=0.0), False),
        ("raw", Sampling(temperature=0.5), True),
        ("raw", Sampling(top_p=0.9), True),
        # Tempered (SGLang): any temperature, but not top-p / top-k truncation.
        ("tempered", Sampling(temperature=0.5), False),
        ("tempered", Sampling(temperature=0.5, top_p=1.0, top_k=0), False),
        ("tempered", Sampling(top_p=0.95), True),
        ("tempered", Sampling(top_k=40), True),
        # Logits are never logprobs.
        ("logits", Sampling(), True),
    ],
)
def test_mismatch_names_what_makes_the_stored_logprobs_another_distributions(mode, sampling, off):
    why = mismatch(mode, sampling)
    assert (why is not None) is off, why
    if sampling.temperature == 0.5 and mode == "raw":
        assert "0.5" in why


def test_every_vllm_logprobs_mode_has_a_name():
    # vLLM 0.32's `--logprobs-mode` choices (vllm/config/model.py LogprobsMode).
    assert set(VLLM_MODES) == {"raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"}
