"""The local API server: a 0600 unix socket answering JSON lines; refusals are replies."""

from __future__ import annotations

import asyncio
import json
import stat

import pytest

from swarmp2p.node.api import API_OPS, ApiError, ApiServer


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

    async def serve(req):
        if req.request.get("record") == "boom":
            raise RuntimeError("kaput")
        raise ApiError("saved on the leader only", code="not_durable")

    async def scenario():
        server = ApiServer(path, {"status": status, "serve": serve})
        await server.start()
        try:
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            assert await _ask(path, b'{"op": "status"}\n') == {
                "ok": True,
                "result": {"node_id": "a"},
            }
            refused = await _ask(path, b'{"op": "serve", "request": {}}\n')
            assert refused == {
                "ok": False,
                "error": "saved on the leader only",
                "code": "not_durable",
                "kind": "failed",
            }
            internal = await _ask(path, b'{"op": "serve", "request": {"record": "boom"}}\n')
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


def test_typed_requests_reach_their_handler_as_records_and_bad_fields_are_named(tmp_path):
    from swarmp2p.node import requests as rq
    from swarmp2p.node.api import request, send
    from swarmp2p.schema import SchemaError

    path = tmp_path / "api.sock"
    seen = []

    async def logs(req):
        seen.append(req)
        return {"stage": req.stage}

    async def invite(req):
        return {"seconds": req.minutes * 60}

    async def scenario():
        server = ApiServer(
            path, {"logs": logs, "invite": invite, "serve_stop": logs, "serve": logs}
        )
        await server.start()
        try:
            ok = await _ask(path, b'{"op": "logs", "job_id": "j1", "stage": 2}\n')
            assert ok == {"ok": True, "result": {"stage": 2}}
            assert seen == [rq.LogsRequest(job_id="j1", stage=2)]
            assert (await _ask(path, b'{"op": "invite", "minutes": 2}\n'))["result"] == {
                "seconds": 120.0
            }
            for line, named in (
                (b'{"op": "logs", "job_id": "j1", "stage": -1}', "stage: must be an integer >= 0"),
                (b'{"op": "logs", "stage": 1}', "job_id: required"),
                (b'{"op": "logs", "job_id": "", "stage": 1}', "job_id: must be a non-empty"),
                (b'{"op": "logs", "job_id": "j", "stages": 1}', "stages: unknown key"),
                (b'{"op": "invite", "minutes": 9999}', "minutes: must be a number > 0 and <= 1440"),
                (b'{"op": "invite", "minutes": true}', "minutes: must be a number"),
                (b'{"op": "serve_stop"}', "model: required"),
                (b'{"op": "serve_stop", "model": ""}', "model: must be a non-empty"),
                (b'{"op": "serve", "model": "m"}', "model: unknown key"),
                (b'{"op": "serve", "request": "m"}', "request: must be"),
            ):
                reply = await _ask(path, line + b"\n")
                assert reply["ok"] is False and reply["code"] == "bad_field", line
                assert reply["error"].startswith("bad request '") and named in reply["error"], reply
            assert len(seen) == 1  # no bad request reached the handler
        finally:
            await server.close()

    asyncio.run(scenario())
    with pytest.raises(SchemaError, match="stage: must be an integer >= 0, got -3"):
        request(path, "logs", job_id="j1", stage=-3)  # the client checks before it sends
    assert rq.LogsRequest(job_id="j1").OP == "logs" and set(rq.REQUESTS) == set(API_OPS)
    with pytest.raises(Exception, match="no swarm daemon is running"):
        send(path, rq.StatusRequest())
