"""vLLM's /inference/v1/generate in our words (`polar_mitm.backends.vllm_generate`): the request
body, and every way its replies come (whole, or split into delta chunks anywhere) folded into the
same state, with the turn's weight version from the spans."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polar_mitm.backends import vllm_generate
from polar_mitm.backends.engine_api import GenerateState, ids_json, span_version, status_error
from polar_mitm.backends.engine_client import APIS
from polar_mitm.neutral import ProviderError, Sampling


def test_it_is_an_engine_api_of_its_own_name():
    assert APIS["vllm-generate"] is vllm_generate
    assert vllm_generate.GENERATE_PATH == "/inference/v1/generate"


def test_backend_kind_vllm_generate_is_an_option_and_auto_stays_as_it_was():
    from tests.unit.test_cli_options import config

    assert config("--backend-kind", "vllm-generate").backend_kind == "vllm-generate"
    assert config().backend_kind == "auto"


def test_the_body_is_token_ids_and_vllms_sampling_params_in_text_mode():
    params = vllm_generate.sampling_params(
        Sampling(temperature=0.5, top_p=0.9, top_k=20, stop=["\n\n"], json_schema={"type": "object"}),
        default_max_tokens=77,
    )
    assert params == {
        "max_tokens": 77,
        "logprobs": 0,
        "skip_special_tokens": False,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 20,
        "stop": ["\n\n"],
        "structured_outputs": {"json": {"type": "object"}},
    }
    whole = json.loads(vllm_generate.body(ids_json([5, 6]), params, stream=False))
    assert whole == {"token_ids": [5, 6], "sampling_params": params, "output_mode": "text", "stream": False}
    streamed = json.loads(vllm_generate.body(ids_json([5]), {"max_tokens": 3}, stream=True))
    assert streamed == {
        "token_ids": [5],
        "sampling_params": {"max_tokens": 3},
        "output_mode": "text",
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@given(
    max_tokens=st.none() | st.integers(1, 1 << 20),
    temperature=st.none() | st.floats(0, 2),
    top_k=st.none() | st.integers(-1, 100),
    stop=st.lists(st.text(max_size=5), max_size=3),
)
def test_only_what_is_set_is_sent_and_the_sampled_tokens_logprobs_always(
    max_tokens, temperature, top_k, stop
):
    s = Sampling(max_tokens=max_tokens, temperature=temperature, top_k=top_k, stop=stop)
    params = vllm_generate.sampling_params(s, default_max_tokens=9)
    assert params["max_tokens"] == (9 if max_tokens is None else max_tokens)
    assert params["logprobs"] == 0 and params["skip_special_tokens"] is False
    assert params.get("temperature") == temperature and params.get("top_k") == top_k
    assert params.get("stop", []) == stop
    assert json.loads(vllm_generate.body(b"1", params, stream=False))["sampling_params"] == params


def choice(text, ids, lps, finish=None, stop_reason=None, spans=None) -> dict:
    return {
        "index": 0,
        "finish_reason": finish,
        "stop_reason": stop_reason,
        "token_ids": ids,
        "routed_experts": None,
        "sampling_mask": None,
        "weight_versions": spans,
        "text": text,
        "logprobs": {
            "content": [
                {"token": "t", "logprob": lp, "bytes": [116], "top_logprobs": [{"token": "t", "logprob": lp}]}
                for lp in lps
            ]
        },
    }


def output(*choices: dict, usage=None) -> bytes:
    return json.dumps(
        {"request_id": "generate-tokens-1", "usage": usage, "output_mode": "text", "choices": list(choices)}
    ).encode()


replies = st.integers(0, 12).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 151_000), min_size=n, max_size=n),
        st.lists(st.floats(-50, 0, allow_nan=False), min_size=n, max_size=n),
        st.lists(st.text(max_size=4), min_size=n, max_size=n),
        st.lists(st.integers(0, n), max_size=4).map(sorted),  # where the chunks are cut
        st.sampled_from(["stop", "length", "abort"]),
        st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=3),  # the weight versions
    )
)


@settings(max_examples=200)
@given(replies)
def test_a_whole_reply_and_its_delta_chunks_fold_to_the_same_state(reply):
    """The ids and logprobs exactly (float bits), the text, the finish reason in SGLang's shape,
    and the first span's version as the turn's, however the reply is cut into chunks."""
    ids, lps, words, cuts, finish, versions = reply
    n = len(ids)
    spans = [
        {"version": v, "start": i * n // len(versions), "end": (i + 1) * n // len(versions)}
        for i, v in enumerate(versions)
    ]
    usage = {"prompt_tokens": 7, "total_tokens": 7 + n, "completion_tokens": n}
    whole = GenerateState()
    added = vllm_generate.fold(
        whole, output(choice("".join(words), ids, lps, finish, None, spans), usage=usage)
    )
    streamed = GenerateState(cumulative=False)
    bounds = [0, *cuts, n]
    pieces = []
    for k, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        last = k == len(bounds) - 2
        payload = output(
            choice(
                "".join(words[a:b]),
                ids[a:b],
                lps[a:b],
                finish if last else None,
                None,
                spans if last else None,
            )
        )
        pieces.append(vllm_generate.fold(streamed, payload))
    assert vllm_generate.fold(streamed, output(usage=usage)) == ""  # the usage chunk: no choices
    for state in (whole, streamed):
        assert state.output_ids == ids
        assert json.dumps(state.output_logprobs) == json.dumps(lps)  # the same floats, -0.0 included
        assert state.text == "".join(words)
        assert state.weight_version == versions[0]
        assert state.prompt_tokens == 7
        assert state.finish_reason == ({"type": "stop", "matched": None} if finish == "stop" else
                                       {"type": "abort", "message": "aborted by the engine"} if finish == "abort" else
                                       {"type": "length"})  # fmt: skip
    assert added == "".join(pieces) == "".join(words)


def test_a_stop_string_or_token_is_the_finish_reasons_match():
    state = GenerateState()
    vllm_generate.fold(
        state, output(choice("hi", [1], [-0.5], "stop", "\n\n", [{"version": "v", "start": 0, "end": 1}]))
    )
    assert state.finish_reason == {"type": "stop", "matched": "\n\n"}
    state = GenerateState()
    vllm_generate.fold(state, output(choice("hi", [1, 7], [-0.5, -1.0], "stop", 7)))
    assert state.finish_reason == {"type": "stop", "matched": 7} and state.weight_version is None


def test_spans_name_the_version_of_the_oldest_weights_that_sampled_the_reply():
    assert span_version(None) is None and span_version([]) is None
    assert span_version([{"version": "default", "start": 0, "end": 9}]) == "default"
    assert (
        span_version([{"version": "3", "start": 0, "end": 4}, {"version": "4", "start": 4, "end": 9}]) == "3"
    )
    for bad in ("v1", [{"start": 0}], [{"version": 3}], [None]):
        with pytest.raises(ValueError):
            span_version(bad)


@pytest.mark.parametrize(
    ("payload", "kind", "said"),
    [
        (b'{"error": {"message": "bad max_tokens", "type": "BadRequestError", "param": null, "code": 400}}',
         "invalid_request", "bad max_tokens"),
        (b'{"error": {"message": "boom", "type": "InternalServerError", "param": null, "code": 500}}',
         "api_error", "boom"),
        (output({"index": 0, "token_ids": [1], "logprobs": None, "finish_reason": None}),
         "api_error", 'output_mode "text"'),
        (output(choice("a", [1, 2], [-1.0])), "api_error", "2 token ids but 1 logprobs"),
        (output(choice("a", [1], [-1.0], "stop", None, [{"start": 0}])), "api_error", "unreadable"),
        (b"{not json", "api_error", "unreadable"),
    ],
)  # fmt: skip
def test_errors_and_odd_replies_are_the_harnesss_errors(payload, kind, said):
    with pytest.raises(ProviderError) as e:
        vllm_generate.fold(GenerateState(), payload)
    assert e.value.kind == kind and said in e.value.message


@given(
    st.binary(max_size=200)
    | st.recursive(
        st.none() | st.integers() | st.text(max_size=5),
        lambda c: (
            st.lists(c, max_size=3)
            | st.dictionaries(
                st.sampled_from(
                    [
                        "choices",
                        "usage",
                        "token_ids",
                        "text",
                        "logprobs",
                        "content",
                        "logprob",
                        "weight_versions",
                        "error",
                    ]
                ),
                c,
                max_size=4,
            )
        ),
    ).map(lambda v: json.dumps(v).encode())
)
def test_whatever_comes_back_folds_or_is_the_harnesss_error(payload):
    try:
        vllm_generate.fold(GenerateState(), payload)
    except ProviderError:
        pass


def test_vllm_without_scale_out_is_told_how_to_open_the_endpoint():
    refused = json.dumps(
        {"error": {"message": "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them.",
                   "type": "PermissionDeniedError", "param": None, "code": 403}}
    )  # fmt: skip
    e = status_error(403, refused)
    assert "start vLLM with --enable-scale-out" in e.message and "credentials" not in e.message
    assert "credentials" in status_error(403, '{"error": "Unauthorized"}').message
