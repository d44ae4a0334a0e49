"""Claude Code through the Claude Agent SDK for Python, as a user's script would drive it: one
task with the Bash tool, every text block and the result printed. Run under the SDK's own
virtualenv (scripts/install.sh), by tests/e2e/test_claude_agent_sdk.py."""

import sys

import anyio
from claude_agent_sdk import AssistantMessage, ClaudeAgentOptions, ResultMessage, TextBlock, query


async def main(prompt: str) -> None:
    # acceptEdits: root may not bypass permissions; Bash is allowed by name.
    opts = ClaudeAgentOptions(allowed_tools=["Bash"], permission_mode="acceptEdits")
    async for m in query(prompt=prompt, options=opts):
        if isinstance(m, AssistantMessage):
            for b in m.content:
                if isinstance(b, TextBlock):
                    print("assistant:", b.text)
        elif isinstance(m, ResultMessage):
            print("result:", m.subtype, m.result)


anyio.run(main, sys.argv[1])
