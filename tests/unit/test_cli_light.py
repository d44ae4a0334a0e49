"""The command line loads only what a command needs: `import polar_mitm.cli.app` (what
`polar-mitm --help` runs) imports no engine client, parquet library, tokenizer or proxy, and
every command's --help still works with its module imported only then."""

import subprocess
import sys

import click
import pytest

from polar_mitm.cli.app import LAZY, main

HEAVY = ("pyarrow", "aiohttp", "tokenizers", "numpy", "mitmproxy")


def printed_by(code: str, timeout: float = 60) -> str:
    """What `code` prints, run in a fresh interpreter (its imports its own), which must succeed."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.slow
def test_importing_the_command_line_loads_no_heavy_library_and_no_policy():
    code = (
        "import sys, polar_mitm.cli.app\n"
        f"heavy = [m for m in sys.modules if m.split('.')[0] in {HEAVY!r}]\n"
        "policy = [m for m in sys.modules if m.startswith('polar_mitm.policy.')"
        " and m != 'polar_mitm.policy.config']\n"
        "commands = [m for m in sys.modules if m.startswith('polar_mitm.cli.')"
        " and m not in ('polar_mitm.cli.app', 'polar_mitm.cli.options')]\n"
        "print(sorted({m.split('.')[0] for m in heavy}), policy, commands)\n"
    )
    assert printed_by(code) == "[] [] []"


@pytest.mark.slow
def test_the_server_loads_no_node_proxy_or_tokenizer():
    """`serve` starts its nodes as processes of their own: the server's process (196 MB with them
    imported, 137 MB without) loads no proxy, pipeline, engine client or tokenizer."""
    code = (
        "import sys, polar_mitm.service.run, polar_mitm.cli.service\n"
        "print(sorted({m.split('.')[0] for m in sys.modules"
        " if m.split('.')[0] in ('mitmproxy', 'tokenizers', 'transformers')}),"
        " sorted(m for m in sys.modules if m == 'polar_mitm.service.node'"
        " or m.startswith(('polar_mitm.proxy', 'polar_mitm.rollout.pipeline', 'polar_mitm.policy.'))"
        " and m != 'polar_mitm.policy.config'))\n"
    )
    assert printed_by(code) == "[] []"


def _every_command(group: click.Group, ctx: click.Context, path: tuple[str, ...] = ()):
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        assert cmd is not None, name
        yield (*path, name)
        if isinstance(cmd, click.Group):
            yield from _every_command(cmd, ctx, (*path, name))


@pytest.mark.slow
def test_every_commands_help_works_and_the_top_level_help_imports_no_command():
    ctx = click.Context(main)
    paths = [list(p) for p in _every_command(main, ctx)]
    assert len(paths) > len(LAZY)
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from polar_mitm.cli import main\n"
        "top = CliRunner().invoke(main, ['--help'])\n"
        "assert top.exit_code == 0, top.output\n"
        "loaded = [m for m in sys.modules if m.startswith('polar_mitm.cli.')"
        " and m not in ('polar_mitm.cli.app', 'polar_mitm.cli.options')]\n"
        "assert not loaded, loaded\n"
        f"for path in {paths!r}:\n"
        "    got = CliRunner().invoke(main, [*path, '--help'])\n"
        "    assert got.exit_code == 0 and got.output.startswith('Usage: '), (path, got.output)\n"
        "print('ok')\n"
    )
    assert printed_by(code, timeout=120) == "ok"


def test_each_lazy_commands_summary_is_its_own_first_paragraph():
    """`polar-mitm --help` lists a lazy command by LAZY's summary: it must read as the command's
    own docstring does, and name the command it loads."""
    for name, lazy in LAZY.items():
        cmd = lazy.load()
        assert cmd.name == name, (name, lazy.target)
        own = click.Command(name, help=cmd.help).get_short_help_str(limit=10_000)
        listed = click.Command(name, help=lazy.summary).get_short_help_str(limit=10_000)
        assert listed == own, f"LAZY[{name!r}].summary should be {own!r}"


def test_the_listing_is_the_same_before_and_after_the_commands_are_imported():
    from click.testing import CliRunner

    own = {n: c for n, c in main.commands.items() if n not in LAZY}
    fresh = type(main)(name=main.name, lazy=LAZY, commands=own)
    before = CliRunner().invoke(fresh, ["--help"]).output
    ctx = click.Context(fresh)
    for name in fresh.list_commands(ctx):
        fresh.get_command(ctx, name)
    after = CliRunner().invoke(fresh, ["--help"]).output
    assert "Commands:" in before and "export" in before
    assert before == after


def test_every_command_a_module_declares_is_one_of_main():
    """The command modules' COMMANDS lists and LAZY name the same commands."""
    from polar_mitm.cli import data, service, view

    declared = {c.name: c for m in (data, service, view) for c in m.COMMANDS}
    lazy = {name: lazy.load() for name, lazy in LAZY.items()}
    assert all(lazy.get(name) is cmd for name, cmd in declared.items()), set(declared) - set(lazy)
