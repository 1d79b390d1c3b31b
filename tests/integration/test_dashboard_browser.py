"""The dashboard in headless Chromium against a real local swarm of three daemons.

Needs Debian's ``chromium`` and ``chromium-driver`` and the ``selenium`` package; the browser
runs with a fresh profile, no network services and no sandbox (root in CI).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading

import pytest
from swarm_harness import ROOT, agreed_on, dump, free_port, swarm, swarm_env, tiny_llama, wait_until
from test_swarm_serve_loopback import tiny_llama_with_tokenizer

from swarmp2p.net.security import SwarmSecret

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,1400",
)

pytestmark = pytest.mark.slow
TOKEN = SwarmSecret.generate().token


@pytest.fixture
def browser(tmp_path):
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not shutil.which(p)]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("selenium")
    if missing:
        pytest.fail(
            f"the dashboard browser test needs {missing}: `apt-get install -y chromium "
            "chromium-driver` and `pip install selenium`",
            pytrace=False,
        )
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def _js(driver, script: str):
    return driver.execute_script(script)


def _dashboard_open(node, tmp_path, browser_env: bool):
    """`swarm dashboard --open` on ``node``, no graphical session; with ``browser_env`` a
    $BROWSER that only writes down the command line it was started with."""
    env = swarm_env()
    for name in ("DISPLAY", "WAYLAND_DISPLAY", "BROWSER"):
        env.pop(name, None)
    argv_file = tmp_path / "browser-argv.json"
    if browser_env:
        fake = tmp_path / "fake-browser"
        fake.write_text(
            f"#!{sys.executable}\nimport json, sys\n"
            f"open({str(argv_file)!r}, 'w').write(json.dumps(sys.argv))\n"
        )
        fake.chmod(0o700)
        env["BROWSER"] = str(fake)
    out = subprocess.run(
        [sys.executable, "-m", "swarmp2p", "dashboard", "--open"],
        capture_output=True,
        text=True,
        env={**env, "SWARM_STATE_DIR": str(node.state.root)},
        cwd=ROOT,
        timeout=60,
    )
    argv = json.loads(argv_file.read_text()) if browser_env else None
    return out, argv


def test_dashboard_lists_nodes_and_draws_job_curves(loopback_swarm, browser, tmp_path):
    loopback_swarm.reserve("a", "b", "c")
    port = free_port()
    nodes = [
        loopback_swarm.node("a", token=TOKEN, env={"SWARM_DASHBOARD_PORT": str(port)}).start(),
        loopback_swarm.node("b", token=TOKEN, env={"SWARM_DASHBOARD_PORT": "off"}).start(),
        loopback_swarm.node("c", token=TOKEN, env={"SWARM_DASHBOARD_PORT": "off"}).start(),
    ]
    for node in nodes:
        node.wait_up()
    wait_until(lambda: agreed_on(nodes, "a", 3), 30, "three nodes agreeing on leader a")
    status = nodes[0].status()
    assert status["dashboard"].startswith(f"http://127.0.0.1:{port}/?key="), dump(nodes)
    assert nodes[1].status()["dashboard"] is None
    assert "off" in nodes[1].status()["dashboard_note"]

    browser.get(f"http://127.0.0.1:{port}/")  # without the key: the page asks for it
    wait_until(
        lambda: (
            "swarm dashboard" in _js(browser, "return document.getElementById('error').textContent")
        ),
        20,
        "the page to ask for its key",
    )
    key = status["dashboard"].split("?key=", 1)[1]

    # `swarm dashboard --open` where no browser can start: it says so and prints the URL
    out, _ = _dashboard_open(nodes[0], tmp_path, browser_env=False)
    assert out.returncode == 0 and out.stdout.strip() == status["dashboard"], out
    assert "no browser opened: no graphical session" in out.stderr
    # with a browser: its command line holds a one-time link, never the key
    out, argv = _dashboard_open(nodes[0], tmp_path, browser_env=True)
    assert out.returncode == 0 and "opened the dashboard" in out.stdout, out
    assert key not in out.stdout + out.stderr + " ".join(argv)
    (link,) = [a for a in argv if a.startswith(f"http://127.0.0.1:{port}/?open=")]
    browser.get(link)  # the one-time link logs this browser in, and leaves the address bar
    assert browser.current_url == f"http://127.0.0.1:{port}/"
    alive = "return [...document.querySelectorAll('tr[data-node-id][data-alive=true]')].map(r => r.dataset.nodeId)"
    wait_until(
        lambda: sorted(_js(browser, alive)) == ["a", "b", "c"], 20, "three live nodes on the page"
    )
    assert _js(browser, "return document.getElementById('leader').dataset.leader") == "a"
    browser.get(link)  # used once: refused, with what to do
    assert "swarm dashboard --open" in _js(browser, "return document.body.innerText")
    browser.get(status["dashboard"])  # the printed URL logs in too
    assert browser.current_url == f"http://127.0.0.1:{port}/"  # the key left the address bar
    browser.get(f"http://127.0.0.1:{port}/?interval=250")  # poll faster (the cookie holds)
    wait_until(lambda: sorted(_js(browser, alive)) == ["a", "b", "c"], 20, "the page again")
    bars = _js(browser, "return document.querySelectorAll('tr[data-node-id] .dev .bar').length")
    assert bars >= 3  # at least the CPU of every node, each with a memory bar

    model = tiny_llama(tmp_path / "tiny-llama", layers=3)
    job = {
        "name": "lora-run",
        "model": {"pretrained": str(model), "lora": {"enabled": True, "r": 4}},
        "data": {"source": "random"},
        "split": {"stages": 3, "mode": "equal"},
        "train": {
            "steps": 7,
            "batch_size": 2,
            "seq_len": 8,
            "micro_batches": 1,
            "eval_batches": 1,
            "checkpoint_every": 0,
        },
    }
    first = nodes[1].submit(job)  # a real job: the page reads the leader's metrics
    chart = "return (document.querySelector('svg.loss-chart[data-job-id=\"%s\"]') || {}).dataset"
    wait_until(
        lambda: (_js(browser, chart % first["job_id"]) or {}).get("points") == "7",
        120,
        "the job's loss curve with 7 points",
    )
    stages = "return [...document.querySelectorAll('svg.plan-chart[data-job-id=\"%s\"] rect')].map(r => r.dataset.nodeId)"
    assert _js(browser, stages % first["job_id"]) == ["a", "b", "c"]
    names = stages.replace("dataset.nodeId", "dataset.node")
    assert _js(browser, names % first["job_id"]) == ["host-a", "host-b", "host-c"]
    line = "return document.querySelector('svg.loss-chart[data-job-id=\"%s\"] polyline').getAttribute('points')"
    assert len(_js(browser, line % first["job_id"]).split()) == 7
    # both curves: a line over steps 1..7, the numbers "step 7 of 7" counts (not 0..6)
    for chart_class in ("loss-chart", "tokens-per-s-chart"):
        found = "const s = document.querySelector('svg.%s[data-job-id=\"%s\"]'); return [s.dataset.points, s.dataset.firstStep, s.dataset.lastStep, s.querySelector('.x-first').textContent, s.querySelector('.x-last').textContent, s.querySelector('polyline').getAttribute('points').split(' ').length]"
        got = _js(browser, found % (chart_class, first["job_id"]))
        assert got == ["7", "1", "7", "step 1", "step 7", 7], (chart_class, got)
    job_text = "return document.querySelector('div.job[data-job-id=\"%s\"]').innerText"
    wait_until(
        lambda: "trained" in _js(browser, job_text % first["job_id"]), 60, "the evaluation row"
    )
    text = _js(browser, job_text % first["job_id"])
    for words in ("step 7 of 7", "attempt 1", "activations", "trained"):
        assert words in text, text
    browser.save_screenshot(str(tmp_path / "dashboard.png"))  # for a person to look at

    _served_model_shows_names_and_live_sessions(nodes, browser, tmp_path)

    # a node goes away: the page says so
    nodes[2].stop()
    dead = "return [...document.querySelectorAll('tr[data-node-id]')].filter(r => r.dataset.alive === 'true').length"
    wait_until(lambda: _js(browser, dead) == 2, 20, "the page to show node c gone")

    # the daemon behind the page stops: the page says so instead of showing stale data
    nodes[0].stop()
    banner = "const e = document.getElementById('error'); return e.style.display === 'block' && e.textContent"
    assert "cannot reach this node's daemon" in wait_until(
        lambda: _js(browser, banner), 20, "the page to report its daemon gone"
    )


def _served_model_shows_names_and_live_sessions(nodes, browser, tmp_path):
    """A model served across a, b and c from a: its stages say host-a, host-b, host-c (as the
    job's plan does), and while three requests run through one session slot the page shows 1/1
    active and the rest queued, then 0 and 0 once they are done."""
    from swarmp2p.serve.client import stream_text

    tiny = tiny_llama_with_tokenizer(tmp_path / "tiny-served")
    args = ["serve", str(tiny), "--name", "tiny", "--stages", "3", "--port", str(free_port())]
    done = swarm(nodes[0], *args, "--max-sessions", "1", "--max-context", "512", "--json")
    assert done.returncode == 0, done.stderr + dump(nodes)
    url = json.loads(done.stdout)["url"]
    served = "return [...document.querySelectorAll('div.served[data-model=tiny] svg.plan-chart rect')].map(r => r.dataset.node)"
    wait_until(lambda: _js(browser, served) == ["host-a", "host-b", "host-c"], 20, "host names")
    sessions = "const e = document.querySelector('div.served[data-model=tiny] .sessions'); return e ? [e.dataset.active, e.dataset.max, e.dataset.queued, e.textContent] : []"
    wait_until(lambda: _js(browser, sessions)[:3] == ["0", "1", "0"], 20, "idle sessions")

    # 400 tokens each, EOS (id 2) barred: each holds the one slot for a while
    body = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 400}
    body |= {"temperature": 0, "logit_bias": {"2": -100}}
    texts: list[str] = []
    threads = [
        threading.Thread(
            target=lambda: texts.append("".join(stream_text(url, "/v1/completions", body)))
        )
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    busy = wait_until(
        lambda: (got := _js(browser, sessions))[:2] == ["1", "1"] and int(got[2]) >= 1 and got,
        60,
        "the page to show one running session and the others queued",
    )
    assert "sessions 1/1 active" in busy[3] and "queued" in busy[3], busy
    browser.save_screenshot(str(tmp_path / "dashboard-serving.png"))
    for thread in threads:
        thread.join(300)
    assert len(texts) == 3 and all(texts), texts
    wait_until(lambda: _js(browser, sessions)[:3] == ["0", "1", "0"], 20, "the sessions done")
    # speculation (on by default: "auto") and the prefix cache (each prompt looked up)
    decoding = (
        "const m = document.querySelector('div.served[data-model=tiny]');"
        "const s = m && m.querySelector('.speculation'), p = m && m.querySelector('.prefix-cache');"
        "return s && p ? [s.dataset.mode, +s.dataset.laps, +p.dataset.lookups, +p.dataset.capacity,"
        " m.querySelector('.decoding').textContent] : []"
    )
    mode, laps, lookups, capacity, text = wait_until(  # lookups >= 3: each prompt
        lambda: (got := _js(browser, decoding)) and got[2] >= 3 and got, 20, "decoding stats"
    )
    assert mode == "auto" and laps >= 3 * 399 // 11 and capacity > 0, (mode, laps, lookups)
    assert "speculation auto" in text and "prefix cache" in text and "prompts reused" in text
    stop = swarm(nodes[0], "serve", "--stop", "tiny")
    assert stop.returncode == 0, stop.stderr
