"""Write docs/commands.md's reference part from the commands' own --help.

    python scripts/gen_commands_doc.py          # rewrite docs/commands.md
    python scripts/gen_commands_doc.py --check  # exit 1 when the file differs (tests/unit/test_commands_doc.py)

The file's text above MARKER is written by hand and kept as it is; below it, one heading per
command (groups' subcommands too) with its --help in a code block, as `polar-mitm` prints it at
a fixed width.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import click
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's polar_mitm, however the script is started
DOC = ROOT / "docs" / "commands.md"
MARKER = "<!-- Below: made by scripts/gen_commands_doc.py from each command's --help; do not edit. -->"
WIDTH = 100


def command_paths(
    group: click.Group, ctx: click.Context, path: tuple[str, ...] = ()
) -> Iterator[tuple[str, ...]]:
    """Every command under `group`, depth first in the order `--help` lists them."""
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        if cmd is None or cmd.hidden:
            continue
        yield (*path, name)
        if isinstance(cmd, click.Group):
            yield from command_paths(cmd, ctx, (*path, name))


def help_text(path: tuple[str, ...]) -> str:
    from polar_mitm.cli import main

    unset: dict[str, str | None] = {k: None for k in os.environ if k.startswith("POLAR_MITM_")}
    got = CliRunner().invoke(
        main,
        [*path, "--help"],
        prog_name="polar-mitm",
        terminal_width=WIDTH,
        catch_exceptions=False,
        env=unset,
    )
    if got.exit_code != 0:
        raise RuntimeError(f"polar-mitm {' '.join(path)} --help exited {got.exit_code}: {got.output}")
    return got.output.rstrip() + "\n"


def reference() -> str:
    """The generated part: the top-level help, then each command's."""
    from polar_mitm.cli import main

    out = [MARKER, "", "## Every command's `--help`", ""]
    for path in [(), *command_paths(main, click.Context(main))]:
        out += [f"### `polar-mitm{''.join(' ' + p for p in path)}`", "", "```", help_text(path) + "```", ""]
    return "\n".join(out)


def render(current: str) -> str:
    """`current` with its part below MARKER (appended, when it has none) made anew."""
    hand = current.split(MARKER, 1)[0].rstrip() + "\n\n"
    return hand + reference()


def main(argv: list[str]) -> int:
    current = DOC.read_text()
    want = render(current)
    if "--check" in argv:
        if current != want:
            print(
                f"{DOC.relative_to(ROOT)} is out of date: run python scripts/gen_commands_doc.py",
                file=sys.stderr,
            )
            return 1
        return 0
    DOC.write_text(want)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
