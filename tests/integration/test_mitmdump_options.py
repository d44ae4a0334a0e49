"""The `mitmdump -s` addon's options, as mitmproxy tests its own addons' (`taddons.context()`, no
proxy booted): every PolicyConfig field is an option, a value its field refuses is an
OptionsError naming the option, and values set the way `--set` sets them reach the policy."""

from __future__ import annotations

import pytest
from mitmproxy import exceptions, hooks
from mitmproxy.test import taddons

from polar_mitm.cli.options import FLAGS
from polar_mitm.mitmdump import POLICY_OPTIONS, PolarMitm
from polar_mitm.policy.config import PolicyConfig


@pytest.fixture(autouse=True)
def no_policy_environment(monkeypatch):
    for flag in FLAGS.values():
        if flag.envvar:
            monkeypatch.delenv(flag.envvar, raising=False)


def loaded(tctx: taddons.context, addon: PolarMitm) -> None:
    """What mitmdump does once a script's addon is loaded: configure it with every option."""
    tctx.master.addons.invoke_addon_sync(addon, hooks.ConfigureHook(set(tctx.options.keys())))


def test_every_policy_field_is_an_option():
    addon = PolarMitm()
    with taddons.context(addon) as tctx:
        loaded(tctx, addon)
        for field in PolicyConfig.model_fields:
            assert POLICY_OPTIONS[field] in tctx.options, field
        assert POLICY_OPTIONS["backend_url"] == "polar_backend"  # the name users already set
        # Unset, each field's own default holds.
        assert addon.policy == PolicyConfig()


@pytest.mark.parametrize(
    "option, value",
    [
        ("polar_ping_interval", "soon"),  # a number, written as text
        ("polar_first_token_timeout", "ten"),
        ("polar_max_session_bytes_in_flight", 0),  # Field(ge=1)
        ("polar_backend_mode", "server"),  # not one of render, chat
        ("polar_tool_parser", "no-such-parser"),
        ("polar_reasoning_parser", "no-such-parser"),
    ],
)
def test_a_value_its_field_refuses_is_an_options_error_naming_the_option(option, value):
    addon = PolarMitm()
    with taddons.context(addon) as tctx:
        loaded(tctx, addon)
        with pytest.raises(exceptions.OptionsError, match=f"^polar-mitm: {option}: "):
            tctx.configure(addon, **{option: value})
        assert addon.policy == PolicyConfig()  # the bad value was not taken


def test_values_set_as_set_sets_them_reach_the_policy():
    addon = PolarMitm()
    with taddons.context(addon) as tctx:
        tctx.options.set(
            "polar_backend=http://10.0.0.1:30000,http://10.0.0.2:30000",
            "polar_tokenizer=/models/qwen3",
            "polar_backend_api_key=k3y",
            "polar_tool_parser=qwen3_coder",
            "polar_reasoning_parser=none",
            "polar_idle_timeout=300",
            "polar_first_token_timeout=0.5",
            "polar_max_tokens_cap=8192",
            "polar_backend_mode=chat",
        )
        p = addon.policy
        assert p is not None
        assert p.backend_urls == ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]
        assert (p.tokenizer, p.backend_api_key) == ("/models/qwen3", "k3y")
        assert (p.tool_parser, p.reasoning_parser) == ("qwen3_coder", "none")
        assert (p.idle_timeout, p.first_token_timeout, p.max_tokens_cap) == (300.0, 0.5, 8192)
        assert p.backend_mode == "chat"


def test_an_unset_option_takes_its_flags_environment_variable(monkeypatch):
    monkeypatch.setenv("POLAR_MITM_BACKEND_API_KEY", "from-env")  # kept off the command line
    addon = PolarMitm()
    with taddons.context(addon) as tctx:
        loaded(tctx, addon)
        assert addon.policy is not None and addon.policy.backend_api_key == "from-env"
        tctx.options.set("polar_backend_api_key=given")
        assert addon.policy.backend_api_key == "given"
