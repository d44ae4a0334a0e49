"""How fast the viewer shows a 100k-token trajectory, against the time `export` takes for the same row.

Writes one synthetic agent session whose prefix-merged row holds about `--tokens` tokens (ids of
the real Qwen vocabulary, so the page shows text), exports that session to parquet (the baseline),
then starts `polar-mitm view` as a user would and opens the row's page in Debian's headless
chromium (selenium): cold (the viewer merges the session first), warm (cached), and a page turn.
"Interactive" is when our script has run (`window.__viewReady`) and a hovered token shows its tip.

Prints seconds for each, and the cold page ÷ export ratio. The issue's goal: interactive within 2 s.

    .venv/bin/python bench/bench_view.py                  # ~100k tokens
    .venv/bin/python bench/bench_view.py --tokens 200000 --turns 80
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polar_mitm.backends.tokenizer_build import ensure_tokenizer  # noqa: E402
from polar_mitm.reconstruct.export import export  # noqa: E402
from polar_mitm.reconstruct.source import Selection  # noqa: E402
from polar_mitm.store.turn import Turn  # noqa: E402
from polar_mitm.store.writer import Store  # noqa: E402

POLAR = [sys.executable, "-m", "polar_mitm"]


async def write_session(path: Path, tokens: int, turns: int, seed: int = 0) -> str:
    """One session, `turns` spliced turns growing to ~`tokens`; returns the last turn's id."""
    rng = np.random.default_rng(seed)
    reply = 300
    appended = max(1, (tokens - turns * reply) // turns)
    store = await Store.open(path)
    seq: list[int] = []
    prev = None
    try:
        await store.ensure_session("bench", task_id="bench-task", harness="claude-code")
        for t in range(turns):
            prompt = seq + rng.integers(0, 150_000, appended).tolist()
            output = rng.integers(0, 150_000, reply).tolist()
            tid = f"bench-t{t}"
            await store.insert_turn(
                Turn(
                    id=tid,
                    session_id="bench",
                    style="anthropic",
                    finish_reason="stop",
                    weight_version=f"w{t // 10}",
                    prompt_ids=prompt,
                    prompt_ref=prev,
                    prompt_ref_len=len(seq),
                    output_ids=output,
                    output_logprobs=(-rng.exponential(0.5, reply)).astype(np.float32).tolist(),
                )  # fmt: skip
            )
            seq, prev = prompt + output, tid
    finally:
        await store.close()
    return prev or ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver:
        raise SystemExit("needs Debian's chromium and chromium-driver (scripts/install.sh)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,1000",
    ):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=opts)


def open_page(driver, url: str) -> dict[str, float]:
    """Seconds from asking for the page to: the DOM being interactive, our script having run, and
    a hovered trained token showing its tip."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    t0 = time.perf_counter()
    driver.get(url)
    while not driver.execute_script("return window.__viewReady === true"):
        time.sleep(0.005)
    ready = time.perf_counter() - t0
    span = driver.find_elements(By.CSS_SELECTOR, "#tokens span.t.s")[-1]
    ActionChains(driver).move_to_element(span).perform()
    while not driver.find_element(By.ID, "tip").is_displayed():
        time.sleep(0.005)
    hovered = time.perf_counter() - t0
    timing = driver.execute_script(
        "const t = performance.timing; return [t.responseStart - t.requestStart, t.domInteractive - t.navigationStart,"
        " t.loadEventEnd - t.navigationStart]"
    )
    return {
        "server_s": timing[0] / 1000,
        "dom_interactive_s": timing[1] / 1000,
        "load_s": timing[2] / 1000,
        "ready_s": ready,
        "hover_s": hovered,
        "spans": len(driver.find_elements(By.CSS_SELECTOR, "#tokens span.t")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--keep", type=Path, default=None, help="Write the store here and keep it.")
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-view-"))
    work.mkdir(parents=True, exist_ok=True)
    db = work / "view.sqlite"
    db.unlink(missing_ok=True)
    last = asyncio.run(write_session(db, args.tokens, args.turns))
    tokenizer = ensure_tokenizer("qwen")

    t0 = time.perf_counter()
    stats = export(db, work / "row.parquet", selection=Selection(session="bench"), quiet=True)
    export_s = time.perf_counter() - t0
    print(f"row: {stats.merged_tokens:,} tokens, {stats.trained_tokens:,} trained, {stats.turns} turns")
    print(f"export of the row (parquet)      {export_s:.3f} s")

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [*POLAR, "view", "--db", str(db), "--listen", f"127.0.0.1:{port}", "--tokenizer", str(tokenizer)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    driver = None
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(url + "/health", timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        driver = browser()
        driver.get(url + "/sessions")  # the browser itself started, off the clock
        cold = open_page(driver, f"{url}/trajectory/{last}")
        warm = open_page(driver, f"{url}/trajectory/{last}")
        turned = open_page(driver, f"{url}/trajectory/{last}?page=3")
        for name, r in (
            ("cold (merges the session)", cold),
            ("warm (cached row)", warm),
            ("another page", turned),
        ):
            print(
                f"page {name:<26} server {r['server_s']:.3f} s · DOM interactive {r['dom_interactive_s']:.3f} s"
                f" · script ready {r['ready_s']:.3f} s · hover shown {r['hover_s']:.3f} s · {r['spans']} token spans"
            )
        print(f"ratio cold page (hover shown) / export: {cold['hover_s'] / export_s:.2f}x")
        print(
            f"goal: interactive within 2 s: {'met' if cold['hover_s'] <= 2.0 else 'NOT met'} ({cold['hover_s']:.2f} s)"
        )
    finally:
        if driver is not None:
            driver.quit()
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
