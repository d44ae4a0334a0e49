"""Recipes' home files: written into a fresh HOME, never over a file or through a link."""

import pytest
from pydantic import ValidationError

from polar_mitm import recipes
from polar_mitm.recipes import Recipe


def test_home_files_are_created_once_and_links_are_not_followed(tmp_path):
    home, outside = tmp_path / "home", tmp_path / "outside.txt"
    home.mkdir()
    r = Recipe(name="x", home_files={".x/config.yaml": "a: 1\n", "settings.json": "{}"})
    assert r.write_home_files(home) == [home / ".x/config.yaml", home / "settings.json"]
    assert (home / ".x/config.yaml").read_text() == "a: 1\n"
    assert (home / ".x/config.yaml").stat().st_mode & 0o777 == 0o600
    (home / ".x/config.yaml").write_text("mine\n")  # the user's (or a task's) own file is kept
    (home / "settings.json").unlink()
    (home / "settings.json").symlink_to(outside)  # a planted link is not written through
    assert r.write_home_files(home) == []
    assert (home / ".x/config.yaml").read_text() == "mine\n" and not outside.exists()


@pytest.mark.parametrize("bad", ["/etc/passwd", "../up.txt", ".x/../../up.txt", ""])
def test_home_files_stay_inside_home(bad):
    with pytest.raises(ValidationError):
        Recipe(name="x", home_files={bad: "x"})


def test_every_recipe_loads_and_its_headless_command_takes_the_instruction():
    for r in recipes.all_recipes().values():
        if r.headless:
            cmd = r.headless_command("do it")
            assert "do it" in cmd and "{instruction}" not in " ".join(cmd)
