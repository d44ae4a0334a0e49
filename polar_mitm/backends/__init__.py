"""The backends: the policy's inference engines and the tokenizer, seen from the proxy.

Rendering (`render`: a conversation to prompt token ids, spliced onto the ids a turn already
has) and parsing the engine's text back into reasoning, text and tool calls (`parsers`,
`tool_parsers`) are pure functions over the tokenizer (`tokenizer`). Each engine's API is one
module of words without I/O (`sglang`, `vllm`, `vllm_generate`, on the protocol of `engine_api`);
`engine_client` is the one that speaks HTTP to them, `engines` picks the engine a conversation is
served by and watches it live, `chat_mode` lets an engine render the template itself (its
token ids still kept), and `weights` pushes a trainer's new weights into a running engine. `logprobs` says what an engine's
logprobs are of, `large_inputs` keeps huge requests from costing the other sessions, and
`tokenizer_build` makes the offline tokenizers demos and tests use.
"""
