"""`jsontext`, the engine client's JSON among others: what an engine sends reads as `json` reads it,
logprobs bit for bit."""

from __future__ import annotations

import json
import math
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polar_mitm import jsontext
from polar_mitm.backends import sglang
from polar_mitm.backends.engine_api import GenerateState


def bits(x: float) -> bytes:
    return struct.pack("<d", x)


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_a_float_as_an_engine_writes_it_reads_as_the_same_double(x):
    for text in (repr(x), json.dumps(x), f"{x:.17g}", f"{x:.20e}"):
        payload = f'{{"v":[{text}]}}'.encode()
        assert bits(jsontext.loads(payload)["v"][0]) == bits(json.loads(payload)["v"][0]), text


@given(
    st.integers(0, 10**25),
    st.integers(1, 25),
    st.integers(-330, 310),
    st.booleans(),
)
def test_a_long_decimal_reads_as_the_correctly_rounded_double(digits, width, exponent, negative):
    # More digits than a double holds: the halfway cases are where a fast reader rounds wrong.
    text = f"{'-' if negative else ''}{str(digits).zfill(width)[:1]}.{str(digits).zfill(width)[1:] or '0'}e{exponent}"
    payload = f'{{"v":{text}}}'.encode()
    assert bits(jsontext.loads(payload)["v"]) == bits(float(text)), text


def test_what_orjson_refuses_is_read_by_json():
    # Python's json writes a -inf logprob as -Infinity (an engine on Python's json may send it).
    assert jsontext.loads(b'{"v":[-Infinity,NaN,1e999]}')["v"][0] == -math.inf
    assert math.isnan(jsontext.loads(b'{"v":NaN}')["v"])
    with pytest.raises(ValueError):
        jsontext.loads(b'{"v":')


def test_sglang_logprobs_fold_bit_for_bit():
    lps = [-0.0, -1e-300, -5e-324, -2.220446049250313e-16, -0.6931471805599453, -17.123456789012345]
    chunk = {
        "text": "ab",
        "output_ids": list(range(len(lps))),
        "meta_info": {"output_token_logprobs": [[lp, i, None] for i, lp in enumerate(lps)]},
    }
    state = GenerateState()
    sglang.fold(state, json.dumps(chunk).encode())
    assert [bits(x) for x in state.output_logprobs] == [bits(x) for x in lps]


@given(
    st.dictionaries(
        st.text(max_size=8),
        st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.integers(-(2**80), 2**80), st.text()),
        max_size=6,
    )
)
def test_params_read_back_as_they_were(params):
    out = json.loads(jsontext.dumps(params))
    assert out.keys() == params.keys()
    for k, v in params.items():
        assert type(out[k]) is type(v) and (bits(out[k]) == bits(v) if isinstance(v, float) else out[k] == v)
