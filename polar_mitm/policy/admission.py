"""Whether a prompt fits the policy's context, and how many tokens its reply may take: the one
room for "the prompt is longer than the context" and for `max_tokens`.

A prompt is refused as soon as its length is proven, each time in the same words (`too_long`):
from the request body's JSON alone, before a style parses it (`Admission.body`: a 70,000-message
body would cost seconds of parsing and rendering first); from its messages' text, before
anything is tokenized (`Admission.text`); from its rendered ids (`Admission.budget`, which also
fits the reply into what is left of the context). The first two are lower bounds
(`backends/large_inputs.py`), so they refuse only what cannot fit. All three apply in render
mode only: in chat mode the engine renders the prompt and refuses it itself.
"""

from __future__ import annotations

import asyncio

from polar_mitm.backends import large_inputs
from polar_mitm.neutral import ChatRequest, ProviderError
from polar_mitm.once import Flights
from polar_mitm.policy.config import PolicyConfig
from polar_mitm.policy.discovery import Discovery


def too_long(tokens: int, context: int, bound: str | None = None) -> ProviderError:
    """The harness's error for a prompt of `tokens` tokens in a `context`-token policy; with
    `bound`, the tokens are a lower bound, and `bound` says what proves it."""
    if bound is None:
        return ProviderError(
            "invalid_request",
            f"prompt is too long: {tokens} tokens > {context - 1} maximum of the policy",
            400,
        )
    return ProviderError(
        "invalid_request",
        f"prompt is too long: at least {tokens} tokens > {context - 1} maximum of the policy "
        f"({bound}); shorten the conversation",
        400,
    )


class Admission:
    """The policy's context checks and its one `max_tokens` rule."""

    def __init__(self, config: PolicyConfig, discovery: Discovery):
        self.config = config
        self.discovery = discovery
        self._bounds: Flights[None, tuple[int, bool]] = Flights()  # see _read_bounds

    def max_tokens(
        self, req: ChatRequest, prompt_tokens: int | None = None, context: int | None = None
    ) -> int:
        """The tokens a reply may take: what the harness asked for (else `default_max_tokens`),
        at most `max_tokens_cap`, and, with the prompt's length and the context known, at most
        what the context leaves (harnesses ask for their provider's limits: Claude Code 32k-64k)."""
        max_tokens = req.sampling.max_tokens or self.config.default_max_tokens
        if self.config.max_tokens_cap and max_tokens > self.config.max_tokens_cap:
            max_tokens = self.config.max_tokens_cap
        if context and prompt_tokens is not None:
            max_tokens = min(max_tokens, context - prompt_tokens)
        return max_tokens

    async def budget(self, req: ChatRequest, prompt_tokens: int) -> int:
        """The reply's `max_tokens` for a rendered prompt of `prompt_tokens` ids; raises
        `too_long` when the prompt leaves no room in the context."""
        context = await self.discovery.context_length()
        if context and prompt_tokens >= context:
            raise too_long(prompt_tokens, context)
        return self.max_tokens(req, prompt_tokens, context)

    async def text(self, req: ChatRequest) -> None:
        """Refuse, before anything is tokenized, a prompt whose text alone proves it longer than
        the context (`budget` would refuse it only after tokenizing it)."""
        if self.config.backend_mode != "render":
            return
        context = await self.discovery.context_length()
        if not context or large_inputs.rendered_text_bytes(req.messages) < context:
            return  # cheap: fewer bytes than the context cannot be more tokens
        longest, _ = await self._bounds.get(None, self._read_bounds)
        tokens, size = large_inputs.prompt_tokens_at_least(req.messages, longest)
        if tokens >= context:
            raise too_long(
                tokens,
                context,
                f"{size} bytes of message text, and no token of its tokenizer stands for more than {longest}",
            )

    async def body(self, raw: bytes) -> None:
        """Refuse, from the body's JSON alone (before a style reads it and anything is rendered),
        a request whose user messages prove it longer than the context."""
        if self.config.backend_mode != "render":
            return
        context = await self.discovery.context_length()
        # Each message counted takes ~30 bytes of JSON for at most ~2 tokens of the bound, so a
        # body with fewer bytes than the context cannot be refused here.
        if not context or len(raw) < context:
            self._bounds.start(None, self._read_bounds)  # now, rather than when a huge body comes
            return
        longest, delimited = await self._bounds.get(None, self._read_bounds)
        tokens, count, size = large_inputs.body_tokens_at_least(raw, longest, delimited)
        if tokens >= context:
            each = "at least one token each and " if delimited else ""
            raise too_long(
                tokens,
                context,
                f"{count} user messages of {size} bytes of text: {each}no token of its tokenizer "
                f"stands for more than {longest} bytes",
            )

    async def _read_bounds(self) -> tuple[int, bool]:
        """(the longest token's bytes, whether user messages are delimited) of the policy's
        tokenizer (~1 s of work, in a thread, once: single-flight, again after a failure)."""
        tok = await self.discovery.tokenizer()
        longest = await asyncio.to_thread(large_inputs.longest_token_bytes, tok)
        return longest, await asyncio.to_thread(large_inputs.users_delimited, tok)
