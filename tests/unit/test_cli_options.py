"""The command-line options of a model come from its fields (PolicyConfig's, RolloutOptions',
ServerConfig's): none can go missing."""

import click
import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from polar_mitm.cli import main
from polar_mitm.cli.options import given, make_policy_config, policy_options
from polar_mitm.cli.service import SERVER_FIELDS, server_options
from polar_mitm.policy import PolicyConfig
from polar_mitm.service.config import ServerConfig


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


def test_strategy_and_normalize_choices_are_the_enums_everywhere():
    """Every command's --strategy / --builder / --group-normalize offers the enum's values, and
    the service's wire model takes the same names: one spelling of each."""
    from polar_mitm import api
    from polar_mitm.strategies import Normalize, Strategy, choices

    want = {
        "--strategy": choices(Strategy),
        "--builder": choices(Strategy),
        "--group-normalize": choices(Normalize),
    }
    seen = set()
    ctx = click.Context(main)
    for name in main.list_commands(ctx):
        command = main.get_command(ctx, name)
        assert command is not None
        for p in command.params:
            for flag in set(p.opts) & set(want):
                assert isinstance(p.type, click.Choice), (name, flag)
                assert list(p.type.choices) == want[flag], (name, flag)
                seen.add((name, flag))
    assert {("export", "--strategy"), ("rollout", "--group-normalize"), ("submit", "--builder")} <= seen
    schema = api.TaskRequest.model_json_schema()
    assert schema["$defs"]["Strategy"]["enum"] == choices(Strategy)


def test_the_pipeline_sizes_are_options_of_rollout_serve_and_node_made_from_rollout_options():
    """--retries, --init-workers, … are RolloutOptions' fields: declared once, bounded as the field
    is, and only those given reach the model (its defaults hold for the rest)."""
    from polar_mitm.cli.options import given
    from polar_mitm.cli.rollout import worker_options
    from polar_mitm.rollout.options import WORKER_FIELDS, RolloutOptions

    for command in ("rollout", "serve", "node"):
        params = {p.name: p for p in main.get_command(click.Context(main), command).params}
        for field in WORKER_FIELDS:
            [bound] = [m.ge for m in RolloutOptions.model_fields[field].metadata]
            assert isinstance(params[field].type, click.IntRange), (command, field)
            assert params[field].type.min == bound, (command, field)

    @click.command()
    @worker_options
    def sizes(**options):
        click.echo(RolloutOptions(harness="pi", **given(options, WORKER_FIELDS)).model_dump_json())

    got = RolloutOptions.model_validate_json(CliRunner().invoke(sizes, ["--run-workers", "3"]).output)
    assert (got.run_workers, got.retries, got.ready_size) == (3, 2, None)
    bad = CliRunner().invoke(sizes, ["--init-workers", "0"])
    assert bad.exit_code == 2 and "--init-workers" in bad.output


@click.command()
@server_options
def show_server(**options):
    click.echo(ServerConfig(db="s.sqlite", **given(options, SERVER_FIELDS)).model_dump_json())


def server(*args: str):
    result = CliRunner().invoke(show_server, list(args))
    assert result.exit_code == 0, result.output
    return ServerConfig.model_validate_json(result.output)


def test_the_servers_options_come_from_server_config_and_set_its_fields():
    assert server() == ServerConfig(db="s.sqlite")
    got = server("--callback-allow", "A.example,b.example", "--callback-allow", "c.example", "--polar-api",
                 "--max-body-mb", "1", "--node-timeout", "3", "--allow-local-runtime")  # fmt: skip
    assert got.callback_allow == ("a.example", "b.example", "c.example")
    assert (got.polar_api, got.allow_local_runtime, got.max_body_mb, got.node_timeout) == (
        True,
        True,
        1.0,
        3.0,
    )
    assert (got.deadline_grace, got.task_root) == (60.0, None)  # not given: the field's default
    bad = CliRunner().invoke(show_server, ["--max-result-mb", "0"])
    assert bad.exit_code == 2 and "0.01" in bad.output
    helptext = CliRunner().invoke(main, ["serve", "--help"], terminal_width=200).output
    for field in SERVER_FIELDS:
        assert "--" + field.replace("_", "-") in helptext, field
    with pytest.raises(ValidationError):  # frozen
        got.polar_api = False  # type: ignore[misc]


def test_the_sandbox_limits_are_options_of_rollout_serve_and_node_and_reach_a_nodes_pipeline():
    """--memory, --home-size, --allow-unenforced-limits, … (RolloutOptions' LIMIT_FIELDS): the same
    generated options on every command that runs samples, and a node's pipeline takes those given
    (before, `serve` and `node` had none: their sandboxes always took the defaults)."""
    from polar_mitm.rollout.options import LIMIT_FIELDS, RolloutOptions
    from polar_mitm.service.node import NodeConfig

    for command in ("rollout", "serve", "node"):
        params = {p.name: p for p in main.get_command(click.Context(main), command).params}
        assert set(LIMIT_FIELDS) <= set(params), command
    node = main.get_command(click.Context(main), "node")
    assert "--home-size" in CliRunner().invoke(node, ["--help"]).output
    config = NodeConfig(server="http://x", limits={"memory": 512, "home_size": 64})
    opts = RolloutOptions(**config.limits)
    assert (opts.memory, opts.home_size, opts.tmp_size) == (512, 64, 1024)
    with pytest.raises(ValueError, match="not a sandbox limit"):
        NodeConfig(server="http://x", limits={"memry": 512})


def test_a_nodes_sandboxes_reach_the_operators_mirror_and_take_its_verdict_options(tmp_path):
    """--egress-allow, --reward-key and --mask-egress-refused on every command that runs samples,
    carried by a node's configuration into its proxy and its pipeline (before, `serve` and `node`
    had none: a service's samples could not reach an operator's package mirror at all)."""
    from polar_mitm.service.node import GatewayNode, NodeConfig

    for command in ("rollout", "serve", "node"):
        params = {p.name for p in main.get_command(click.Context(main), command).params}
        assert {"egress_allow", "reward_key", "mask_egress_refused"} <= params, command
    config = NodeConfig(
        server="http://x",
        token="t",
        work_dir=tmp_path,
        egress_allow=["mirror.internal,pypi.internal", "*.corp.example"],
        verdict={"reward_key": "mean", "mask_egress_refused": True},
    )
    node = GatewayNode(NodeConfig.model_validate_json(config.model_dump_json()))  # as `serve` hands it over
    assert node.proxy.config.egress_allow == ["mirror.internal", "pypi.internal", "*.corp.example"]
    opts = node.config.pipeline_options()
    assert (opts.reward_key, opts.mask_egress_refused) == ("mean", True)
    with pytest.raises(ValueError, match="not a verdict option"):
        NodeConfig(server="http://x", verdict={"reward": "mean"})
