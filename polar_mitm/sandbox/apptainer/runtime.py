"""`--runtime apptainer` (`ApptainerRuntime`): the task's image as a SIF, each sample's instance
started with the options `argv.py` builds (limits probed once, disk images made per instance),
recorded in the registry until it stops.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from polar_mitm.once import Flights
from polar_mitm.sandbox.apptainer.argv import (
    CONTAIN,
    KERNEL_RO,
    NO_MOUNT,
    UNAVAILABLE,
    instance_name,
    kernel_options,
    limit_options,
    own_dir,
    start_argv,
    stop_argv,
)
from polar_mitm.sandbox.apptainer.host import find_binary, list_instances, make_disk_images, run_argv
from polar_mitm.sandbox.apptainer.registry import InstanceRecord, default_registry_dir, stop_recorded
from polar_mitm.sandbox.apptainer.sandbox import ApptainerSandbox
from polar_mitm.sandbox.base import (
    ExecResult,
    Limits,
    LimitsUnenforced,
    RuntimeUnavailable,
    SandboxError,
    SandboxSpec,
    refuse_unenforced,
)
from polar_mitm.sandbox.seccomp import apptainer_profile
from polar_mitm.sandbox.sif import SifCache
from polar_mitm.tasks.model import Task

log = logging.getLogger("polar_mitm.apptainer")


class ApptainerRuntime:
    """`--runtime apptainer`.

    `binary`: the apptainer (or singularity) executable, else found by `check()` (find_binary).
    `registry_dir`: where started instances are recorded for `cleanup` (default above).
    `overlay`: True for a writable overlay directory per instance on the host (what lets the
    host read a sealed verifier's files and bound an export by file sizes); False for
    `--writable-tmpfs` (in memory; such instances are not supervised). Hosts that run Apptainer
    setuid allow overlay directories to root only: when a start fails on the overlay, the runtime
    retries it, and the later ones, with the tmpfs.
    """

    name = "apptainer"
    isolated = True
    fresh_verifier = True
    mounts_inputs = True
    snapshots = False

    async def snapshot(self, sandbox: Any, name: str) -> Any:
        raise SandboxError(f"the {self.name} runtime keeps no snapshots; its verifier runs separate")

    async def drop_snapshot(self, snapshot: Any) -> None:
        return None

    def __init__(
        self,
        *,
        binary: str | None = None,
        registry_dir: Path | None = None,
        overlay: bool = True,
        sif_dir: Path | None = None,
        sifs: SifCache | None = None,
        host_root: bool | None = None,
    ):
        self.binary = binary
        self.registry_dir = registry_dir or default_registry_dir()
        self.overlay = overlay
        self.sif_dir = sif_dir
        self.limits = True  # cleared when Apptainer cannot apply cgroups here
        self._probed = False  # whether `probe_limits` ran
        # Whether Apptainer runs as root (else rootless: every process is its user's); by default
        # this process's user. A binary that is a wrapper running Apptainer as another user says.
        self.host_root = os.geteuid() == 0 if host_root is None else host_root
        # What makes the /tmp and HOME images (cleared where it is missing or they cannot be
        # bound: rootless, Apptainer binds them with fuse2fs).
        tools = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"
        self.mke2fs = shutil.which("mke2fs", path=tools)
        if not self.host_root and shutil.which("fuse2fs", path=tools) is None:
            self.mke2fs = None
        self._sifs: SifCache | None = sifs
        self._images: dict[str, str] = {}
        self._preparing: Flights[str, str] = Flights(self._images)  # single-flight per task

    def unenforced(self, limits: Limits) -> str | None:
        """What the probe (`probe_limits`) and the disk images found this host cannot bound."""
        missing = []
        if not self.limits and limits.memory_mb:
            missing.append(
                "the memory, CPU and pids limits (Apptainer needs cgroups: cgroup v2, and as root "
                "`systemd cgroups = no` where systemd does not run)"
            )
        if self.mke2fs is None and (limits.tmp_mb or limits.home_mb):
            missing.append(
                "the sizes of /tmp and HOME (file system images: `mke2fs` from e2fsprogs, and "
                "rootless `fuse2fs` to bind them)"
            )
        return " and ".join(missing) or None

    async def _binary(self) -> str:
        if self.binary is None:
            self.binary = await asyncio.to_thread(find_binary)
        if self.binary is None:
            raise RuntimeUnavailable(UNAVAILABLE)
        return self.binary

    async def check(self) -> None:
        await self._binary()

    @property
    def sifs(self) -> SifCache:
        assert self.binary is not None
        if self._sifs is None:
            self._sifs = SifCache(self.binary, self.sif_dir)
        return self._sifs

    async def prepare(self, task: Task) -> None:
        """The task's image as Apptainer starts it (converted once per image; see sandbox/sif.py);
        with the first, whether Apptainer can apply cgroups here (`probe_limits`)."""
        if task.id not in self._images:
            binary = await self._binary()
            image = await self._preparing.get(task.id, lambda: self.sifs.resolve(task))
            if not self._probed:
                self._probed = True
                await self.probe_limits(binary, image)

    async def probe_limits(self, binary: str, image: str) -> None:
        """Start (and stop) an instance with a memory limit: where Apptainer cannot apply cgroups,
        `limits` is False from here on, said once, before any sample starts (a rollout then
        refuses to start unless allowed: `Pipeline._refuse_unenforced_limits`)."""
        name = instance_name(f"polar-probe-{uuid.uuid4().hex[:8]}")
        argv = [binary, "instance", "start", CONTAIN, "--no-mount", NO_MOUNT, "--memory", str(64 << 20)]
        r = await run_argv([*argv, image, name], timeout=120)
        if r.exit_code == 0:
            await run_argv(stop_argv(binary, name), timeout=60)
        elif "cgroups" in r.output:
            self._no_cgroups(r.output)

    def _no_cgroups(self, output: str) -> None:
        self.limits = False
        log.warning(
            "apptainer cannot apply cgroups here (%s): instances start without the memory, CPU and "
            "pids limits (as root without systemd: `systemd cgroups = no` in apptainer.conf)",
            output.strip().splitlines()[-1][-200:] if output.strip() else "",
        )

    async def _start_instance(
        self,
        binary: str,
        image: str,
        name: str,
        spec: SandboxSpec,
        task: Task,
        overlay: Path | None,
        images: dict[str, Path] | None = None,
    ) -> ExecResult:
        limits = limit_options(spec.limits.for_task(task)) if self.limits else []
        knobs = tuple(p for p in KERNEL_RO if os.path.exists(p))  # (a kernel may lack sysrq)
        profile = own_dir(spec) / "seccomp.json"  # read by Apptainer at the start, as its user
        profile.write_text(json.dumps(apptainer_profile()))
        kernel = kernel_options(spec, host_root=self.host_root, knobs=knobs, seccomp=profile)
        r = await run_argv(start_argv(binary, image, name, spec, overlay, limits, kernel, images))
        if r.exit_code != 0 and limits and "cgroups" in r.output:
            self._no_cgroups(r.output)
            refuse_unenforced(self, spec.limits.for_task(task))
            r = await run_argv(start_argv(binary, image, name, spec, overlay, [], kernel, images))
        return r

    async def _disk_images(self, spec: SandboxSpec, task: Task) -> dict[str, Path]:
        """The instance's /tmp and HOME as file system images of their caps (`make_disk_images`),
        or none where this host cannot make or bind them (said once)."""
        if self.mke2fs is None:
            return {}
        try:
            return await make_disk_images(spec, spec.limits.for_task(task), self.mke2fs)
        except SandboxError as e:
            self._unbounded_disk(str(e))
            refuse_unenforced(self, spec.limits.for_task(task))
            return {}

    def _unbounded_disk(self, why: str) -> None:
        self.mke2fs = None
        log.warning(
            "apptainer: the sandboxes' /tmp and HOME are not bounded here (%s): they take the host's disk",
            why[-300:],
        )

    async def start(self, task: Task, spec: SandboxSpec) -> ApptainerSandbox:
        binary = await self._binary()
        await self.prepare(task)
        refuse_unenforced(self, spec.limits.for_task(task))
        image = self._images[task.id]
        name = instance_name(spec.name)
        mine = own_dir(spec)
        shutil.rmtree(mine, ignore_errors=True)
        (mine / "xfer").mkdir(parents=True)
        if spec.purpose == "agent":
            (spec.session_dir / "home").mkdir(parents=True, exist_ok=True)
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        record_path = self.registry_dir / f"{name}.json"
        record = InstanceRecord(
            name=name,
            binary=binary,
            image=image,
            session_dir=spec.session_dir,
            labels=spec.labels,
            started_at=time.time(),
        )
        record_path.write_text(record.model_dump_json())  # before the start: a crash mid-start is found too
        overlay = mine / "overlay" if self.overlay else None
        if overlay is not None:
            overlay.mkdir(parents=True, exist_ok=True)
        try:
            images = await self._disk_images(spec, task)
            result = await self._start_instance(binary, image, name, spec, task, overlay, images)
            if (
                result.exit_code != 0 and images and spec.limits.allow_unenforced
            ):  # (rootless without fuse2fs)
                retry = await self._start_instance(binary, image, name, spec, task, overlay)
                if retry.exit_code == 0:
                    self._unbounded_disk(
                        result.output.strip().splitlines()[-1] if result.output.strip() else ""
                    )
                    images, result = {}, retry
            if result.exit_code != 0 and overlay is not None and "overlay" in result.output.lower():
                self.overlay = False
                shutil.rmtree(overlay, ignore_errors=True)
                overlay = None
                result = await self._start_instance(binary, image, name, spec, task, None, images)
        except LimitsUnenforced:  # refused where no instance started
            record_path.unlink(missing_ok=True)
            raise
        if result.exit_code != 0:
            record_path.unlink(missing_ok=True)
            hint = (
                " (if binding the /tmp and HOME images is what failed: --allow-unenforced-limits runs without them)"
                if images and not spec.limits.allow_unenforced
                else ""
            )
            raise SandboxError(
                f"apptainer: instance start for {task.id!r} ({image}) failed{hint}: {result.output[-2000:]}"
            )
        pid = (await list_instances(binary, name)).get(name, 0)
        sandbox = ApptainerSandbox(
            binary=binary,
            name=name,
            workdir=task.workdir,
            spec=spec,
            image=image,
            record_path=record_path,
            overlay=overlay,
            init_pid=pid,
            limits="applied" if self.limits else "not applied: Apptainer cannot use cgroups here",
            host_root=self.host_root,
        )
        try:
            await self._set_up(sandbox, task, spec, sticky_tmp="/tmp" in images)
        except BaseException:
            await sandbox.stop()
            raise
        return sandbox

    async def _set_up(
        self, sandbox: ApptainerSandbox, task: Task, spec: SandboxSpec, *, sticky_tmp: bool
    ) -> None:
        """A started instance made ready: its workdir (and, where /tmp is an image, whose root is
        its owner's, /tmp everyone's and sticky), a verifier's supervisor found, the forwarder
        started where it has a channel."""
        name = sandbox.name
        script = 'mkdir -p -- "$1"' + (" && chmod 1777 /tmp" if sticky_tmp else "")
        made = await sandbox.exec(["sh", "-c", script, "sh", task.workdir], workdir="/")
        if made.exit_code != 0:
            raise SandboxError(
                f"apptainer: cannot create the workdir {task.workdir} in {name}: {made.output}"
            )
        if spec.purpose == "verifier":
            found = await sandbox.exec(["sh", "-c", "command -v python3"], workdir="/")
            path = (
                found.output.strip().splitlines()[-1] if found.exit_code == 0 and found.output.strip() else ""
            )
            sandbox.supervisor = path if path.startswith("/") else None
            if sandbox.supervisor is None:
                log.warning("instance %s: the image has no python3: its tests run unsupervised", name)
        if spec.channel is not None:
            agent = spec.purpose == "agent"
            await sandbox.start_forwarder(
                node=(spec.harness is not None and spec.harness.node is not None)
                if agent
                else spec.forwarder_node is not None,
                python=spec.harness.python if agent and spec.harness is not None else None,
            )

    async def cleanup(self, labels: dict[str, str]) -> int:
        """Stop every recorded instance whose labels include all of `labels`."""
        return await stop_recorded(self.registry_dir, labels, self.binary)
