"""`polar-mitm fake-backend`: the SGLang-compatible fake policy server on the command line."""

from __future__ import annotations

import os
import sys

import click


@click.command("fake-backend")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=30000, show_default=True)
@click.option(
    "--tokenizer",
    envvar="POLAR_MITM_TOKENIZER",
    default=None,
    help="Tokenizer directory [default: build/cache the offline Qwen tokenizer].",
)
@click.option(
    "--mode",
    type=click.Choice(["scripted", "random", "hf"]),
    default="scripted",
    show_default=True,
    help="scripted replies, a tiny seeded random model, or (hf) a real Hugging Face causal LM from --model.",
)
@click.option(
    "--model",
    "model_dir",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="--mode hf: the model directory (needs the [hf] extra: torch, transformers).",
)
@click.option(
    "--script", type=click.Path(exists=True, dir_okay=False), default=None, help="JSON list of reply rules."
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--weight-version", default="0", show_default=True)
@click.option("--token-delay", type=float, default=0.0, show_default=True, help="Seconds between tokens.")
@click.option("--first-token-delay", type=float, default=0.0, show_default=True)
@click.option("--model-path", default="polar-mitm/fake", show_default=True)
@click.option(
    "--api-key",
    envvar="POLAR_MITM_FAKE_API_KEY",
    default=None,
    help="Refuse calls without 'Authorization: Bearer KEY' (401), as SGLang's --api-key does "
    "(health endpoints exempt) [env POLAR_MITM_FAKE_API_KEY].",
)
@click.option(
    "--api",
    type=click.Choice(["sglang", "vllm"]),
    default="sglang",
    show_default=True,
    help="Whose HTTP API to speak: SGLang's native one, or vLLM's (/v1/completions with token ids).",
)
@click.option(
    "--vllm-dev-mode/--no-vllm-dev-mode",
    default=True,
    show_default=True,
    help="--api vllm: serve vLLM's development endpoints (/weight_info, /update_weight_version, /pause, "
    "/resume, /is_paused, /collective_rpc, /reset_prefix_cache), as VLLM_SERVER_DEV_MODE=1 opens them.",
)
@click.option(
    "--vllm-scale-out/--no-vllm-scale-out",
    default=True,
    show_default=True,
    help="--api vllm: serve vLLM's token-in, token-out POST /inference/v1/generate, as vLLM's "
    "--enable-scale-out opens it (off: 403 there).",
)
def fake_backend(
    host,
    port,
    tokenizer,
    mode,
    model_dir,
    script,
    seed,
    weight_version,
    token_delay,
    first_token_delay,
    model_path,
    api_key,
    api,
    vllm_dev_mode,
    vllm_scale_out,
):
    """An SGLang-compatible policy server for demos and CI (no GPU, no model).

    \b
    polar-mitm fake-backend --port 30000                  # scripted replies
    polar-mitm fake-backend --mode random --seed 7        # tiny seeded random model
    polar-mitm fake-backend --mode hf --model DIR         # a real causal LM, on CPU

    Speaks SGLang's /generate (input_ids or text, streaming, logprobs), /model_info, /health,
    /v1/models and /v1/chat/completions. The default script calls the harness's shell tool for
    "Create FILE containing WORD" and "run: CMD", then answers "Done. The command finished."
    With --mode hf it also serves SGLang's /update_weights_from_disk (with --api vllm: vLLM's
    POST /collective_rpc reload_weights).
    """
    from polar_mitm.fake import FakeBackendConfig, load_script, serve

    if tokenizer is None:
        from polar_mitm.backends.tokenizer_build import ensure_tokenizer

        tokenizer = str(ensure_tokenizer("qwen"))
    if mode == "hf" and not model_dir:
        raise click.UsageError("--mode hf needs --model DIR")
    if model_dir and model_path == "polar-mitm/fake":
        model_path = model_dir
    cfg = FakeBackendConfig(
        tokenizer_path=tokenizer,
        mode=mode,
        model_dir=model_dir,
        script=load_script(script) if script else None,
        seed=seed,
        weight_version=weight_version,
        token_delay=token_delay,
        first_token_delay=first_token_delay,
        model_path=model_path,
        api_key=api_key,
        api=api,
        vllm_dev_mode=vllm_dev_mode,
        vllm_scale_out=vllm_scale_out,
    )
    try:
        serve(cfg, host, port)
    except OSError as e:  # a busy port, an address not on this host
        why = os.strerror(e.errno).lower() if e.errno else str(e)
        click.echo(f"polar-mitm fake-backend: cannot listen on {host}:{port}: {why}", err=True)
        sys.exit(1)
