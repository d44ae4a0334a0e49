"""How often one rollout sample crosses the pipeline's edges: calls into rollout/pipeline.py from
other modules (coroutines counted when entered, not each time they resume), and calls out of it
into the proxy, the port and the store. One sample of a shell 'harness' on the local runtime,
against the fake engine.

    .venv/bin/python bench/bench_pipeline_seam.py     # about 15 s
"""

from __future__ import annotations

import asyncio
import collections
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import polar_mitm.rollout.pipeline as pipeline  # noqa: E402
from polar_mitm.backends.tokenizer_build import ensure_tokenizer  # noqa: E402
from polar_mitm.fake import FakeBackendConfig, start_fake_backend  # noqa: E402
from polar_mitm.policy import PolicyConfig  # noqa: E402
from polar_mitm.proxy.embedded import PolarProxy, ProxyConfig  # noqa: E402
from polar_mitm.rollout.options import RolloutOptions  # noqa: E402
from polar_mitm.sandbox.tempdir import TempdirRuntime  # noqa: E402
from polar_mitm.tasks.model import EvaluatorSpec, Task  # noqa: E402

COROUTINE = 0x80 | 0x200  # CO_COROUTINE | CO_ASYNC_GENERATOR
OUT_OF = (
    "proxy/embedded.py",
    "addons/egress.py",
    "addons/sessions.py",
    "store/writer.py",
    "store/rollouts.py",
)


async def main() -> None:
    tok = ensure_tokenizer("qwen")
    tmp = Path(tempfile.mkdtemp())
    runner, url = await start_fake_backend(FakeBackendConfig(tokenizer_path=str(tok)))
    policy = PolicyConfig(backend_url=url, tokenizer=str(tok))
    proxy = PolarProxy(ProxyConfig(db=str(tmp / "r.sqlite"), certs_dir=tmp / "certs", policy=policy))
    await proxy.start()
    task = Task(id="t", instruction="hi", evaluator=EvaluatorSpec(kind="command", command="true"))
    opts = RolloutOptions(harness="claude-code", harness_cmd=["sh", "-c", "true", "h", "{instruction}"])
    into: collections.Counter[str] = collections.Counter()
    out: collections.Counter[str] = collections.Counter()
    seen: dict[int, object] = {}
    here = pipeline.__file__

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event != "call":
            return
        code = frame.f_code
        if code.co_flags & COROUTINE:
            if id(frame) in seen:
                return  # resumed, not entered
            seen[id(frame)] = frame
        caller = frame.f_back.f_code.co_filename if frame.f_back else ""
        if code.co_filename == here and caller != here:
            into[code.co_name] += 1
        if caller == here and (code.co_filename.endswith(OUT_OF) or "rollout/port.py" in code.co_filename):
            out["/".join(code.co_filename.rsplit("/", 2)[-2:]) + ":" + code.co_name] += 1

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        p = pipeline.Pipeline(opts, proxy, TempdirRuntime(), work_dir=tmp / "w")
        result = await p.run([task])
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    assert [s.status for s in result.samples] == ["completed"]
    print(f"calls into pipeline.py: {sum(into.values())}", dict(into))
    print(f"calls out of it into the proxy, port and store: {sum(out.values())}", dict(out))
    await proxy.stop()
    await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
