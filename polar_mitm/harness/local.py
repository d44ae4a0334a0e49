"""Run one harness as a local process behind the embedded proxy.

The child gets the proxy variables (both cases), NO_PROXY for loopback, our CA through the
variables its recipe names, dummy credentials when none are set (never in harvest mode, where
the harness's own credentials go to the real provider), and the recipe's settings.
Signals are forwarded; a watchdog says so when the harness refuses our CA (which otherwise
looks like a silent hang while it retries).
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Mapping

from pydantic import BaseModel

from polar_mitm import procs
from polar_mitm.harness import node_proxy
from polar_mitm.proxy.certs import CA
from polar_mitm.proxy.embedded import PolarProxy
from polar_mitm.recipes import Recipe
from polar_mitm.store.queries import session_summary

LOOPBACK = ("127.0.0.1", "localhost", "::1")
EXIT_UNTRUSTED = 69  # EX_UNAVAILABLE: the harness never trusted our CA
_CREDENTIAL_NAME = re.compile(r"KEY|TOKEN|SECRET|AUTH|PASSWORD", re.IGNORECASE)


def _same_dir(a: str | None, b: str) -> bool:
    if not a:
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def child_env(
    base: Mapping[str, str],
    recipe: Recipe,
    proxy_url: str,
    ca: CA,
    session_id: str,
    *,
    harvest: bool = False,
    node_preload: bool = True,
) -> dict[str, str]:
    env = dict(base)
    for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        env[k] = proxy_url
    for k in ("ALL_PROXY", "all_proxy"):
        env.pop(k, None)
    no_proxy = [h for h in (base.get("NO_PROXY") or base.get("no_proxy") or "").split(",") if h]
    no_proxy += [h for h in LOOPBACK if h not in no_proxy]
    env["NO_PROXY"] = env["no_proxy"] = ",".join(no_proxy)
    env["NODE_USE_ENV_PROXY"] = "1"  # Node's own fetch honours the proxy variables (Node >= 24)
    if node_preload:  # and on Node 18-22, through a preload (harness/node_proxy.cjs)
        env.update(node_proxy.env(env))
    # OpenCode works in $PWD, not its real cwd: a launcher that set our cwd (subprocess cwd=)
    # without updating PWD would send it to work in another directory.
    if not _same_dir(env.get("PWD"), os.getcwd()):
        env["PWD"] = os.getcwd()
    for k in recipe.ca.cert_env:
        env[k] = str(ca.cert)
    for k in recipe.ca.bundle_env:
        env[k] = str(ca.bundle)
    env.update(recipe.env)
    # The user's own credentials (any of the variables the harness reads) win over our dummy one.
    has_credential = any(env.get(k) for k in recipe.credential_env)
    for k, v in recipe.env_default.items():
        # Harvest talks to the real provider: a dummy key would replace the harness's own login.
        if (harvest or has_credential) and (_CREDENTIAL_NAME.search(k) or k in recipe.credential_env):
            continue
        if not env.get(k):
            env[k] = v
    env["POLAR_MITM_SESSION"] = session_id
    return env


# What `run` sets that a shell pointing at a shared proxy does without: lower-case copies, plain
# HTTP, the loopback exceptions (the user's own NO_PROXY stays), the working directory and the session
# (told by the user name in the proxy URL).
_NOT_EXPORTED = {
    "https_proxy",
    "HTTP_PROXY",
    "http_proxy",
    "NO_PROXY",
    "no_proxy",
    "PWD",
    "POLAR_MITM_SESSION",
}


def shell_exports(recipe: Recipe, proxy_url: str, ca: CA, *, harvest: bool = False) -> str:
    """One `export …` line that points a shell's harness at a running proxy, from what `run` gives
    its child (`child_env`): the proxy with its credentials, the CA variables of the recipe, its
    dummy credential (not in harvest mode) and its settings."""
    env = child_env({}, recipe, proxy_url, ca, "", harvest=harvest)
    return "export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items() if k not in _NOT_EXPORTED)


def shell_setup(proxy_url: str, ca: CA, *, harvest: bool = False) -> list[str]:
    """For every recipe (the generic one last) a comment naming the harness and its `export` line."""
    from polar_mitm import recipes

    out: list[str] = []
    for r in sorted(recipes.all_recipes().values(), key=lambda r: r.name == "generic"):
        what = r.example or (r.description[:1].lower() + r.description[1:])
        out += [f"# {r.name}: {what}", shell_exports(r, proxy_url, ca, harvest=harvest)]
    return out


class RunResult(BaseModel):
    exit_code: int
    session_id: str
    turns: int
    prompt_tokens: int
    sampled_tokens: int
    db: str
    untrusted: bool = False
    recorded: bool = True  # False: the command was not found, and nothing was started or stored


async def run_harness(
    cmd: list[str],
    proxy: PolarProxy,
    recipe: Recipe,
    *,
    session_id: str,
    task_id: str | None = None,
    untrusted_timeout: float = 15.0,
    env: Mapping[str, str] | None = None,
) -> RunResult:
    base = env if env is not None else os.environ
    # A command that is not there fails before the proxy starts, so no empty session is stored.
    if shutil.which(cmd[0], path=base.get("PATH", os.defpath)) is None:
        _command_not_found(cmd[0], recipe)
        return _not_started(session_id, proxy.config.db, recorded=False)
    await proxy.start()
    harvest = proxy.config.mode == "harvest"
    assert proxy.store is not None and proxy.ca is not None and (harvest or proxy.gateway is not None)
    await _begin_session(proxy, cmd, recipe, session_id, task_id)
    child = child_env(base, recipe, proxy.url, proxy.ca, session_id, harvest=harvest)
    # Signal handlers go in before the harness starts, so a signal can never kill us and orphan it;
    # one that arrives before the harness exists is delivered as soon as it does.
    loop = asyncio.get_running_loop()
    forwarded = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    target = _Target()
    for sig in forwarded:
        loop.add_signal_handler(sig, target.forward, sig)
    try:
        try:
            # Without a terminal, the harness gets its own process group so that signals reach
            # the helpers it spawns too (Qwen Code re-launches itself); an interactive harness
            # stays in the terminal's foreground group, which the terminal signals as a whole.
            own_group = not sys.stdin.isatty()
            proc = await asyncio.create_subprocess_exec(
                *cmd, env=child, process_group=0 if own_group else None
            )
            target.attach(proc, own_group)
        except FileNotFoundError:  # removed since the check above
            _command_not_found(cmd[0], recipe)
            await proxy.store.end_session(session_id, 127)
            return _not_started(session_id, proxy.config.db, recorded=True)
        exit_code, untrusted = await _wait(proxy, proc, cmd, recipe, untrusted_timeout, own_group)
        await proxy.store.end_session(session_id, exit_code)
    finally:
        for sig in forwarded:
            loop.remove_signal_handler(sig)
        await proxy.stop()
    turns, ptoks, stoks = session_summary(proxy.config.db, session_id)
    return RunResult(
        exit_code=exit_code,
        session_id=session_id,
        turns=turns,
        prompt_tokens=ptoks,
        sampled_tokens=stoks,
        db=proxy.config.db,
        untrusted=untrusted,
    )


def _not_started(session_id: str, db: str, *, recorded: bool) -> RunResult:
    """The command was not found (exit 127): no turn, and no session unless `recorded`."""
    return RunResult(
        exit_code=127,
        session_id=session_id,
        turns=0,
        prompt_tokens=0,
        sampled_tokens=0,
        db=db,
        recorded=recorded,
    )


async def _begin_session(
    proxy: PolarProxy, cmd: list[str], recipe: Recipe, session_id: str, task_id: str | None
) -> None:
    """The session's row: its command (credentials redacted, `redact.argv`), recipe and backend."""
    assert proxy.store is not None
    harvest = proxy.config.mode == "harvest"
    await proxy.store.ensure_session(
        session_id,
        task_id=task_id,
        harness=recipe.name,
        command=cmd,
        secret_flags=recipe.secret_flags,
        mode=proxy.config.mode,
        metadata={"recipe": recipe.name, "upstreams": sorted(proxy.config.upstreams)}
        if harvest
        else {"backend": proxy.config.policy.backend_url, "recipe": recipe.name},
    )


async def _wait(
    proxy: PolarProxy,
    proc: asyncio.subprocess.Process,
    cmd: list[str],
    recipe: Recipe,
    untrusted_timeout: float,
    own_group: bool,
) -> tuple[int, bool]:
    """The harness's exit code (EXIT_UNTRUSTED when it refused our CA), once it and what it left
    behind are gone, and whether it refused our CA; the watchdog stops one that keeps refusing."""
    verdict: dict[str, bool] = {}
    watch = asyncio.create_task(_watchdog(proxy, proc, untrusted_timeout, verdict, own_group))
    try:
        code = await proc.wait()
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        if own_group:
            procs.kill_group(proc.pid)  # leftovers of the harness, if any
    untrusted = verdict.get("untrusted", False)
    if not untrusted and code != 0 and _refused(proxy):
        # The harness gave up on its own before the watchdog's timeout (Claude Code 2.1.33x
        # exits 1 after a few failed handshakes, where earlier releases retried for ever).
        _say_untrusted(proxy, "before the harness exited", "")
        untrusted = True
    if proxy.tls.connections == 0:
        _say_no_connection(cmd, recipe)
    return (EXIT_UNTRUSTED if untrusted else procs.exit_code(code)), untrusted


def _say_no_connection(cmd: list[str], recipe: Recipe) -> None:
    """The harness ended without one connection to the proxy: nothing it did was recorded."""
    node = " (on Node < 24 fetch ignores it; the preload that fixes that is off or undici is missing)"
    print(
        f"polar-mitm: {os.path.basename(cmd[0])} made no connection through the proxy, so no model call was "
        f"recorded. Likely causes: it ignores HTTPS_PROXY{node if recipe.npm or cmd[0] == 'node' else ''}, "
        "its configuration sends it to a base URL or host that bypasses the proxy (NO_PROXY, a local server), "
        "or it failed before calling a model (see its output above).",
        file=sys.stderr,
    )


def _command_not_found(name: str, recipe: Recipe) -> None:
    if os.sep in name and os.path.exists(name):
        print(f"polar-mitm: command not found: {name} is not an executable file", file=sys.stderr)
        return
    hint = f" (npm install -g {recipe.npm})" if recipe.npm else ""
    print(f"polar-mitm: command not found: {name}{hint}", file=sys.stderr)


class _Target:
    """Where forwarded signals go: the harness (or its process group) once it is running."""

    def __init__(self) -> None:
        self.proc: asyncio.subprocess.Process | None = None
        self.own_group = False
        self.pending: list[int] = []

    def attach(self, proc: asyncio.subprocess.Process, own_group: bool) -> None:
        self.proc, self.own_group = proc, own_group
        for sig in self.pending:
            procs.send_async(proc, sig, group=own_group)

    def forward(self, sig: int) -> None:
        if self.proc is None:
            self.pending.append(sig)
        else:
            procs.send_async(self.proc, sig, group=self.own_group)


async def _watchdog(
    proxy: PolarProxy,
    proc: asyncio.subprocess.Process,
    timeout: float,
    verdict: dict[str, bool],
    own_group: bool = False,
) -> None:
    """Stop the harness (and set verdict["untrusted"]) when it keeps refusing our CA."""
    try:
        while proc.returncode is None:
            await asyncio.sleep(0.5)
            refused = _refused(proxy)
            if not refused or time.time() - refused[0][0] < timeout:
                continue
            _say_untrusted(proxy, f"in {timeout:.0f}s", " Stopping the harness.")
            verdict["untrusted"] = True
            await procs.stop_async(proc, 5, group=own_group)
            return
    except asyncio.CancelledError:
        return


def _refused(proxy: PolarProxy) -> list[tuple[float, str, str]]:
    """The failed TLS handshakes for hosts where none succeeded: the harness does not trust us there."""
    tls = proxy.tls
    return [f for f in tls.failures if not tls.trusted(f[1])]


def _say_untrusted(proxy: PolarProxy, when: str, then: str) -> None:
    refused = _refused(proxy)
    _, sni, err = refused[0]
    print(
        f"polar-mitm: the harness refused our CA for {sni} ({len(refused)} failed TLS handshakes, "
        f"none succeeded {when}): {err}\n"
        f"  It does not trust {proxy.ca.cert if proxy.ca else 'the polar-mitm CA'}. Check that the recipe "
        "sets the CA variable this harness reads (NODE_EXTRA_CA_CERTS, SSL_CERT_FILE, "
        f"CODEX_CA_CERTIFICATE, …), or pass --recipe.{then}",
        file=sys.stderr,
    )
