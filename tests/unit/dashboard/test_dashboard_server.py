"""DashboardServer over real HTTP on 127.0.0.1: the page, the JSON, the Host guard, a taken port."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket

from swarmp2p.dashboard import DashboardServer, start_dashboard

STATUS = {"node_id": "a", "leader": "a", "peers": [{"node_id": "a", "alive": True}], "jobs": []}


KEY = "k" * 43


def _get(
    port: int, path: str, host: str | None = None, key: str | None = KEY
) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.putrequest("GET", path, skip_host=host is not None)
        if host is not None:
            conn.putheader("Host", host)
        if key is not None:
            conn.putheader("Cookie", f"swarmp2p_dashboard_{port}={key}")
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


async def _serve_and(fn, **kw):
    calls = []

    def source():
        calls.append(1)
        return STATUS

    server = DashboardServer(source, port=0, clock=lambda: 42.0, key=KEY, **kw)
    await server.start()
    try:
        return await asyncio.to_thread(fn, server.port), calls, server.url
    finally:
        await server.close()


def test_page_and_state():
    def fetch(port):
        return _get(port, "/"), _get(port, "/api/state"), _get(port, "/nope")

    (page, state, missing), calls, url = asyncio.run(_serve_and(fetch))
    assert url.startswith("http://127.0.0.1:") and url.endswith(f"/?key={KEY}")
    assert page[0] == 200 and b"<title>swarmp2p</title>" in page[2]
    assert "script-src 'unsafe-inline'" in page[1]["Content-Security-Policy"]
    assert b"http://" not in page[2].replace(b"http://www.w3.org/2000/svg", b"")  # no CDN
    assert state[0] == 200 and state[1]["Content-Type"].startswith("application/json")
    body = json.loads(state[2])
    assert body["generated_at"] == 42.0 and body["nodes"][0]["node_id"] == "a"
    assert state[1]["Cache-Control"] == "no-store"
    assert missing[0] == 404
    assert len(calls) == 1  # the status is read per JSON request only


def test_foreign_host_header_is_refused():
    def fetch(port):
        return [
            _get(port, "/api/state", host=h)[0]
            for h in (f"evil.example:{port}", f"localhost:{port}", "127.0.0.1", "10.0.0.5")
        ]

    codes, calls, _ = asyncio.run(_serve_and(fetch))
    assert codes == [403, 200, 200, 403]
    assert len(calls) == 2


def test_start_dashboard_off_taken_and_bad():
    async def main():
        blocker = socket.socket()
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        try:
            taken = await start_dashboard(dict, {"SWARM_DASHBOARD_PORT": str(port)})
        finally:
            blocker.close()
        off = await start_dashboard(dict, {"SWARM_DASHBOARD_PORT": "off"})
        bad = await start_dashboard(dict, {"SWARM_DASHBOARD_PORT": "x"})
        server, note = await start_dashboard(dict, {"SWARM_DASHBOARD_PORT": "0"})
        await server.close()
        return taken, off, bad, server, note

    taken, off, bad, server, note = asyncio.run(main())
    assert taken[0] is None and "is taken" in taken[1] and "SWARM_DASHBOARD_PORT" in taken[1]
    assert off == (None, "off (SWARM_DASHBOARD_PORT=off)")
    assert bad[0] is None and "'x'" in bad[1]
    assert server.port > 0 and note == ""


def test_state_needs_the_key_the_printed_url_sets_as_a_cookie():
    def fetch(port):
        return (
            _get(port, "/api/state", key=None),
            _get(port, "/api/state", key="x" * 43),
            _get(port, "/?key=wrong", key=None),
            _get(port, f"/?key={KEY}", key=None),
            _get(port, "/", key=None),
        )

    (none, wrong, bad_url, login, page), calls, _ = asyncio.run(_serve_and(fetch))
    assert none[0] == 401 and b"swarm dashboard" in none[2]
    assert wrong[0] == 401 and bad_url[0] == 403
    assert login[0] == 303 and login[1]["Location"] == "/"
    cookie = login[1]["Set-Cookie"]
    assert cookie.startswith("swarmp2p_dashboard_") and f"={KEY};" in cookie
    for attribute in ("HttpOnly", "SameSite=Strict", "Path=/"):
        assert attribute in cookie, cookie
    assert page[0] == 200  # the page holds no data; it asks for the key when /api/state says 401
    assert calls == []  # nothing was read for a request without the key


def test_the_key_file_is_private_and_kept(tmp_path):
    import stat

    from swarmp2p.dashboard.server import dashboard_key

    path = tmp_path / "dashboard.key"
    key = dashboard_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(key) >= 43
    assert dashboard_key(path) == key
    path.chmod(0o644)  # others could read it: a new one
    assert dashboard_key(path) != key and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert dashboard_key(None) != dashboard_key(None)


def test_malformed_requests_log_one_short_line_each_at_most(caplog):
    """Junk to the dashboard's port (issue 24): a 400 each, no aiohttp traceback in the log,
    at most a few lines a second, and the page still answers after it."""
    junk = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: zz\r\n\r\n"

    def fetch(port):
        answers = []
        for _ in range(200):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
                conn.sendall(junk)
                answers.append(conn.recv(16))
        return answers, _get(port, "/api/state")[0]

    with caplog.at_level("DEBUG"):
        (answers, after), _, _ = asyncio.run(_serve_and(fetch))
    assert all(a.startswith(b"HTTP/1.0 400") for a in answers) and after == 200
    lines = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert lines and all(r.exc_info is None for r in caplog.records), caplog.text[:2000]
    assert "Traceback" not in caplog.text
    assert len(lines) < 200 / 2  # rate-limited: 5 a second, the rest counted


def test_a_one_time_link_logs_in_once_and_never_carries_the_key():
    """`swarm dashboard --open` hands the browser /?open=STAMP.MAC (its argv is public): it
    sets the key's cookie once, within dashboard_ticket_s; again, late, forged or from another key
    it is refused, and the key is in none of them."""
    from swarmp2p.dashboard.server import open_url
    from swarmp2p.timings import TIMINGS

    def fetch(port):
        url = f"http://127.0.0.1:{port}/?key={KEY}"
        link = open_url(url, now=42.0)
        path = link.split(f":{port}", 1)[1]
        late = open_url(url, now=42.0 - TIMINGS.dashboard_ticket_s - 10).split(f":{port}", 1)[1]
        other = open_url(f"http://127.0.0.1:{port}/?key={'o' * 43}", now=42.0)
        forged = path[:-4] + ("0000" if not path.endswith("0000") else "1111")
        return link, [
            _get(port, p, key=None)
            for p in (path, path, late, other.split(f":{port}", 1)[1], forged, "/?open=x.y")
        ]

    (link, answers), _, _ = asyncio.run(_serve_and(fetch))
    assert KEY not in link and "?open=42." in link
    first, *refused = answers
    assert first[0] == 303 and first[1]["Location"] == "/"
    assert f"={KEY};" in first[1]["Set-Cookie"] and "HttpOnly" in first[1]["Set-Cookie"]
    assert [r[0] for r in refused] == [403] * 5
    assert all("Set-Cookie" not in r[1] for r in refused)
    assert b"swarm dashboard --open" in refused[0][2]


def _open_in_browser(tmp_path, url: str, env: dict) -> str:
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    base.pop("BROWSER", None)
    code = "import sys; from swarmp2p.cli._ux import _open_in_browser as o; print(o(sys.argv[1]))"
    out = subprocess.run(
        [sys.executable, "-c", code, url],
        capture_output=True,
        text=True,
        env={**base, **env},
        timeout=60,
        check=True,
    )
    return out.stdout.strip()


def test_swarm_dashboard_open_gives_the_browser_a_one_time_link_or_says_why_not(tmp_path):
    """`swarm dashboard --open`: $BROWSER is started on /?open=..., the key in none of its
    arguments; with no graphical session and no $BROWSER nothing starts (not even a text
    browser in the terminal) and the reason comes back for the CLI to print with the URL."""
    import json
    import sys

    url = f"http://127.0.0.1:7738/?key={KEY}"
    argv_file = tmp_path / "argv.json"
    fake = tmp_path / "browser"
    fake.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"open({str(argv_file)!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
    )
    fake.chmod(0o700)
    assert _open_in_browser(tmp_path, url, {"BROWSER": str(fake)}) == "None"
    (link,) = json.loads(argv_file.read_text())
    assert link.startswith("http://127.0.0.1:7738/?open=") and KEY not in link
    argv_file.unlink()
    why = _open_in_browser(tmp_path, url, {})
    assert "no graphical session" in why and not argv_file.exists()
