"""Every command. `main` is the `polar-mitm` group (app.py, with run, proxy, certs, recipes and
tokenizer); each other module holds one domain's commands (data.py: export, show, stats, reward,
check-logprobs; rollout.py; service.py: serve, submit, node; view.py; fake.py: fake-backend), and
options.py the options they share, made from their config models once.

`main` is loaded when asked for, so `polar_mitm.cli.options` can be imported alone; its commands
from the other modules are imported only when run or asked for their help (`app.LAZY`).
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:  # `from polar_mitm.cli import main`
    if name == "main":
        from polar_mitm.cli.app import main

        return main
    raise AttributeError(name)
