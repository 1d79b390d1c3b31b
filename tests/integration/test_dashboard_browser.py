"""The dashboard in headless Chromium against a real local swarm of three daemons.

Needs Debian's ``chromium`` and ``chromium-driver`` and the ``selenium`` package; the browser
runs with a fresh profile, no network services and no sandbox (root in CI).
"""

from __future__ import annotations

import shutil

import pytest
from swarm_harness import agreed_on, dump, free_port, tiny_llama, wait_until

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
    browser.get(status["dashboard"])
    assert browser.current_url == f"http://127.0.0.1:{port}/"  # the key left the address bar
    alive = "return [...document.querySelectorAll('tr[data-node-id][data-alive=true]')].map(r => r.dataset.nodeId)"
    wait_until(
        lambda: sorted(_js(browser, alive)) == ["a", "b", "c"], 20, "three live nodes on the page"
    )
    assert _js(browser, "return document.getElementById('leader').dataset.leader") == "a"
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
    line = "return document.querySelector('svg.loss-chart[data-job-id=\"%s\"] polyline').getAttribute('points')"
    assert len(_js(browser, line % first["job_id"]).split()) == 7
    tps = (
        "return document.querySelector('svg.tokens-per-s-chart[data-job-id=\"%s\"]').dataset.points"
    )
    assert _js(browser, tps % first["job_id"]) == "1"  # the leader keeps only the newest
    job_text = "return document.querySelector('div.job[data-job-id=\"%s\"]').innerText"
    wait_until(
        lambda: "trained" in _js(browser, job_text % first["job_id"]), 60, "the evaluation row"
    )
    text = _js(browser, job_text % first["job_id"])
    for words in ("step 7 of 7", "attempt 1", "activations", "trained"):
        assert words in text, text
    browser.save_screenshot(str(tmp_path / "dashboard.png"))  # for a person to look at

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
