"""`polar-mitm view` in a real headless browser (Debian's chromium and chromedriver, driven by
selenium), over a store written by a real Claude Code run and one written by a real rollout.

Checks what a researcher relies on: the trained tokens the page shows are export's mask sum, a
hovered token shows the exported logprob, a group page shows the samples' rewards and statuses,
and text the model wrote (markup included) never runs as script. Screenshots of every page go to
the test's tmp dir (printed), as artefacts.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from polar_mitm import procs
from tests.support.harness import (
    POLAR,
    FakeBackend,
    Lines,
    harness_env,
    polar_run,
    printed_url,
    require_binary,
)
from tests.support.service import served_url

pytestmark = pytest.mark.e2e

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
# The model's reply carries markup; on the page it must stay text (see view/html.py).
EVIL = "<img src=x onerror=window.__pwned=1>"


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("needs Debian's chromium and chromium-driver (scripts/install.sh installs them)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (the test extra)")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,1000",
    ):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@contextmanager
def viewer(db: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """`polar-mitm view` as a user starts it, on port 0; yields the URL it printed once listening."""
    proc = subprocess.Popen(
        [*POLAR, "view", "--db", str(db), "--listen", "127.0.0.1:0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        url = printed_url(Lines(proc.stdout).until("polar-mitm view on", timeout=30))
        yield url
    finally:
        procs.stop(proc, 10)


def shot(driver, tmp_path: Path, name: str) -> None:
    out = tmp_path / "screenshots"
    out.mkdir(exist_ok=True)
    driver.save_screenshot(str(out / f"{name}.png"))
    print(f"screenshot: {out / name}.png")


@pytest.fixture(scope="module")
def claude_store(tmp_path_factory, qwen_tokenizer_dir) -> tuple[Path, dict]:
    """A real Claude Code session (three turns: two Bash calls, then an answer carrying markup)
    and its prefix-merge row as `polar-mitm export` writes it."""
    import pyarrow.parquet as pq

    require_binary("claude")
    tmp = tmp_path_factory.mktemp("view-claude")
    script = tmp / "script.json"
    script.write_text(
        json.dumps(
            [
                {"match": "step2-done", "text": f"Finished after two commands {EVIL} ✓ 日本."},
                {"match": "step1-done", "shell": "echo step2-done"},
                {"match": "[Bb]egin", "shell": "echo step1-done"},
            ]
        )
    )
    backend = FakeBackend(qwen_tokenizer_dir, "--script", str(script))
    work, db = tmp / "work", tmp / "runs.sqlite"
    work.mkdir()
    try:
        r = polar_run(
            ["--backend", backend.url, "--tokenizer", str(qwen_tokenizer_dir), "--db", str(db), "--session", "cc-view", "--task", "t-view"],
            ["claude", "-p", "Begin the two-step check", "--allowedTools", "Bash"],
            cwd=work,
            env=harness_env(tmp / "home"),
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
    finally:
        backend.stop()
    out = tmp / "traj.parquet"
    e = subprocess.run(
        [*POLAR, "export", "--db", str(db), "--out", str(out)], capture_output=True, text=True, timeout=120
    )
    assert e.returncode == 0, e.stderr
    [row] = [r for r in pq.read_table(out).to_pylist() if r["role"] == "main"]
    return db, row


def test_sessions_list_and_trajectory_match_the_export(
    browser, claude_store, qwen_tokenizer_dir, tmp_path
) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    db, row = claude_store
    mask_sum = sum(row["loss_mask"])
    with viewer(db, "--tokenizer", str(qwen_tokenizer_dir)) as url:
        browser.get(url + "/sessions")
        shot(browser, tmp_path, "sessions")
        browser.find_element(By.LINK_TEXT, "cc-view").click()
        assert "Session cc-view" in browser.find_element(By.TAG_NAME, "h1").text
        shot(browser, tmp_path, "session")
        browser.find_element(By.LINK_TEXT, row["trajectory_id"]).click()
        assert browser.execute_script("return window.__viewReady === true")
        shot(browser, tmp_path, "trajectory")

        assert int(browser.find_element(By.ID, "trained-count").text) == mask_sum
        # Walk every page (the minimap links them): the trained spans add up to the mask sum, and
        # a hovered trained token shows the logprob export wrote for that very token.
        offset, sequence = len(row["prompt_ids"]), row["prompt_ids"] + row["response_ids"]
        pages = [a.get_attribute("href") for a in browser.find_elements(By.CSS_SELECTOR, ".minimap a.cell")]
        assert len(pages) == -(-len(sequence) // 4096)
        trained_shown = marks = 0
        for k, href in enumerate(pages):
            browser.get(href)
            trained = browser.find_elements(By.CSS_SELECTOR, "#tokens span.t.s")
            trained_shown += len(trained)
            marks += len(browser.find_elements(By.CSS_SELECTOR, "#tokens .turn-mark"))
            for span in trained[:: max(1, len(trained) // 4)]:
                ActionChains(browser).move_to_element(span).perform()
                tip = browser.find_element(By.ID, "tip")
                assert tip.is_displayed()
                at = int(tip.get_attribute("data-index"))
                assert float(tip.get_attribute("data-logprob")) == row["response_logprobs"][at - offset]
                assert int(tip.get_attribute("data-id")) == sequence[at]
                assert f"{row['response_logprobs'][at - offset]}" in tip.text
            if trained:
                shot(browser, tmp_path, f"trajectory-hover-page{k + 1}")
        assert trained_shown == mask_sum
        assert marks == row["num_turns"]

        # The reply's markup is text on the page, also inside the hover tip, and never runs.
        browser.get(pages[-1])
        text = browser.find_element(By.ID, "tokens").text
        assert EVIL in text and "✓ 日本" in text
        for span in browser.find_elements(By.CSS_SELECTOR, "#tokens span.t.s")[-30:]:
            ActionChains(browser).move_to_element(span).perform()
        assert browser.execute_script("return window.__pwned === undefined")
        assert not browser.find_elements(By.CSS_SELECTOR, "#tokens img, #tip img")

        # ...nor on the last turn's page, whose reply (the completion as recorded) holds it whole.
        browser.find_elements(By.CSS_SELECTOR, "#tokens .turn-mark")[-1].click()
        assert EVIL in browser.find_element(By.TAG_NAME, "main").text
        # Claude Code streams: the reply is shown as the Messages SSE the proxy sent for it.
        assert browser.find_element(By.ID, "reply-kind").text == "anthropic SSE stream"
        assert "event: content_block_delta" in browser.find_element(By.ID, "reply").text
        assert browser.execute_script("return window.__pwned === undefined")
        assert not browser.find_elements(By.CSS_SELECTOR, "main img")
        shot(browser, tmp_path, "turn-last")
        browser.back()
        browser.find_element(By.CSS_SELECTOR, "#tokens .turn-mark").click()
        assert browser.find_element(By.TAG_NAME, "h1").text.startswith("Turn ")
        assert "Begin the two-step check" in browser.page_source
        shot(browser, tmp_path, "turn")


def test_missing_tokenizer_and_unknown_ids_are_pages(browser, claude_store, tmp_path) -> None:
    from selenium.webdriver.common.by import By

    db, row = claude_store
    with viewer(db) as url:
        browser.get(f"{url}/trajectory/{row['trajectory_id']}")
        assert "no tokenizer: token ids are shown" in browser.page_source
        first = browser.find_elements(By.CSS_SELECTOR, "#tokens span.t.s")[0].text.strip()
        assert first == str(row["response_ids"][0])
        shot(browser, tmp_path, "no-tokenizer")
        browser.get(url + "/session/no-such-session")
        assert "no session" in browser.page_source and "cc-view" in browser.page_source
        shot(browser, tmp_path, "unknown-session")
    with viewer(db.with_name("absent.sqlite")) as url:
        browser.get(url + "/sessions")
        assert "no database at" in browser.page_source and "Traceback" not in browser.page_source
        shot(browser, tmp_path, "no-store")


def test_group_page_of_a_real_rollout(browser, backend_process, tiny_tokenizer_dir, tmp_path) -> None:
    """`polar-mitm rollout` on the local runtime: one task whose check passes (2 samples: no
    signal), one whose check fails; the pages show each sample's reward and status."""
    from selenium.webdriver.common.by import By

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "pass.toml").write_text(
        'id = "make-file"\ninstruction = "make it"\n[evaluator]\nkind = "command"\ncommand = "test -f made.txt"\n'
    )
    (tasks / "fail.toml").write_text(
        'id = "never"\ninstruction = "never"\n[evaluator]\nkind = "command"\ncommand = "test -f nothing.txt"\n'
    )
    db = tmp_path / "rollout.sqlite"
    r = subprocess.run(
        [*POLAR, "rollout", str(tasks / "pass.toml"), str(tasks / "fail.toml"), "--harness", "claude-code",
         "--runtime", "local", "--harness-cmd", "sh -c 'touch made.txt' {instruction}", "--samples", "2",
         "--backend", backend_process.url, "--tokenizer", str(tiny_tokenizer_dir), "--db", str(db)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    with viewer(db) as url:
        browser.get(url + "/rollouts")
        shot(browser, tmp_path, "rollouts")
        assert len(browser.find_elements(By.CSS_SELECTOR, "table.groups tr.nosignal")) == 2  # 1,1 and 0,0
        browser.find_elements(By.CSS_SELECTOR, "table.groups a")[0].click()
        cards = browser.find_elements(By.CSS_SELECTOR, "section.sample")
        assert len(cards) == 2
        statuses = {c.get_attribute("data-status") for c in cards}
        rewards = sorted(float(c.get_attribute("data-reward")) for c in cards)
        assert statuses == {"completed"} and rewards in ([0.0, 0.0], [1.0, 1.0])
        assert "GRPO learns nothing" in browser.page_source
        shot(browser, tmp_path, "group")
        browser.get(url + "/plots")
        assert len(browser.find_elements(By.CSS_SELECTOR, "figure.plot svg")) >= 4
        shot(browser, tmp_path, "plots")


def test_live_page_follows_a_service_rollout_without_a_reload(
    browser, backend_process, tiny_tokenizer_dir, tmp_path
) -> None:
    """`polar-mitm serve` with one local node; the live page is open before the task is
    submitted, and shows its sample go from dispatched (running) to finished, from the event
    stream alone: the page is never reloaded (a marker set in it survives)."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def wait(seconds: float) -> WebDriverWait:
        # The live page re-renders a sample's row on each event: a row found may be replaced
        # before its attributes are read, which is a retry, not a failure.
        return WebDriverWait(browser, seconds, ignored_exceptions=(StaleElementReferenceException,))

    env = {**harness_env(tmp_path / "home"), "POLAR_MITM_SERVICE_TOKEN": "view-e2e-token"}
    log = open(tmp_path / "serve.log", "w")
    serve = subprocess.Popen(
        [*POLAR, "serve", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "svc.sqlite"),
         "--backend", backend_process.url, "--tokenizer", str(tiny_tokenizer_dir),
         "--allow-local-runtime"],  # the test's tasks run on the local runtime
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        service = served_url(tmp_path / "serve.log", serve, timeout=60)
        task = tmp_path / "slow.toml"
        task.write_text(
            'id = "slow"\ninstruction = "x"\n[evaluator]\nkind = "command"\ncommand = "test -f made.txt"\n'
        )
        with viewer(tmp_path / "svc.sqlite", "--server", service, env=env) as url:
            browser.get(url + "/live")
            wait(20).until(lambda d: d.find_element(By.ID, "live-state").text == "live")
            browser.execute_script("window.__noReload = 1")
            r = subprocess.run(
                [*POLAR, "submit", str(task), "--harness", "claude-code", "--runtime", "local", "--harness-cmd",
                 "sh -c 'sleep 4; touch made.txt' h {instruction}", "--server", service],
                capture_output=True, text=True, timeout=60, env=env,
            )  # fmt: skip
            assert r.returncode == 0, r.stderr
            row = 'section.task[data-task] tr.sample[data-index="0"]'
            wait(60).until(
                lambda d: any(
                    e.get_attribute("data-state") == "dispatched"
                    for e in d.find_elements(By.CSS_SELECTOR, row)
                )
            )
            shot(browser, tmp_path, "live-running")
            wait(90).until(
                lambda d: any(
                    e.get_attribute("data-state") == "finished"
                    and e.get_attribute("data-status") == "completed"
                    for e in d.find_elements(By.CSS_SELECTOR, row)
                )
            )
            assert browser.execute_script("return window.__noReload") == 1
            assert "local-0" in browser.find_element(By.ID, "nodes").text
            shot(browser, tmp_path, "live-done")
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        try:
            serve.wait(20)
        except subprocess.TimeoutExpired:
            procs.kill_group(serve.pid)
        log.close()
