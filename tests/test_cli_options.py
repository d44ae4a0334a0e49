"""The policy's command-line options come from PolicyConfig's fields: none can go missing."""

import click
from click.testing import CliRunner

from polar_mitm.cli import main
from polar_mitm.cli_options import make_policy_config, policy_options
from polar_mitm.policy import PolicyConfig


@click.command()
@policy_options
def show(db, certs, **policy):
    click.echo(make_policy_config(**policy).model_dump_json())


def config(*args: str) -> PolicyConfig:
    result = CliRunner().invoke(show, list(args))
    assert result.exit_code == 0, result.output
    return PolicyConfig.model_validate_json(result.output)


def test_backend_mode_chat_reaches_the_policy_config():
    assert config("--backend-mode", "chat").backend_mode == "chat"
    bad = CliRunner().invoke(show, ["--backend-mode", "server"])
    assert bad.exit_code == 2 and "'render', 'chat'" in bad.output


def test_every_policy_field_is_an_option_of_run_proxy_and_rollout():
    for command in ("run", "proxy", "rollout"):
        helptext = CliRunner().invoke(main, [command, "--help"], terminal_width=200).output
        for field in PolicyConfig.model_fields:
            flag = "--backend" if field == "backend_url" else "--" + field.replace("_", "-")
            assert flag in helptext, (command, flag)


def test_no_option_keeps_every_default_and_each_option_sets_its_field():
    assert config() == PolicyConfig()
    got = config(
        "--backend",
        "http://10.0.0.5:30000",
        "--history",
        "template",
        "--default-max-tokens",
        "64",
        "--ping-interval",
        "0.5",
        "--max-tokens-cap",
        "8",
    )
    assert (got.backend_url, got.history, got.default_max_tokens, got.ping_interval, got.max_tokens_cap) == (
        "http://10.0.0.5:30000",
        "template",
        64,
        0.5,
        8,
    )


def test_environment_fallbacks_still_apply(monkeypatch):
    monkeypatch.setenv("POLAR_MITM_BACKEND", "http://10.0.0.9:30000")
    monkeypatch.setenv("POLAR_MITM_TOKENIZER", "/models/tok")
    got = config()
    assert (got.backend_url, got.tokenizer) == ("http://10.0.0.9:30000", "/models/tok")
