"""The closed loop on one CPU machine: rollouts with a real harness, TRL's GRPOTrainer training on
them, the new weights in the engine, the next rollout sampled by them.

    pip install 'polar-mitm[trl]'            # torch, transformers, trl
    python examples/closed_loop.py --work /tmp/loop
    python examples/closed_loop.py --work /tmp/loop --engine sglang --engine-url URL --model DIR
    python examples/closed_loop.py --work /tmp/loop --engine vllm --engine-url URL --model DIR

What it runs, all on 127.0.0.1:
1. the engine: by default (`--engine fake-hf`) a tiny Qwen2 model over the Qwen tokenizer's
   vocabulary (`polar_mitm.fake.hf.tiny_causal_lm`), served by `polar-mitm fake-backend --mode hf`
   (real forward passes and sampling, SGLang's API), started here; with `--engine sglang|vllm` a
   real SGLang or vLLM you started at `--engine-url`, serving the model in `--model` in float32
   (vLLM with `VLLM_SERVER_DEV_MODE=1`; docs/training.md has the launch lines);
2. `polar-mitm serve --nodes 1 --allow-local-runtime` (the rollout service and one gateway node);
3. TRL's GRPOTrainer through `polar_mitm.bridges.trl`: each step rolls out one task × `--samples`
   with Claude Code (its Bash tool only, a one-line system prompt: ~900 prompt tokens), takes an
   optimizer step, saves the weights, pauses the service, has the engine load them with
   `weight_version` = the step (`WeightSync`: SGLang's `/update_weights_from_disk`, vLLM's pause,
   `reload_weights`, prefix-cache reset, `update_weight_version`, resume) and resumes (a turn
   samples at most `--max-tokens`: a step can make the tiny model's end-of-turn token rarer, and
   Claude Code asks for 32k tokens);
4. the agreement check: every trained token of each rollout, the trainer's logprob with the
   weights that sampled it against the engine's.

A real engine keeps the trained weights when the example ends (the report names the version it
served before, `initial_version`).

Each task's verifier passes for the first sample scored and fails the others, so every group
has rewards 1 and 0 and every step has a gradient. Prints a JSON report; `main()` returns it.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

POLAR = [sys.executable, "-m", "polar_mitm"]
CLAUDE = ["claude", "-p", "{instruction}", "--system-prompt", "You are a terse coding agent.",
          "--tools", "Bash", "--allowedTools", "Bash"]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, path: str = "/health", timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(url + path, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up in {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="A directory for the model, weights and logs.")
    ap.add_argument("--tokenizer", help="Tokenizer directory [default: build/cache the offline Qwen one].")
    ap.add_argument(
        "--engine",
        choices=["fake-hf", "sglang", "vllm"],
        default="fake-hf",
        help="What samples: polar-mitm's HF engine (started here), or a real SGLang or vLLM at --engine-url.",
    )
    ap.add_argument("--engine-url", help="--engine sglang|vllm: the running engine, serving --model.")
    ap.add_argument(
        "--model",
        type=Path,
        help="The weights the engine serves at the start (a Hugging Face directory) [fake-hf: a tiny "
        "Qwen2 built in --work].",
    )
    ap.add_argument("--samples", type=int, default=2, help="Samples per task (GRPO's group).")
    ap.add_argument("--steps", type=int, default=2, help="Optimizer steps (one rollout each).")
    ap.add_argument("--harness-cmd", default=json.dumps(CLAUDE), help="The harness command, as a JSON list.")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=32,
        help="Tokens per turn at most (a trained tiny model may stop less).",
    )
    a = ap.parse_args(argv)
    if a.engine != "fake-hf" and not (a.engine_url and a.model):
        ap.error(f"--engine {a.engine} needs --engine-url (the running engine) and --model (what it serves)")

    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from polar_mitm.backends.weights import EngineWeights
    from polar_mitm.bridges.trl import PolarGRPOTrainer, PolarRollout, WeightSync
    from polar_mitm.fake.hf import load_causal_lm, tiny_causal_lm
    from polar_mitm.reconstruct.agreement import check
    from polar_mitm.tasks.model import Task

    work = a.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    if a.tokenizer is None:
        from polar_mitm.backends.tokenizer_build import ensure_tokenizer

        a.tokenizer = str(ensure_tokenizer("qwen"))
    model0 = a.model.resolve() if a.model else tiny_causal_lm(a.tokenizer, work / "model-0")

    token = secrets.token_urlsafe(24)
    env = {**os.environ, "POLAR_MITM_SERVICE_TOKEN": token, "XDG_CONFIG_HOME": str(work / "config")}
    service_port = free_port()
    service_url = f"http://127.0.0.1:{service_port}"
    procs = []
    try:
        if a.engine == "fake-hf":
            engine_port = free_port()
            engine_url = f"http://127.0.0.1:{engine_port}"
            procs.append(subprocess.Popen(
                [*POLAR, "fake-backend", "--mode", "hf", "--model", str(model0), "--tokenizer", a.tokenizer,
                 "--port", str(engine_port)],
                stdout=(work / "engine.log").open("ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
            ))  # fmt: skip
            wait_http(engine_url)
        else:
            engine_url = a.engine_url.rstrip("/")
        kind = "vllm" if a.engine == "vllm" else "sglang"  # the fake speaks SGLang's API
        initial_version = EngineWeights(engine_url, kind).version()
        procs.append(subprocess.Popen(
            [*POLAR, "serve", "--listen", f"127.0.0.1:{service_port}", "--nodes", "1", "--allow-local-runtime",
             "--max-tokens-cap", str(a.max_tokens), "--backend", engine_url, "--tokenizer", a.tokenizer, "--db", str(work / "service.sqlite")],
            stdout=(work / "serve.log").open("ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
        ))  # fmt: skip
        wait_http(service_url)

        names = [f"task-{i}" for i in range(a.steps)]
        tasks = {
            n: Task(id=n, instruction=f"Say something about the number {i}.",
                    evaluator={"kind": "command", "command": f"mkdir {work / ('first-' + n)} 2>/dev/null"})
            for i, n in enumerate(names)
        }  # fmt: skip
        rollout = PolarRollout(
            service_url, token=token, harness="claude-code", runtime="local", tasks=tasks, poll=0.3, timeout=600,
            request={"harness_cmd": json.loads(a.harness_cmd), "max_staleness": 0, "stale_action": "flag"},
        )  # fmt: skip
        history: list[list[Any]] = []
        call = rollout.rollout

        def keep(prompts: Any, samples: int) -> list[Any]:
            groups = call(prompts, samples)
            history.append(groups)
            return groups

        rollout.rollout = keep  # type: ignore[method-assign]
        sync = WeightSync(engine_url, work / "weights", client=rollout.client, engine=kind, keep=0)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(str(model0), dtype=torch.float32)
        args = GRPOConfig(
            output_dir=str(work / "trl"), use_cpu=True, report_to=[], max_steps=a.steps, learning_rate=a.lr,
            per_device_train_batch_size=a.samples, num_generations=a.samples, steps_per_generation=1,
            logging_steps=1, save_strategy="no", seed=0, dataloader_num_workers=0, shuffle_dataset=False,
            bf16=False,  # train in the engine's dtype (float32 here), not TRL's default bf16 autocast
        )  # fmt: skip
        trainer = PolarGRPOTrainer(
            model=model, args=args, train_dataset=Dataset.from_dict({"prompt": names}),
            processing_class=AutoTokenizer.from_pretrained(a.tokenizer), rollout=rollout, weight_sync=sync,
        )  # fmt: skip
        trainer.train()

        def rows(groups: list[Any]) -> list[dict[str, Any]]:
            out: list[dict[str, Any]] = []
            for g in groups:
                out += pq.read_table(io.BytesIO(rollout.client.parquet(g.task_id))).to_pylist()
            return out

        def versions(groups: list[Any]) -> list[list[str]]:
            return [s.weight_versions for g in groups for s in g.samples]

        first = rows(history[0])
        agreement = check(load_causal_lm(model0), first, tolerance=1e-4)
        later = None
        if len(history) > 1 and sync.pushed:
            later = check(
                load_causal_lm(work / "weights" / f"weights-{sync.pushed[0]['version']}"), rows(history[1])
            )
        w0, w1 = load_causal_lm(model0), model
        changed = any(not torch.equal(p, q) for p, q in zip(w0.parameters(), w1.parameters(), strict=True))
        report = {
            "engine": a.engine,
            "initial_version": initial_version,
            "rollouts": len(history),
            "turn_versions": [versions(h) for h in history],
            "rewards": [[s.reward for g in h for s in g.samples] for h in history],
            "pushed": sync.pushed,
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "weights_changed": changed,
            "agreement_first_rollout": agreement.as_dict() | {"per_row": None},
            "agreement_second_rollout": later.as_dict() | {"per_row": None} if later else None,
            "trl_logp_difference_max": [
                h.get("sampling/sampling_logp_difference/max")
                for h in trainer.state.log_history
                if "loss" in h
            ],
        }
        print(json.dumps(report, indent=1, default=str))
        return report
    finally:
        for p in reversed(procs):
            stop(p)


if __name__ == "__main__":
    main()
