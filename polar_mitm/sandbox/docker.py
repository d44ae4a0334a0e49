"""The `docker` runtime: one container per sample.

A container starts from the task's image (built from its Dockerfile when it has no image, tagged
by the content of its build context so a rebuild happens only when something changed), runs
`sleep infinity`, and everything else is `exec`: setup, the harness, the evaluator.

Isolation: the container has no network (`--network none`). Its one way out is the sample's own
Unix socket to the proxy (`sandbox/channel.py`), bound in read-only, with a forwarder inside on
127.0.0.1:FORWARD_PORT as the container's entrypoint (node, the binary we mount for JavaScript
harnesses, else the interpreter we mount for a Python harness, else the image's python3; without
a channel the entrypoint is `sleep infinity`). Every capability is dropped but the five root's
own steps need (setup, scoring: chown, reading and writing others' files, switching users),
no-new-privileges, a pids limit, the task's memory and CPU. The harness runs as an unprivileged user (HARNESS_USER, its workdir and HOME
handed to it) and has no capability at all; when it ends, or overruns, the container is killed
(SIGKILL, no grace period: every process in it is gone whatever the image holds) and started
again, the same filesystem, for scoring.

Mounted: the sample's `home` (read-write), our CA, the harness installation (npm's modules and
node, or a PyPI harness's virtualenv and interpreter at the host's own paths), the forwarder and
the socket (read-only). Containers carry labels naming their rollout, so a crashed run's
leftovers can be found and removed.

A verifier's container (`SandboxSpec.purpose = "verifier"`) starts from the same image with no
network and nothing of ours mounted; a sample is scored there, from its agent's artefacts, after
the agent's container was halted (`rollout/verify.py`).

The daemon is asked through the `docker` SDK for images and a container's config, and through
`sandbox/daemon.py` (`DaemonCalls` on its Unix socket; `SdkCalls` for a daemon elsewhere) for a
sample's calls once its container exists: most of polar-mitm's own CPU in a rollout was requests'
per-call work in the SDK. Both are blocking; every call runs in a worker thread. The container
once started is `sandbox/docker_sandbox.py`'s `DockerSandbox`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
from pathlib import Path
from typing import Any

from polar_mitm.once import Flights
from polar_mitm.sandbox.base import (
    CHANGES_LISTED,
    CHANNEL_SOCKET,
    FORWARDER_ROOT,
    HARNESS_BIN,
    HOME_DIR,
    NODE_BIN,
    NPM_MODULES,
    ROOT_CAPS,
    ExportTooLarge,
    Limits,
    RuntimeUnavailable,
    Sandbox,
    SandboxError,
    SandboxSpec,
    Snapshot,
    ca_mounts,
    refuse_unenforced,
    sandbox_ca,
)
from polar_mitm.sandbox.channel import FORWARD_PORT, FORWARDER_DIR
from polar_mitm.sandbox.daemon import DaemonCalls, DaemonRefused, SdkCalls
from polar_mitm.sandbox.docker_sandbox import DEFAULT_PATH, HOME_SEED, DockerSandbox, seed_home
from polar_mitm.sandbox.seccomp import verifier_security_opt
from polar_mitm.tasks.model import Task

log = logging.getLogger("polar_mitm.docker")

# The options `DockerRuntime.start` gives a container, by where the SDK's builders take them.
CONTAINER_KEYS = frozenset({"entrypoint", "command", "labels", "environment", "working_dir"})
HOST_KEYS = frozenset(
    {
        "network_mode",
        "volumes",
        "mounts",
        "cap_drop",
        "cap_add",
        "security_opt",
        "pids_limit",
        "nano_cpus",
        "mem_limit",
        "readonly_paths",
        "memswap_limit",
        "tmpfs",
    }
)
# A verifier's /proc is read-only as a whole (Docker's own read-only paths are parts of it): the
# tests run the agent's code as root, which could otherwise write the memory of the tests' own
# shell through /proc/<pid>/mem (no capability needed for a process of the same user) or a
# kernel knob; writes through /proc/self/fd/N reach their files' own mounts, as before.
VERIFIER_READONLY_PATHS = ["/proc", "/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]
LABEL = "polar-mitm"
SNAPSHOT_REPO = "polar-mitm/snapshot"  # agent containers kept for their verifiers (shared mode)
SNAPSHOT_LIMIT = 8 << 30  # bytes an agent's changes may claim (file sizes) to be kept for scoring


def limit_options(limits: Limits, *, home: bool = False) -> dict[str, Any]:
    """A container's limits as the SDK's options: processes, CPUs, memory (swap none beyond it),
    and /tmp (and, for an agent, `home`: HOME) a tmpfs of its size (its pages count against the
    memory limit too), so what a sample writes there is refused past the cap instead of filling
    the host's disk."""
    out: dict[str, Any] = {"pids_limit": limits.pids}
    if limits.cpus:
        out["nano_cpus"] = int(limits.cpus * 1e9)
    if limits.memory_mb:
        out["mem_limit"] = out["memswap_limit"] = f"{limits.memory_mb}m"
    tmpfs = {"/tmp": f"rw,exec,nosuid,nodev,size={limits.tmp_mb}m,mode=1777"} if limits.tmp_mb else {}
    if home and limits.home_mb:
        tmpfs[HOME_DIR] = f"rw,exec,nosuid,nodev,size={limits.home_mb}m,mode=0755"
    if tmpfs:
        out["tmpfs"] = tmpfs
    return out


def mount_options(
    spec: SandboxSpec, *, channel: bool, home_mb: int | None
) -> tuple[dict[str, dict[str, str]], list[Any], list[str]]:
    """(volumes, mounts, PATH prefix) of a container. An agent: its HOME (the sample's `home`
    read-write, or where HOME is a tmpfs of `home_mb`, read-only at HOME_SEED for `seed_home`),
    our CA's public files, the harness installation; a verifier: its inputs and, where it may
    reach the internet, the node it runs on. Both: the channel and its forwarder, where it has
    one."""
    agent = spec.purpose == "agent"
    volumes: dict[str, dict[str, str]] = {}
    if agent:
        (spec.session_dir / "home").mkdir(parents=True, exist_ok=True)
        home = {"bind": HOME_SEED, "mode": "ro"} if home_mb else {"bind": HOME_DIR, "mode": "rw"}
        volumes[str(spec.session_dir / "home")] = home
        for host, inside in ca_mounts(spec.ca):
            volumes[str(host)] = {"bind": inside, "mode": "ro"}
    else:  # a verifier: nothing of ours but, where it may reach the internet, its channel
        volumes = {str(host): {"bind": inside, "mode": "ro"} for host, inside in spec.inputs}
        if channel and spec.forwarder_node is not None:
            volumes[str(spec.forwarder_node)] = {"bind": f"{NODE_BIN}/node", "mode": "ro"}
    if channel:
        volumes[str(spec.channel)] = {"bind": CHANNEL_SOCKET, "mode": "ro"}
        volumes[str(FORWARDER_DIR)] = {"bind": FORWARDER_ROOT, "mode": "ro"}
    prefix: list[str] = []
    mounts: list[Any] = []
    if agent and spec.harness is not None:
        if spec.harness.modules is not None:
            volumes[str(spec.harness.modules)] = {"bind": NPM_MODULES, "mode": "ro"}
        # A PyPI harness's trees, at the host's own paths (one host directory may be shown at
        # two: `volumes` holds one bind per host path, `mounts` any number).
        import docker.types

        mounts = [
            docker.types.Mount(inside, str(host), type="bind", read_only=True)
            for host, inside in spec.harness.trees
        ]
        volumes[str(spec.harness.bin)] = {"bind": HARNESS_BIN, "mode": "ro"}
        prefix.append(HARNESS_BIN)
        if spec.harness.node is not None:
            volumes[str(spec.harness.node)] = {"bind": f"{NODE_BIN}/node", "mode": "ro"}
            prefix.append(NODE_BIN)
    return volumes, mounts, prefix


class ImageUnavailable(RuntimeUnavailable):
    """The task's image is not here and cannot be built or pulled."""


def context_digest(context: Path, dockerfile: Path) -> str:
    """A digest of a build context's files (names, modes and bytes) and its Dockerfile."""
    h = hashlib.sha256()
    for p in sorted(context.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(context)).encode() + b"\0")
            h.update(oct(p.stat().st_mode & 0o777).encode())
            h.update(p.read_bytes())
    h.update(b"dockerfile\0" + dockerfile.read_bytes())
    return h.hexdigest()[:16]


def image_tag(task: Task, digest: str) -> str:
    name = re.sub(r"[^a-z0-9_.-]+", "-", task.id.lower()).strip("-.") or "task"
    return f"polar-mitm/task-{name[:100]}:{digest}"


def forwarder_argv(*, node: bool, python: str | None = None, reap: bool = True) -> list[str]:
    """The container's entrypoint when it has a channel: the forwarder, in front for the
    container's life (restarted with it), on our node when mounted, else on the Python harness's
    own interpreter when mounted, else the image's python3. Root runs it: the unprivileged
    harness cannot stop it."""
    if node:
        script = [f"{NODE_BIN}/node", f"{FORWARDER_ROOT}/forward.js"]
    else:
        script = [python or "python3", f"{FORWARDER_ROOT}/forward.py"]
    # A verifier's init must reap nothing (rollout/verdict.py): node never reaps a child it did
    # not start; forward.py is told.
    return [*script, CHANNEL_SOCKET, str(FORWARD_PORT), "serve", *([] if reap else ["keep-orphans"])]


def docker_client(timeout: int = 120) -> Any:
    """`docker.from_env`, with one connection pool for the daemon's Unix socket.

    The SDK's Unix-socket adapter keeps a pool per request URL (its `get_connection(url)`), and
    every exec, container and archive has URLs of its own: each call opened a new connection and
    a new pool, and evicted another's. Keyed by the daemon instead, calls reuse kept-alive
    connections. And requests looks for proxies in the whole environment on every call
    (`trust_env`), which a Unix socket never uses. `bench/bench_docker_calls.py` measures both."""
    import docker

    client = docker.from_env(timeout=timeout)
    if local_socket(client) is not None:
        client.api.mount("http+docker://", _one_pool(client.api._custom_adapter))
        client.api.trust_env = False
    return client


def local_socket(client: Any) -> str | None:
    """The path of the daemon's Unix socket an SDK client talks to; None for a daemon elsewhere."""
    path = getattr(getattr(client.api, "_custom_adapter", None), "socket_path", None)
    return path if isinstance(path, str) else None


def _one_pool(adapter: Any) -> Any:
    """The SDK's Unix-socket adapter, its pools keyed by the daemon rather than by the URL."""
    from docker.transport.unixconn import UnixHTTPAdapter

    class OnePool(UnixHTTPAdapter):  # type: ignore[misc]
        def get_connection(self, url: Any, proxies: Any = None) -> Any:
            return super().get_connection("http+docker://localhost", proxies)

    return OnePool(
        "http+unix://" + adapter.socket_path, timeout=adapter.timeout, max_pool_size=adapter.max_pool_size
    )


class DockerRuntime:
    """`--runtime docker`."""

    name = "docker"
    isolated = True
    fresh_verifier = True
    mounts_inputs = True
    snapshots = True

    def unenforced(self, limits: Limits) -> str | None:
        """The kinds of limit the daemon says its kernel cannot apply (`docker info`, read by
        `prepare`): Docker then starts the container with a warning and without that limit. The
        tmpfs sizes of /tmp and HOME are the kernel's own and always hold."""
        kinds = {"memory": limits.memory_mb, "CPU": limits.cpus, "pids": limits.pids}
        daemon = self._daemon_limits.kept("info") or {}
        missing = [k for k, wanted in kinds.items() if wanted and daemon.get(k) is False]
        if not missing:
            return None
        return f"the {', '.join(missing)} limits (the daemon's kernel has no cgroup for them: `docker info`)"

    def __init__(self, client: Any | None = None, *, network: str = "none"):
        """`network`: "none" (isolated; the harness reaches the proxy through its channel) or
        "host" (the host's network, as before isolation: for comparison only)."""
        self._client = client
        self._calls: DaemonCalls | SdkCalls | None = None
        self.network = network
        self._images: dict[str, str] = {}  # task id -> image to start from
        self._preparing: Flights[str, str] = Flights(self._images)
        self._paths: dict[str, str] = {}  # image -> its PATH
        self._build_lock = asyncio.Lock()
        # Which kinds of limit the daemon can apply (`docker info`), read once by `prepare`.
        self._daemon_limits: Flights[str, dict[str, bool]] = Flights()

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = docker_client(timeout=120)
        return self._client

    @property
    def calls(self) -> DaemonCalls | SdkCalls:
        """A sample's calls to the daemon once its container exists: `DaemonCalls` where the
        daemon is a local Unix socket, else the SDK's (`SdkCalls`)."""
        if self._calls is None:
            path = local_socket(self.client)
            api = self.client.api
            self._calls = DaemonCalls(path, api.api_version, timeout=120) if path else SdkCalls(api)
        return self._calls

    async def check(self) -> None:
        try:
            await asyncio.to_thread(lambda: self.client.ping())
        except Exception as e:
            raise RuntimeUnavailable(
                f"docker: cannot reach the Docker daemon ({e.__class__.__name__}: {e}). Start it "
                "(`dockerd &`, or `bash scripts/docker.sh` in a source checkout), check DOCKER_HOST, "
                "or use --runtime local"
            ) from None

    async def prepare(self, task: Task) -> None:
        """The task's image, found (pulled) or built once: the samples of a group that start
        together wait for that one (single-flight); with the first, which limits the daemon can
        apply (`unenforced`)."""
        await self._daemon_limits.get("info", self._read_daemon_limits)
        await self._preparing.get(task.id, lambda: self._image(task))

    async def _read_daemon_limits(self) -> dict[str, bool]:
        info = await asyncio.to_thread(lambda: self.client.info())
        keys = {"memory": "MemoryLimit", "CPU": "CpuCfsQuota", "pids": "PidsLimit"}
        return {kind: bool(info[key]) for kind, key in keys.items() if key in info}

    async def _image(self, task: Task) -> str:
        if task.image:
            return await self._ensure_image(task.image)
        if task.dockerfile is not None:
            async with self._build_lock:
                return await self._build(task)
        raise ImageUnavailable(f"task {task.id}: no image and no Dockerfile; the docker runtime needs one")

    def image_of(self, task: Task) -> str:
        """The image `prepare(task)` made available (a tag or a name)."""
        return self._images[task.id]

    async def _ensure_image(self, image: str) -> str:
        import docker.errors

        def find() -> str:
            try:
                self.client.images.get(image)
                return image
            except docker.errors.ImageNotFound:
                pass
            try:
                self.client.images.pull(image)
                return image
            except Exception as e:
                raise ImageUnavailable(
                    f"image {image!r} is not on this machine and could not be pulled ({e.__class__.__name__}: "
                    f"{str(e)[:200]}); build or import it first (docker build / docker import)"
                ) from None

        return await asyncio.to_thread(find)

    async def _build(self, task: Task) -> str:
        import docker.errors

        dockerfile = Path(task.dockerfile)  # type: ignore[arg-type]
        if not dockerfile.is_file():
            raise ImageUnavailable(f"task {task.id}: Dockerfile {dockerfile} does not exist")
        context = dockerfile.parent
        tag = image_tag(task, context_digest(context, dockerfile))

        def build() -> str:
            try:
                self.client.images.get(tag)
                return tag
            except docker.errors.ImageNotFound:
                pass
            log.info("building %s from %s", tag, dockerfile)
            try:
                self.client.images.build(
                    path=str(context), dockerfile=dockerfile.name, tag=tag, rm=True, forcerm=True, pull=False
                )
            except docker.errors.BuildError as e:
                lines = [str(x.get("stream") or x.get("error") or "").rstrip() for x in e.build_log]
                raise ImageUnavailable(
                    f"task {task.id}: building {dockerfile} failed: {e.msg}\n" + "\n".join(lines[-15:])
                ) from None
            return tag

        return await asyncio.to_thread(build)

    async def snapshot(self, sandbox: Sandbox, name: str) -> Snapshot:
        """`docker commit` of the halted container: its layer (what the agent added, changed or
        removed anywhere, within SNAPSHOT_LIMIT bytes by its files' sizes) over the task's image,
        as an image of its own; bind mounts (HOME, the harness) are not part of it."""
        sandbox = getattr(sandbox, "sandbox", sandbox)  # a multi-step task's kept sandbox: its own
        assert isinstance(sandbox, DockerSandbox)
        cid = sandbox.container.id
        tag = re.sub(r"[^a-z0-9_.-]", "-", name.lower())[:120]

        def commit() -> Snapshot:
            claimed = sandbox._changed_size("/", SNAPSHOT_LIMIT)
            if claimed is not None and claimed > SNAPSHOT_LIMIT:
                raise ExportTooLarge(
                    f"container {sandbox.name}: its changes hold more than {SNAPSHOT_LIMIT} bytes"
                )
            changes = self.calls.changes(cid)
            self.calls.commit(cid, SNAPSHOT_REPO, tag)
            paths = [str(c.get("Path")) for c in changes[:CHANGES_LISTED]]
            return Snapshot(f"{SNAPSHOT_REPO}:{tag}", paths, len(changes))

        try:
            return await asyncio.to_thread(commit)
        except ExportTooLarge:
            raise
        except Exception as e:
            raise SandboxError(f"container {sandbox.name}: snapshot failed: {e}") from e

    async def drop_snapshot(self, snapshot: Snapshot) -> None:
        try:
            await asyncio.to_thread(self.calls.remove_image, snapshot.ref)
        except DaemonRefused as e:
            if e.status != 404:
                log.warning("could not remove snapshot %s: %s", snapshot.ref, e)
        except Exception as e:
            log.warning("could not remove snapshot %s: %s", snapshot.ref, e)

    async def start(self, task: Task, spec: SandboxSpec) -> DockerSandbox:
        await self.prepare(task)
        image = spec.image or self._images[task.id]
        agent = spec.purpose == "agent"
        limits = spec.limits.for_task(task)
        refuse_unenforced(self, limits)
        channel = spec.channel is not None and self.network == "none"
        node = spec.harness.node if agent and spec.harness is not None else spec.forwarder_node
        volumes, mounts, prefix = mount_options(spec, channel=channel, home_mb=limits.home_mb)
        kwargs: dict[str, Any] = dict(
            entrypoint=forwarder_argv(
                node=node is not None,
                python=spec.harness.python if agent and spec.harness is not None else None,
                reap=agent,
            )
            if channel
            else ["sleep", "infinity"],
            command=[],
            name=spec.name,
            labels={LABEL: "1", **spec.labels},
            detach=True,
            network_mode=self.network if agent else "none",
            volumes=volumes,
            mounts=mounts,
            environment=task.env,
            cap_drop=["ALL"],
            cap_add=ROOT_CAPS,
            security_opt=["no-new-privileges:true"],
        )
        kwargs.update(limit_options(limits, home=agent))
        # The daemon makes the workdir (root's, as `mkdir -p` would) when it starts the container.
        kwargs["working_dir"] = task.workdir
        if spec.purpose == "verifier":
            kwargs.update(self._verifier_options(volumes))
            prefix = []
        container = await self._create(task, image, kwargs)
        sb = DockerSandbox(
            self,
            container,
            task.workdir,
            sandbox_ca(spec.ca),
            prefix,
            await self._base_path(image),
            user=spec.user if agent else None,
            proxy_address=("127.0.0.1", FORWARD_PORT) if channel else None,
            home=HOME_DIR if agent else None,
            traversed=spec.harness.traversed() if agent and spec.harness is not None else None,
            quiet=not agent and not channel,
        )
        # No exec to check the start: the daemon made the workdir and would have refused a start
        # that failed; a forwarder that dies later is the pipeline's wait for the channel to say.
        await self._check_forwarder(sb, container, task, image, channel)
        if agent and limits.home_mb and any((spec.session_dir / "home").iterdir()):
            await seed_home(sb)
        return sb

    async def _create(self, task: Task, image: str, kwargs: dict[str, Any]) -> Any:
        """The container made and started (`_run_container`, in a thread)."""
        starting = asyncio.ensure_future(asyncio.to_thread(self._run_container, image, kwargs))
        try:
            return await asyncio.shield(starting)
        except asyncio.CancelledError:
            # Cancelled (Ctrl-C, early stop) while the daemon creates it: the container still comes
            # into being in its thread; wait for it and remove it, so nothing is left running.
            with contextlib.suppress(Exception):
                await self.remove(await asyncio.wait_for(starting, 60))
            raise
        except Exception as e:
            raise SandboxError(f"task {task.id}: starting a container from {image} failed: {e}") from e

    async def _check_forwarder(
        self, sb: DockerSandbox, container: Any, task: Task, image: str, channel: bool
    ) -> None:
        state = (container.attrs or {}).get("State") or {}
        if channel and not state.get("Running"):
            # The forwarder, the entrypoint, died as it started (no python3 in the image, say).
            logs = await asyncio.to_thread(lambda: container.logs(tail=20).decode("utf-8", "replace"))
            await sb.stop()
            raise SandboxError(
                f"task {task.id}: the proxy forwarder did not start in {image} (it runs on the node "
                f"we mount for JavaScript harnesses, else on the image's python3): {logs[-500:]}"
            )

    def _run_container(self, image: str, kw: dict[str, Any]) -> Any:
        """`containers.run(image, **kw)` (detached) with the SDK's own builders for the container's
        config, the daemon asked through `self.calls`; the SDK's model of it, from its inspect.
        A container that was made but would not start is removed."""
        unknown = set(kw) - CONTAINER_KEYS - HOST_KEYS - {"name", "detach"}
        if unknown:
            raise TypeError(f"container options not passed on: {sorted(unknown)}")
        api = self.client.api
        host = {k: kw[k] for k in HOST_KEYS if k in kw}
        host["binds"] = host.pop("volumes", None) or None
        readonly = host.pop("readonly_paths", None)
        config = api.create_container_config(
            image,
            kw.get("command"),
            **{k: kw[k] for k in CONTAINER_KEYS if k in kw and k != "command"},
            detach=True,
            host_config=api.create_host_config(**host),
        )
        if readonly:  # the SDK has no argument for it; the daemon's API does
            config["HostConfig"]["ReadonlyPaths"] = readonly
        cid = self.calls.create(config, kw["name"])
        try:
            self.calls.start(cid)
            return self.client.containers.prepare_model(self.calls.inspect(cid))
        except BaseException:
            with contextlib.suppress(Exception):
                self.calls.remove(cid)
            raise

    async def _base_path(self, image: str) -> str:
        """The image's own PATH (its config's Env), read once per image and run."""
        if image not in self._paths:
            attrs = (await asyncio.to_thread(lambda: self.client.images.get(image))).attrs
            env_list = (attrs.get("Config") or {}).get("Env") or []
            self._paths[image] = next(
                (e.split("=", 1)[1] for e in env_list if e.startswith("PATH=")), DEFAULT_PATH
            )
        return self._paths[image]

    def _verifier_options(self, volumes: dict[str, dict[str, str]]) -> dict[str, Any]:
        """A verifier's container: nothing of ours mounted (no session directory, CA or harness)
        but its channel's socket, the forwarder and the node it runs on, read-only, where the
        task lets its verifier reach the internet, and its read-only inputs (the tests, the
        canary); no network besides; /proc read-only; no call into another process (the
        verifier's seccomp profile); the image's own user, binaries and environment."""
        return {
            "network_mode": "none",
            "volumes": volumes,
            "mounts": [],
            "readonly_paths": VERIFIER_READONLY_PATHS,
            # Docker's default profile, and no call into another process (sandbox/seccomp.py).
            "security_opt": ["no-new-privileges:true", verifier_security_opt()],
        }

    async def remove(self, container: Any) -> None:
        try:
            await asyncio.to_thread(self.calls.remove, container.id)
        except DaemonRefused as e:
            if e.status != 404:
                log.warning("could not remove container %s: %s", container.name, e)
        except Exception as e:
            log.warning("could not remove container %s: %s", container.name, e)

    async def cleanup(self, labels: dict[str, str]) -> int:
        filters = {"label": [f"{k}={v}" for k, v in labels.items()]}
        try:
            found = await asyncio.to_thread(self.client.containers.list, all=True, filters=filters)
        except Exception:
            return 0
        for c in found:
            await self.remove(c)
        try:  # snapshots a crashed run left (an image carries its agent container's labels)
            images = await asyncio.to_thread(self.client.images.list, filters=filters)
        except Exception:
            images = []
        for img in images:
            for ref in [t for t in img.tags if t.startswith(SNAPSHOT_REPO + ":")]:
                await self.drop_snapshot(Snapshot(ref, [], 0))
        return len(found)
