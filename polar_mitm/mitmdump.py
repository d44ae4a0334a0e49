"""polar-mitm as a mitmproxy addon script, for people who already run mitmproxy:

    mitmdump -s "$(python -m polar_mitm.mitmdump)" \\
        --set polar_backend=http://127.0.0.1:30000 --set polar_tokenizer=./qwen3-tok \\
        --set polar_db=runs.sqlite --set polar_idle_timeout=300

(`python -m polar_mitm.mitmdump` prints this file's path.) It loads beside the user's own addons
and options, as mitmproxy's addons do: its options are declared in `load`, checked and applied in
`configure`, and the store, the policy and the gateway start in `running` and stop in `done`.
Every `PolicyConfig` field is an option (`polar_` and the name of its `polar-mitm run` flag:
`polar_backend`, `polar_tool_parser`, `polar_idle_timeout` …), made from the field as the
command line's flags are (`cli/options.py`), with the flag's help; numbers with a fraction are
written as text (mitmproxy's `--set` reads no float), an option left unset takes the flag's
environment variable where it has one (POLAR_MITM_BACKEND_API_KEY …), and the field checks every
value.

What it changes of mitmproxy's own behaviour, and only for provider hosts: their TLS connections
are not intercepted but relayed, still encrypted, to the gateway (`next_layer`, then
`proxy/addons/handoff.py`), which answers model calls and side endpoints. Side hosts the recipes stub
(telemetry) are answered when mitmproxy intercepts them; every other host is the user's business.
Harnesses name their session in the proxy URL (`HTTPS_PROXY=http://SESSION:x@host:port`) and
trust mitmproxy's CA (its `confdir`), as with `polar-mitm proxy`.
"""

from __future__ import annotations

import logging
import os
import types
import typing
from typing import Any

import pydantic
from mitmproxy import ctx, exceptions
from mitmproxy.addonmanager import Loader
from mitmproxy.proxy import layers

from polar_mitm.backends.parsers import check_reasoning_parser, check_tool_parser
from polar_mitm.cli.options import FLAGS, Flag
from polar_mitm.policy.config import PolicyConfig
from polar_mitm.proxy.addons.sessions import Sessions
from polar_mitm.proxy.addons.tlswatch import TlsWatch
from polar_mitm.proxy.embedded import PolicySide, ProxyConfig

log = logging.getLogger("polar_mitm.mitmdump")

# The policy's fields without a default here: the user names the policy's engine and tokenizer.
REQUIRED = ("backend_url", "tokenizer")
# Fields whose values are names we implement (checked at start-up, as the command line does).
CHECKS = {"tool_parser": check_tool_parser, "reasoning_parser": check_reasoning_parser}


def option_name(field: str) -> str:
    """A PolicyConfig field's option: `polar_` and its flag's name (`backend_url`: polar_backend)."""
    flag = FLAGS.get(field)
    name = flag.name.lstrip("-").replace("-", "_") if flag is not None and flag.name else field
    return "polar_" + name


# PolicyConfig field -> its option.
POLICY_OPTIONS = {field: option_name(field) for field in PolicyConfig.model_fields}
OPTIONS = (*POLICY_OPTIONS.values(), "polar_db", "polar_session", "polar_token", "polar_recipe")


def _typespec(field: str, annotation: Any) -> tuple[Any, list[str] | None]:
    """(mitmproxy's type for a field's option, its choices): a float is text (`--set` reads no
    float; the field reads the text), a Literal a str of its words, `X | None` optional."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return str, [str(a) for a in typing.get_args(annotation)]
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        inner, choices = _typespec(field, args[0])
        return typing.Optional[inner], choices  # noqa: UP045 (mitmproxy compares with Optional)
    if annotation is float:
        return str, None
    if annotation in (str, int, bool):
        return annotation, None
    raise TypeError(f"{field}: no mitmproxy option type for {annotation!r}; declare one in mitmdump.py")


def add_policy_options(loader: Loader) -> None:
    """Every PolicyConfig field as an option, typed and defaulted by the field, helped by its flag."""
    for field, info in PolicyConfig.model_fields.items():
        typespec, choices = _typespec(field, info.annotation)
        default = info.default
        if field in REQUIRED:
            default = "" if typespec is str else None
        elif isinstance(default, float):
            default = f"{default:g}"
        flag = FLAGS.get(field, Flag(field.replace("_", " ").capitalize() + "."))
        required = " (required)" if field in REQUIRED else ""
        several = " (several: separated by commas)" if flag.multiple else ""
        env = f" [unset: env {flag.envvar}]" if flag.envvar else ""
        loader.add_option(
            POLICY_OPTIONS[field],
            typespec,
            default,
            f"polar-mitm{required}: {flag.help}{several}{env}",
            choices,
        )


def _value(options: Any, field: str) -> Any:
    """A field's option as set, else its flag's environment variable (as the command line reads
    it), else None."""
    value = getattr(options, POLICY_OPTIONS[field])
    flag = FLAGS.get(field)
    if value in (None, "") and flag is not None and flag.envvar:
        value = os.environ.get(flag.envvar)
    return None if value in (None, "") else value


def policy_config(options: Any) -> PolicyConfig:
    """The PolicyConfig of the policy options set (or their environment variables; neither: the
    field's default); raises
    OptionsError naming the option of a value its field refuses."""
    values = {f: v for f in POLICY_OPTIONS if (v := _value(options, f)) is not None}
    for field, check in CHECKS.items():
        try:
            if field in values:
                check(values[field])
        except ValueError as e:
            raise exceptions.OptionsError(f"polar-mitm: {POLICY_OPTIONS[field]}: {e}") from None
    try:
        return PolicyConfig(**values)
    except pydantic.ValidationError as e:
        said = "; ".join(f"{POLICY_OPTIONS[str(err['loc'][0])]}: {err['msg']}" for err in e.errors())
        raise exceptions.OptionsError(f"polar-mitm: {said}") from None


class PolarMitm:
    """The policy proxy's addons as one mitmproxy addon (its children are in `addons`)."""

    def __init__(self) -> None:
        self.tls = TlsWatch()
        self.sessions = Sessions("default")
        self.side = PolicySide(self.sessions, self.tls, "default")
        self.handoff = self.side.handoff
        self.addons = [self.sessions, *self.side.addons, self.tls]
        self.store: Any = None
        self.policy: PolicyConfig | None = None  # as the options say, once `configure` checked them

    def load(self, loader: Loader) -> None:
        add_policy_options(loader)
        loader.add_option("polar_db", str, "polar-mitm.sqlite", "polar-mitm: the SQLite store turns go to.")
        loader.add_option(
            "polar_session", str, "default", "polar-mitm: session of clients whose proxy URL names none."
        )
        loader.add_option(
            "polar_token",
            str | None,  # type: ignore[arg-type]
            None,
            "polar-mitm: require this token as the proxy password (HTTPS_PROXY=http://SESSION:TOKEN@…).",
        )
        loader.add_option("polar_recipe", str, "", "polar-mitm: tag side calls by this recipe only.")

    def configure(self, updated: set[str]) -> None:
        if not updated & set(OPTIONS):
            return
        if self.side.gateway is not None:
            raise exceptions.OptionsError(
                "polar-mitm: its options are read at start; restart mitmdump to change them"
            )
        if ctx.options.polar_recipe:
            from polar_mitm import recipes

            try:
                recipes.get(ctx.options.polar_recipe)
            except (KeyError, ValueError) as e:
                raise exceptions.OptionsError(f"polar_recipe: {e}") from None
        self.policy = policy_config(ctx.options)
        self.sessions.default_session = ctx.options.polar_session
        self.sessions.token = ctx.options.polar_token
        self.handoff.default_session = ctx.options.polar_session

    async def running(self) -> None:
        from polar_mitm.store.writer import Store

        if any(_value(ctx.options, f) is None for f in REQUIRED):
            log.error("polar-mitm: set polar_backend and polar_tokenizer (--set polar_backend=URL ...)")
            ctx.master.shutdown()
            return
        config = ProxyConfig(
            db=ctx.options.polar_db,
            default_session=ctx.options.polar_session,
            recipe=ctx.options.polar_recipe or None,
            policy=self.policy or policy_config(ctx.options),
        )
        self.store = await Store.open(config.db)
        await self.side.start(config, self.store, ctx.options.confdir)
        log.info("polar-mitm: model calls go to %s; turns to %s", config.policy.backend_url, config.db)

    def next_layer(self, nextlayer: Any) -> None:
        # A tunnel to a provider host is relayed as it is, not intercepted: the gateway terminates
        # its TLS. (mitmproxy's own choice comes after ours and keeps a layer already chosen.)
        if nextlayer.layer is not None or not self.handoff.gateway_port:
            return
        if self.handoff.provider_host(nextlayer.context.server) is not None:
            nextlayer.layer = layers.TCPLayer(nextlayer.context, ignore=True)

    async def done(self) -> None:
        await self.side.stop()
        if self.store is not None:
            await self.store.close()


addons = [PolarMitm()]


if __name__ == "__main__":
    print(__file__)
