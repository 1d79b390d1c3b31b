"""The local API server: a 0600 unix socket answering JSON lines; refusals are replies."""

from __future__ import annotations

import asyncio
import json
import stat

import pytest

from swarmp2p.node.api import ApiError, ApiServer


async def _ask(path, payload: bytes) -> dict:
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(payload)
    await writer.drain()
    line = await reader.readline()
    writer.close()
    await writer.wait_closed()
    return json.loads(line)


def test_answers_and_refusals(tmp_path):
    path = tmp_path / "api.sock"

    async def status(req):
        return {"node_id": "a"}

    async def submit(req):
        if req.get("record") == "boom":
            raise RuntimeError("kaput")
        raise ApiError("saved on the leader only", code="not_durable")

    async def scenario():
        server = ApiServer(path, {"status": status, "submit": submit})
        await server.start()
        try:
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            assert await _ask(path, b'{"op": "status"}\n') == {
                "ok": True,
                "result": {"node_id": "a"},
            }
            refused = await _ask(path, b'{"op": "submit"}\n')
            assert refused == {
                "ok": False,
                "error": "saved on the leader only",
                "code": "not_durable",
                "kind": "failed",
            }
            internal = await _ask(path, b'{"op": "submit", "record": "boom"}\n')
            assert internal["ok"] is False and internal["kind"] == "internal"
            assert "internal error: RuntimeError: kaput" in internal["error"]
            for bad in (b"not json\n", b'{"op": "down"}\n', b"[1]\n"):
                reply = await _ask(path, bad)
                assert reply["ok"] is False and reply["error"].startswith("bad request"), bad
                assert reply["kind"] == "user" and reply["code"] == "bad_request"
        finally:
            await server.close()
        assert not path.exists()

    asyncio.run(scenario())


def test_unknown_handler_names_are_refused(tmp_path):
    async def noop(req):
        return None

    with pytest.raises(ValueError, match=r"no such local API op\(s\) \['reboot'\]"):
        ApiServer(tmp_path / "s", {"reboot": noop})
