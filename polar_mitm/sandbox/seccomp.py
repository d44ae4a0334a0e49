"""The verifier's seccomp profile: what the tests (and the agent's code they run, as root) may not
ask of the kernel.

A verifier's tests and the agent's code they run are one user in one container, so without a
filter the agent's code can `ptrace` the tests' own shell and rewrite the script it has buffered,
or the value of a variable, before the shell writes the reward (seen: `tests/processes/
test_verdict_attacks.py`'s `ptrace` program, 1.0 for a wrong answer). A reward cannot be trusted
from a process that another process of the run may rewrite, so the verifier refuses every call
that reaches into another process (`ptrace`, `process_vm_readv/writev`, `pidfd_getfd`, `kcmp`)
besides what Docker's default profile refuses an unprivileged container: new namespaces (by
`unshare`, `setns` or `clone`'s flags; `clone3` answers ENOSYS, so the C library falls back to
`clone`, whose flags a filter can read), mounts, modules, kexec, the keyring, BPF, perf events,
userfaultfd, io_uring, clocks, swap, reboot, quotas and the kernel's log.

Written as a deny list (`SCMP_ACT_ALLOW` by default) because it replaces Docker's default profile
in the verifier's container only: every call an honest test makes, whatever the image, stays
allowed. /proc is read-only there too (`docker.VERIFIER_READONLY_PATHS`), so /proc/PID/mem is not
a way around it.

Apptainer loads the same list for every instance, its harness's too (`apptainer_profile`: one
difference, forced by what Apptainer can load, said there).
"""

from __future__ import annotations

import json
import platform

EPERM, ENOSYS = 1, 38

DENIED = (
    # into another process
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    # namespaces and mounts
    "unshare", "setns", "mount", "umount", "umount2", "pivot_root", "mount_setattr", "move_mount",
    "open_tree", "fsopen", "fsconfig", "fsmount", "fspick",
    # the kernel itself
    "init_module", "finit_module", "delete_module", "create_module", "query_module",
    "get_kernel_syms", "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff", "syslog",
    "acct", "quotactl", "quotactl_fd", "nfsservctl", "_sysctl", "sysfs", "uselib", "ustat",
    "lookup_dcookie", "iopl", "ioperm", "vm86", "vm86old",
    # keys, BPF, perf, userfaultfd, io_uring
    "add_key", "request_key", "keyctl", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    # clocks, memory policy, handles
    "settimeofday", "stime", "clock_settime", "clock_adjtime", "adjtimex", "mbind",
    "set_mempolicy", "move_pages", "migrate_pages", "open_by_handle_at", "name_to_handle_at",
)  # fmt: skip

# clone's flags that make a namespace: one rule each (a rule's conditions all hold together).
NAMESPACE_FLAGS = (
    0x00000080,  # CLONE_NEWTIME
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)


# The host's architecture and those its kernel also runs (a 32-bit call takes another number).
ARCHES = {
    "x86_64": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
    "aarch64": ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"],
}


def verifier_profile() -> dict:
    """The profile, in the JSON Docker takes as `--security-opt seccomp=...`."""
    return _profile({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS})


def apptainer_profile() -> dict:
    """The same refusals as Apptainer (1.4.5) loads them (`--security seccomp:FILE`), for every
    instance, the harness's as well as the verifier's. Apptainer answers EPERM to every
    `SCMP_ACT_ERRNO` rule whatever its `errnoRet`, and an EPERM from `clone3` stops the C
    library's threads (it falls back to `clone` on ENOSYS only), so `clone3` is `SCMP_ACT_TRACE`:
    the kernel answers ENOSYS to it when no tracer is attached. A tracer could let it through (the
    kernel passes a call that asks for a trace twice), so `ptrace` stays refused in the harness
    too: stricter than Docker's default profile (no strace or gdb in an Apptainer harness)."""
    return _profile({"names": ["clone3"], "action": "SCMP_ACT_TRACE"})


def _profile(clone3: dict) -> dict:
    """DENIED and NAMESPACE_FLAGS as a profile, with `clone3`'s rule as given."""
    rules: list[dict] = [{"names": list(DENIED), "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM}]
    rules += [
        {
            "names": ["clone"],
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": EPERM,
            "args": [{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}],
        }
        for flag in NAMESPACE_FLAGS
    ]
    rules.append(clone3)
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ARCHES.get(platform.machine(), []),
        "syscalls": rules,
    }


def verifier_security_opt() -> str:
    return "seccomp=" + json.dumps(verifier_profile(), separators=(",", ":"))
