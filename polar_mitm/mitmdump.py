"""polar-mitm as a mitmproxy addon script, for people who already run mitmproxy:

    mitmdump -s "$(python -m polar_mitm.mitmdump)" \\
        --set polar_backend=http://127.0.0.1:30000 --set polar_tokenizer=./qwen3-tok \\
        --set polar_db=runs.sqlite

(`python -m polar_mitm.mitmdump` prints this file's path.) It loads beside the user's own addons
and options, as mitmproxy's addons do: its options are declared in `load`, checked and applied in
`configure`, and the store, the policy and the gateway start in `running` and stop in `done`.

What it changes of mitmproxy's own behaviour, and only for provider hosts: their TLS connections
are not intercepted but relayed, still encrypted, to the gateway (`next_layer`, then
`proxy/addons/handoff.py`), which answers model calls and side endpoints. Side hosts the recipes stub
(telemetry) are answered when mitmproxy intercepts them; every other host is the user's business.
Harnesses name their session in the proxy URL (`HTTPS_PROXY=http://SESSION:x@host:port`) and
trust mitmproxy's CA (its `confdir`), as with `polar-mitm proxy`.
"""

from __future__ import annotations

import logging
from typing import Any

from mitmproxy import ctx, exceptions
from mitmproxy.addonmanager import Loader
from mitmproxy.proxy import layers

from polar_mitm.proxy.addons.sessions import Sessions
from polar_mitm.proxy.addons.tlswatch import TlsWatch
from polar_mitm.proxy.embedded import PolicySide, ProxyConfig

log = logging.getLogger("polar_mitm.mitmdump")

OPTIONS = ("polar_backend", "polar_tokenizer", "polar_db", "polar_session", "polar_token", "polar_recipe")


class PolarMitm:
    """The policy proxy's addons as one mitmproxy addon (its children are in `addons`)."""

    def __init__(self) -> None:
        self.tls = TlsWatch()
        self.sessions = Sessions("default")
        self.side = PolicySide(self.sessions, self.tls, "default")
        self.handoff = self.side.handoff
        self.addons = [self.sessions, *self.side.addons, self.tls]
        self.store: Any = None

    def load(self, loader: Loader) -> None:
        loader.add_option("polar_backend", str, "", "polar-mitm: URL of the SGLang policy server (required).")
        loader.add_option(
            "polar_tokenizer", str, "", "polar-mitm: the policy's tokenizer, a directory or name."
        )
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
        self.sessions.default_session = ctx.options.polar_session
        self.sessions.token = ctx.options.polar_token
        self.handoff.default_session = ctx.options.polar_session

    async def running(self) -> None:
        from polar_mitm.cli.options import make_policy_config
        from polar_mitm.store.writer import Store

        if not ctx.options.polar_backend or not ctx.options.polar_tokenizer:
            log.error("polar-mitm: set polar_backend and polar_tokenizer (--set polar_backend=URL ...)")
            ctx.master.shutdown()
            return
        config = ProxyConfig(
            db=ctx.options.polar_db,
            default_session=ctx.options.polar_session,
            recipe=ctx.options.polar_recipe or None,
            policy=make_policy_config(
                backend_url=ctx.options.polar_backend, tokenizer=ctx.options.polar_tokenizer
            ),
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
