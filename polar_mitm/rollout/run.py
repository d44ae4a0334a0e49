"""`run_rollout`: a rollout from Python, what `polar-mitm rollout` runs and a notebook calls alike.

```python
result = asyncio.run(run_rollout("tasks/", harness="claude-code", policy=PolicyConfig(...)))
result.export("groups.parquet")
```

It resolves what runs once (`Specs`: the recipe, the runtime checked, the harness's installation
for containers), checks the policy (the backend answers, the tokenizer loads), starts a proxy
unless given one, and runs the pipeline; the samples' sessions carry the harness's recipe, whose
rules tag their side calls. Errors a user can act on come out as they are: `PreflightError`
(backend, tokenizer), `RuntimeUnavailable`, `HarnessNotInstalled`, `KeyError` (an unknown
harness), `ValueError` (a task that cannot run so), `TaskFileError`.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from polar_mitm.rollout.jobs import RolloutResult
from polar_mitm.rollout.options import RolloutOptions
from polar_mitm.rollout.spec import Specs

if TYPE_CHECKING:
    from polar_mitm.policy import PolicyConfig
    from polar_mitm.proxy.embedded import PolarProxy
    from polar_mitm.rollout.pipeline import Pipeline
    from polar_mitm.sandbox.base import Runtime
    from polar_mitm.tasks.model import Task

__all__ = ["RolloutOptions", "RolloutResult", "run_rollout"]


async def run_rollout(
    tasks: Sequence[Task] | Sequence[str | Path] | str | Path,
    *,
    harness: str,
    policy: PolicyConfig | None = None,
    options: RolloutOptions | None = None,
    runtime: str | Runtime | None = None,
    harness_cmd: Sequence[str] | None = None,
    db: str = "polar-mitm.sqlite",
    certs_dir: Path | None = None,
    egress_allow: Sequence[str] = (),
    proxy: PolarProxy | None = None,
    work_dir: Path | None = None,
    on_start: Callable[[Pipeline, str], None] | None = None,
    on_change: Callable[[Pipeline], None] | None = None,
    own_process: bool = False,
) -> RolloutResult:
    """Run each task `options.samples` times with `harness` in `runtime` (a name, or a runtime
    made already; default `options.runtime`), every model call answered by `policy` through one
    proxy (`proxy`, started already, or one started here on `db`), and return every sample's
    outcome; the rows are in the store (`RolloutResult.export`). `on_start` is told the pipeline
    and the proxy's URL once it runs, `on_change` each change of a sample's stage."""
    from polar_mitm.rollout.pipeline import Pipeline
    from polar_mitm.sandbox import make_runtime
    from polar_mitm.tasks import load_tasks
    from polar_mitm.tasks.model import Task

    items = [tasks] if isinstance(tasks, str | Path) else list(tasks)
    paths = [Path(t) for t in items if isinstance(t, str | Path)]
    loaded = [t for t in items if isinstance(t, Task)] + (load_tasks(paths) if paths else [])
    if not loaded:
        raise ValueError(f"no tasks in {', '.join(map(str, paths)) or 'the list given'}")
    opts = (options or RolloutOptions()).model_copy(update={"harness": harness})
    if harness_cmd is not None:
        opts = opts.model_copy(update={"harness_cmd": list(harness_cmd)})
    rt = make_runtime(runtime or opts.runtime) if runtime is None or isinstance(runtime, str) else runtime
    opts = opts.model_copy(update={"runtime": rt.name})
    if rt.name == "apptainer":  # an image's one-time conversion, and how long it took, shows
        logging.getLogger("polar_mitm.apptainer").setLevel(logging.INFO)
    # Before anything starts: a clear error when the harness, the runtime, the backend or the
    # tokenizer cannot work (one line, not a minute of harness retries).
    spec = await Specs().get(harness, opts.harness_cmd, rt)
    made = work_dir is None
    work = work_dir or Path(tempfile.mkdtemp(prefix="polar-rollout-"))
    own = proxy is None
    try:
        if proxy is None:
            proxy = await _start_proxy(policy, db, certs_dir, egress_allow, own_process)
        try:
            pipeline = Pipeline(opts, proxy, work_dir=work, on_change=on_change)
            if on_start is not None:
                on_start(pipeline, proxy.url)
            return await pipeline.run(loaded, spec)
        finally:
            if own:
                await proxy.stop()
    finally:
        if made and not opts.keep_workdirs:
            shutil.rmtree(work, ignore_errors=True)


async def _start_proxy(
    policy: PolicyConfig | None,
    db: str,
    certs_dir: Path | None,
    egress_allow: Sequence[str],
    own_process: bool,
) -> PolarProxy:
    """A rollout's proxy, its policy checked first: no session gets in but the samples' own."""
    from polar_mitm.harness.preflight import check_policy
    from polar_mitm.policy import PolicyConfig
    from polar_mitm.proxy.embedded import PolarProxy, ProxyConfig
    from polar_mitm.rollout.port import new_token

    config = ProxyConfig(
        db=db,
        certs_dir=certs_dir,
        default_session="rollout-unattributed",
        token=new_token(),
        egress_allow=list(egress_allow),
        policy=policy or PolicyConfig(),
        own_process=own_process,  # this process is the rollout: see long_lived_heap
    )
    config.model_info = await check_policy(config.policy)  # kept: not asked again
    proxy = PolarProxy(config)
    await proxy.start()
    return proxy
