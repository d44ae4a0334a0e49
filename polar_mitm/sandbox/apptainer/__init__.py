"""The `apptainer` runtime: each sample in its own Apptainer instance (HPC clusters without Docker).

Tested on the real binary (Apptainer 1.4.5, non-setuid, as root and as an unprivileged user:
tests/processes/test_apptainer_real.py). Each sample gets an instance started from the task's
image as a SIF (`sandbox/sif.py`: converted once per image content and cached), with:

- **no network** but loopback (`--net --network none`); the proxy is reached through the sample's
  own channel (its Unix socket and the forwarder, read-only; `sandbox/channel.py`);
- **a minimal /dev** (`--contain`: no host block device, no host /tmp or home) and none of the
  host's home, working directory or /tmp (`--no-mount home,cwd,tmp`);
- **no privilege**: as root on the host, the harness runs as HARNESS_USER with no capability
  (the image's `setpriv`, inside an exec with no-new-privileges), and root's own steps (setup,
  scoring) keep only ROOT_CAPS (`--no-privs --add-caps`); run by an unprivileged user, every
  process is that user's, with no capability (Apptainer's user namespace); every process under
  the one seccomp profile of `sandbox/seccomp.py` (no new namespace, mount, ptrace, ...);
- the task's memory, CPU and a pids limit (`--memory`, `--cpus`, `--pids-limit`) where Apptainer
  can apply cgroups (cgroup v2, or cgroupfs with `systemd cgroups = no` as root); where it
  cannot, the instance starts without them, once logged and recorded in `describe()`;
- its writes in an overlay directory of its own on the host (so the host reads a verdict file
  without running anything in the sandbox), the harness's HOME bound from the sample's `home`,
  our CA's public files and the (read-only) harness installation at the paths `sandbox/base.py`
  names, and a transfer directory for copies in and out.

The instance has its own PID namespace: the host lists and kills its processes by that namespace
(`processes`, `kill_all`, `seal`), whatever the image holds or the harness replaced. Its init
reaps orphans, so a verifier's tests run under `forwarder/reap.py`, a child subreaper that keeps
what they abandon in sight (see there); the host checks its report and seals the instance after.

A verifier (`SandboxSpec.purpose = "verifier"`) is a fresh instance from the same SIF with
nothing of ours bound but its transfer directory and the supervisor (and its channel, where the
task lets its verifier reach the internet); the agent's workdir comes in as a tar
(`rollout/verify.py`). The agent's tar is made by the agent instance's own `tar` once every
process in it is killed: a replaced `tar` can only change what the artefacts are, which the agent
controls anyway; the host reads it as untrusted (bounded by the overlay's file sizes first, then
by bytes; members outside the workdir, devices and paths through links dropped).

The package's rooms: `argv` (the command lines, pure), `host` (the binary, its processes, the
disk images), `registry` (the instances we started), `sandbox` (one instance), `runtime` (the
runtime); the untrusted tar and overlay readers are `sandbox/untrusted.py`, shared with Docker.
The command lines are built by `argv`'s pure functions and run as asyncio subprocesses. spython
finds the binary (`spython.utils.check_install`); its `Client` is not used because it always runs
`singularity` (hosts with only `apptainer` have none) and its `execute` blocks without a timeout.
Apptainer keeps no labels, so each instance we start is recorded as a JSON file in a registry
directory (`$POLAR_MITM_CACHE/apptainer/instances`); `cleanup(labels)` stops the recorded
instances whose labels match.
"""

from polar_mitm.sandbox.apptainer.runtime import ApptainerRuntime
from polar_mitm.sandbox.apptainer.sandbox import ApptainerSandbox

__all__ = ["ApptainerRuntime", "ApptainerSandbox"]
