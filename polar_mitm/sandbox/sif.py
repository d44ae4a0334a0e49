"""Task images as the `apptainer` runtime starts them: a SIF file, converted once per image.

A task names its image as its users have it; `SifCache.resolve` turns it into what `apptainer
instance start` is given:

- a `.sif` / `.simg` file or another path: itself;
- `docker-daemon:NAME`, or a plain Docker image name the local Docker daemon holds: converted
  from the daemon (`apptainer build X.sif docker-daemon:NAME`), keyed by the image's id;
- `docker-archive:PATH` (a `docker save` tar): converted, keyed by the file's sha256;
- a task with only a Dockerfile: built with Docker where it is usable (the docker runtime's
  build, tagged by the content of its context), then converted as above; else built by
  `apptainer build` from a definition generated from it (`sandbox/dockerfile.py`), keyed by the
  context's content;
- a reference with another of Apptainer's transports (`docker://`, `oras://`, `library://`,
  `oci:`...), or a plain name no local daemon holds (it becomes `docker://NAME`): given to
  Apptainer as is; it pulls and converts it once into its own cache (`$APPTAINER_CACHEDIR`).

Converted images live in `$POLAR_MITM_CACHE/apptainer/sif/<key>.sif` (content-addressed: the same
image content is converted once, whatever its name or task), written under a temporary name and
renamed when complete, one conversion per key at a time (a lock file, across processes too). The
cache is bounded (`POLAR_MITM_SIF_CACHE_GB`, default 20): past it the least recently used images
go, never one in use by this process. Each conversion is logged with how long it took, which
`rollout`'s progress shows.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from polar_mitm.cache import cache_dir
from polar_mitm.sandbox.base import ExecResult, SandboxError, run_process
from polar_mitm.tasks.model import Task

log = logging.getLogger("polar_mitm.apptainer")

# Apptainer's own transports (`internal/pkg/util/uri`): a reference starting with one is kept.
TRANSPORTS = frozenset(
    {
        "library",
        "shub",
        "docker",
        "docker-archive",
        "docker-daemon",
        "oci",
        "oci-archive",
        "http",
        "https",
        "oras",
        "ipfs",
    }
)
CONVERT_TIMEOUT = 3600.0
DEFAULT_LIMIT_GB = 20.0


def is_path(image: str) -> bool:
    """A file or directory on the host (`.sif`, `/abs`, `./rel`, `~/x`), not a reference."""
    return image.startswith(("/", ".", "~")) or image.endswith((".sif", ".simg"))


def transport(image: str) -> str | None:
    """The Apptainer transport `image` starts with (`docker-daemon` in `docker-daemon:x`), if any."""
    if is_path(image):
        return None
    head = image.split("://", 1)[0] if "://" in image else image.split(":", 1)[0]
    return head if head in TRANSPORTS and (":" in image) else None


def default_dir() -> Path:
    return cache_dir() / "apptainer" / "sif"


def limit_bytes() -> int:
    try:
        gb = float(os.environ.get("POLAR_MITM_SIF_CACHE_GB") or DEFAULT_LIMIT_GB)
    except ValueError:
        gb = DEFAULT_LIMIT_GB
    return int(gb * (1 << 30))


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class SifCache:
    """Converted images by content key, on disk, bounded; see the module docstring."""

    def __init__(
        self,
        binary: str,
        root: Path | None = None,
        limit: int | None = None,
        *,
        dockerfiles: str = "auto",
        bootstrap: str = "docker",
    ):
        """`dockerfiles`: "auto" (Docker where usable, else a generated definition), "docker" or
        "apptainer"; `bootstrap`: where a generated definition's FROM comes from ("docker": a
        registry; "docker-daemon": the local daemon)."""
        self.binary = binary
        self.dockerfiles = dockerfiles
        self.bootstrap = bootstrap
        self.root = root or default_dir()
        self.limit = limit_bytes() if limit is None else limit
        self.in_use: set[Path] = set()
        self.conversions: list[dict[str, object]] = []  # what this process converted, and how long it took
        self._locks: dict[str, asyncio.Lock] = {}
        self._archive_keys: dict[tuple[str, int, int], str] = {}

    async def resolve(self, task: Task) -> str:
        if task.image:
            return await self.resolve_image(task.image.strip(), task.id)
        if task.dockerfile is not None:
            return await self._from_dockerfile(task)
        raise SandboxError(
            f"apptainer: task {task.id!r} names no image (a .sif file, a docker image or a Dockerfile)"
        )

    async def resolve_image(self, image: str, task_id: str = "") -> str:
        if is_path(image):
            path = Path(os.path.expanduser(image))
            if not path.exists():
                raise SandboxError(f"apptainer: task {task_id!r}: image file {path} does not exist")
            return str(path)
        kind = transport(image)
        if kind == "docker-daemon":
            name = image.split(":", 1)[1]
            image_id = await asyncio.to_thread(_daemon_image_id, name)
            if image_id is None:
                raise SandboxError(
                    f"apptainer: task {task_id!r}: the local Docker daemon has no image {name!r}"
                )
            return str(await self.convert(_key(image_id), f"docker-daemon:{name}"))
        if kind == "docker-archive":
            path = Path(os.path.expanduser(image.split(":", 1)[1]))
            if not path.is_file():
                raise SandboxError(f"apptainer: task {task_id!r}: {path} does not exist")
            st = path.stat()
            memo = (str(path.resolve()), st.st_size, st.st_mtime_ns)
            key = self._archive_keys.get(memo)
            if key is None:
                key = self._archive_keys[memo] = "archive-" + await asyncio.to_thread(file_sha256, path)
            return str(await self.convert(key, f"docker-archive:{path}"))
        if kind is not None:
            return image  # Apptainer pulls and caches it itself
        image_id = await asyncio.to_thread(_daemon_image_id, image)
        if image_id is not None:  # the local daemon has it: no registry needed
            return str(await self.convert(_key(image_id), f"docker-daemon:{image}"))
        return f"docker://{image}"

    async def _from_dockerfile(self, task: Task) -> str:
        from polar_mitm.sandbox.docker import DockerRuntime, context_digest

        dockerfile = Path(task.dockerfile)  # type: ignore[arg-type]
        if not dockerfile.is_file():
            raise SandboxError(f"apptainer: task {task.id!r}: Dockerfile {dockerfile} does not exist")
        if self.dockerfiles != "apptainer":
            docker = DockerRuntime()
            try:
                await docker.check()
            except Exception as e:
                if self.dockerfiles == "docker":
                    raise SandboxError(
                        f"apptainer: task {task.id!r}: Docker is not usable here ({e})"
                    ) from None
            else:
                await docker.prepare(task)
                return await self.resolve_image(f"docker-daemon:{docker.image_of(task)}", task.id)
        from polar_mitm.sandbox.dockerfile import DockerfileError, translate

        context = dockerfile.parent
        try:
            steps = translate(dockerfile.read_text(), bootstrap=self.bootstrap)
        except DockerfileError as e:
            raise SandboxError(
                f"apptainer: task {task.id!r}: {e}. Build the image elsewhere and set the task's image "
                "to the result (a .sif file, docker-archive:TAR or a pushed image)"
            ) from None
        key = "dockerfile-" + await asyncio.to_thread(context_digest, context, dockerfile)
        return str(
            await self.convert(
                key, f"{dockerfile} (from {steps.bootstrap}:{steps.image})", steps=(steps, context)
            )
        )

    async def convert(self, key: str, source: str, steps: tuple[Any, Path] | None = None) -> Path:
        """The SIF of `source` for content `key`, converting it when the cache lacks it."""
        self.root.mkdir(parents=True, exist_ok=True)
        target = self.root / f"{key}.sif"
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            if target.is_file():
                os.utime(target)  # recently used
                self.in_use.add(target)
                return target
            with await asyncio.to_thread(_enter, self.root / f".{key}.lock"):
                if not target.is_file():
                    await self._build(target, source, steps)
        self.in_use.add(target)
        await asyncio.to_thread(self.evict)
        return target

    async def _build(self, target: Path, source: str, steps: tuple[Any, Path] | None = None) -> None:
        partial = target.with_name(f".{target.stem}.{os.getpid()}.partial.sif")
        partial.unlink(missing_ok=True)
        log.info("apptainer: converting %s to a SIF (once per image; %s)", source, target.name)
        t0 = time.monotonic()
        if steps is None:
            r = await run_process(
                [self.binary, "build", "--force", str(partial), source], timeout=CONVERT_TIMEOUT
            )
        else:
            r = await self._build_steps(partial, *steps)
        seconds = time.monotonic() - t0
        if r.exit_code != 0 or not partial.is_file():
            partial.unlink(missing_ok=True)
            raise SandboxError(
                f"apptainer: converting {source} failed (exit {r.exit_code}): {r.output[-1500:]}"
            )
        os.replace(partial, target)
        self.conversions.append({"source": source, "sif": str(target), "seconds": round(seconds, 1)})
        log.info("apptainer: converted %s in %.1f s (%.0f MB)", source, seconds, target.stat().st_size / 1e6)

    async def _build_steps(self, out: Path, steps: Any, context: Path) -> ExecResult:
        """A translated Dockerfile, built as `apptainer build` would build its definition, in
        three plain commands: the base image as a writable sandbox directory, the `%post` script
        run in it by `exec --writable` with the context bound read-only (exec, unlike build,
        keeps to the capabilities apptainer.conf gives root: hosts whose root lacks some fail
        every `%post`), the environment written, then the directory built into the SIF."""
        from polar_mitm.sandbox.dockerfile import CONTEXT_IN

        tree = out.with_suffix(".tree")
        shutil.rmtree(tree, ignore_errors=True)
        try:
            r = await run_process(
                [self.binary, "build", "--force", "--sandbox", str(tree), f"{steps.bootstrap}:{steps.image}"],
                timeout=CONVERT_TIMEOUT,
            )
            if r.exit_code != 0:
                return r
            (tree / CONTEXT_IN.lstrip("/")).mkdir(parents=True, exist_ok=True)
            r = await run_process(
                [self.binary, "exec", "--writable", "--cleanenv", "--no-mount", "home,cwd,tmp",
                 "--bind", f"{context.resolve()}:{CONTEXT_IN}:ro", str(tree), "sh", "-c", steps.script()],
                timeout=CONVERT_TIMEOUT,
            )  # fmt: skip
            if r.exit_code != 0:
                return r
            (tree / CONTEXT_IN.lstrip("/")).rmdir()
            if steps.environment:
                env = tree / ".singularity.d" / "env" / "90-polar-mitm-dockerfile.sh"
                env.parent.mkdir(parents=True, exist_ok=True)
                env.write_text("#!/bin/sh\n" + "\n".join(steps.environment) + "\n")
            return await run_process(
                [self.binary, "build", "--force", str(out), str(tree)], timeout=CONVERT_TIMEOUT
            )
        finally:
            await asyncio.to_thread(shutil.rmtree, tree, True)

    def evict(self) -> list[Path]:
        """Remove the least recently used SIFs until the cache is within its bound; never one in use."""
        files = sorted(self.root.glob("*.sif"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        gone = []
        for p in files:
            if total <= self.limit:
                break
            if p in self.in_use:
                continue
            size = p.stat().st_size
            p.unlink(missing_ok=True)
            total -= size
            gone.append(p)
            log.info("apptainer: removed %s from the SIF cache (over %d bytes)", p.name, self.limit)
        return gone


class _Held:
    def __init__(self, path: Path):
        self.f = open(path, "a+")
        fcntl.flock(self.f, fcntl.LOCK_EX)

    def __enter__(self) -> _Held:
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()


def _enter(path: Path) -> _Held:
    """Take the cross-process lock at `path` (blocking: called in a thread)."""
    return _Held(path)


def _key(image_id: str) -> str:
    return image_id.replace("sha256:", "sha256-")


def _daemon_image_id(name: str) -> str | None:
    """The local Docker daemon's id for image `name`, or None (no such image, or no daemon)."""
    try:
        import docker
        import docker.errors
    except ImportError:
        return None
    try:
        client = docker.from_env(timeout=30)
    except Exception:
        return None
    try:
        return str(client.images.get(name).id)
    except docker.errors.ImageNotFound:
        return None
    except Exception as e:
        log.debug("docker: looking up %s: %s", name, e)
        return None
    finally:
        client.close()
