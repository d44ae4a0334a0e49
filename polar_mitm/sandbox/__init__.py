"""The sandboxes rollouts run samples in: the interface every runtime implements (`base`), the
runtimes `local` (`tempdir`), `docker` and `apptainer`, made by name (`make_runtime`), and a
container's one way to the proxy (`channel`, with the relay it runs inside, `forwarder/`)."""

from __future__ import annotations

from polar_mitm.tasks.model import RUNTIMES

__all__ = ["RUNTIMES", "make_runtime"]


def make_runtime(name: str):
    """The sandbox runtime called `name` (imported only when asked for)."""
    if name == "docker":
        from polar_mitm.sandbox.docker import DockerRuntime

        return DockerRuntime()
    if name == "local":
        from polar_mitm.sandbox.tempdir import TempdirRuntime

        return TempdirRuntime()
    if name == "apptainer":
        from polar_mitm.sandbox.apptainer import ApptainerRuntime

        return ApptainerRuntime()
    raise ValueError(f"unknown runtime {name!r}; choose one of {', '.join(RUNTIMES)}")
