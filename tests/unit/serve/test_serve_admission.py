"""Admission and the API's life cycle over a ring that never answers (in-process links, no
stages): the batch bound, the bounded queue, 503 with Retry-After, slots freed by every ending,
a non-blocking client, and a server that closes at once."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from swarmp2p.net import InProcLink
from swarmp2p.serve import (
    ApiServer,
    GenerationError,
    RingBusy,
    RingClient,
    ServedModel,
    TextCodec,
    build_app,
    decode_message,
)

PROMPT = [5, 6, 7]


@pytest.fixture
def silent():
    """A started RingClient whose stage 0 reads but never answers: (client, stage0's end)."""
    to_stage0, stage0_in = InProcLink.pair(hwm=1000)
    _from_last, manager_in = InProcLink.pair()
    client = RingClient(
        to_stage0, manager_in, max_context=64, max_sessions=2, max_queue=1, queue_timeout=0.5
    )
    with client:
        yield client, stage0_in


def _sent(stage0_in) -> list:
    out = []
    while True:
        try:
            out.append(decode_message(stage0_in.recv(0.05)[0]))
        except Exception:
            return out


def test_sessions_beyond_the_bound_queue_then_fail_busy(silent):
    client, stage0_in = silent
    running = [client.submit(PROMPT, max_tokens=4) for _ in range(2)]
    queued = client.submit(PROMPT, max_tokens=4)
    assert (client.active, client.queue_depth) == (2, 1)
    with pytest.raises(RingBusy, match="all 2 session slots are taken") as full:
        client.submit(PROMPT, max_tokens=4)
    assert full.value.retry_after >= 1
    assert [m.op for m in _sent(stage0_in)] == ["prefill", "prefill"]  # the queued one waits
    with pytest.raises(RingBusy, match=r"waited 0\.5 s for a session slot"):
        queued.result(5)
    assert queued.busy and client.queue_depth == 0
    # a slot that frees admits the next waiting request at once
    waiting = client.submit(PROMPT, max_tokens=4)
    client.cancel(running[0])
    assert waiting.state == "prefill" and client.active == 2
    sent = _sent(stage0_in)
    assert [m.op for m in sent] == ["end", "prefill"]
    assert sent[1].sid == waiting.sid


def test_submit_never_blocks_even_when_stage0_does_not_read():
    """The sender thread owns the link: a full link stalls it, never the caller."""
    to_stage0, _stage0_in = InProcLink.pair(hwm=1)
    _from_last, manager_in = InProcLink.pair()
    with RingClient(to_stage0, manager_in, max_context=64, max_sessions=8) as client:
        started = time.monotonic()
        sessions = [client.submit(PROMPT, max_tokens=2) for _ in range(8)]
        assert time.monotonic() - started < 0.5
        for session in sessions:
            client.cancel(session)
        assert client.active == 0


def test_events_are_awaited_on_a_loop(silent):
    client, _ = silent

    async def run():
        session = await client.submit_async(PROMPT, max_tokens=4)
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, client.cancel, session, "enough")
        return [event async for event in session.aevents(timeout=5)]

    assert asyncio.run(run()) == [("error", "enough")]


def test_bad_prompts_are_refused_before_taking_a_slot(silent):
    client, _ = silent
    for prompt, match in (
        ([2**64], r"token id 18446744073709551616 is not an integer in \[0, 2147483647\]"),
        ([-1], "token id -1"),
        ([1.5], "token id 1.5"),
        ([], "at least one token"),
        (list(range(64)), "the context holds 64"),
    ):
        with pytest.raises(ValueError, match=match):
            client.submit(prompt, max_tokens=2)
    assert client.active == 0 and client.queue_depth == 0


def test_a_failing_stop_rule_fails_its_session_only():
    """A consumer's stop rule that raises ends that session; the ring thread lives on."""
    from swarmp2p.serve import Tokens

    to_stage0, stage0_in = InProcLink.pair()
    from_last, manager_in = InProcLink.pair()
    with RingClient(to_stage0, manager_in, max_context=64) as client:
        bad = client.submit(PROMPT, max_tokens=4, stop=lambda tokens: 1 / 0)
        good = client.submit(PROMPT, max_tokens=1)
        for session in (bad, good):
            from_last.send(
                [
                    Tokens(
                        group=-1, step=0, sids=(session.sid,), positions=(3,), tokens=(9,)
                    ).encode()
                ]
            )
        with pytest.raises(GenerationError, match="the stop rule failed: ZeroDivisionError"):
            bad.result(5)
        assert good.result(5) == [9]
    del stage0_in


def test_the_next_step_leaves_before_the_session_hears_of_its_token():
    """The receiver hands the scheduler's messages to the sender before it delivers the
    sessions' events: a consumer's hook (detokenizing, an event loop's wake-up) is off the path
    of the ring's next step. The hook here waits for that step at stage 0."""
    from swarmp2p.serve import Decode, Tokens

    to_stage0, stage0_in = InProcLink.pair()
    from_last, manager_in = InProcLink.pair()
    arrived: list = []

    def hook(kind, value):
        if kind == "token":
            arrived.append(decode_message(stage0_in.recv(2.0)[0]))

    with RingClient(to_stage0, manager_in, max_context=64) as client:
        session = client.submit(PROMPT, max_tokens=2, hook=hook)
        assert decode_message(stage0_in.recv(5)[0]).op == "prefill"
        reply = Tokens(group=-1, step=0, sids=(session.sid,), positions=(3,), tokens=(9,))
        from_last.send([reply.encode()])
        deadline = time.monotonic() + 5
        while not arrived and session.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert session.error is None
        assert arrived == [
            Decode(group=0, step=1, sids=(session.sid,), positions=(3,), tokens=(9,))
        ]


def _served(client, folder) -> ServedModel:
    return ServedModel(name="m", client=client, codec=TextCodec.from_folder(folder), max_context=64)


def _post(url, body: dict):
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_a_full_ring_answers_503_with_retry_after(silent, tokenizer_folder):
    client, _ = silent
    for _ in range(3):  # both slots and the one queue place
        client.submit(PROMPT, max_tokens=4)
    with ApiServer(build_app([_served(client, tokenizer_folder)])) as server:
        status, headers, body = _post(
            server.url + "/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": 2}
        )
    assert status == 503
    assert body["error"]["code"] == "overloaded"
    assert int(headers["Retry-After"]) >= 1


def test_closing_the_server_cancels_waiting_requests_and_never_hangs(silent, tokenizer_folder):
    client, _ = silent
    server = ApiServer(build_app([_served(client, tokenizer_folder)]))
    server.start()
    answers: list = []
    request = threading.Thread(
        target=lambda: answers.append(
            _post(server.url + "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 4})
        )
    )
    request.start()
    deadline = time.monotonic() + 10
    while client.active == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.active == 1  # the request waits on a ring that never answers
    started = time.monotonic()
    server.close()
    assert time.monotonic() - started < 3.0
    request.join(10)
    assert client.active == 0  # its session was cancelled
    assert answers and answers[0][0] == 503
    server.close()  # idempotent
    # a server whose loop already died closes without hanging
    dead = ApiServer(build_app([_served(client, tokenizer_folder)]))
    dead.start()
    dead._loop.call_soon_threadsafe(dead._loop.stop)
    dead._thread.join(10)
    started = time.monotonic()
    dead.close()
    assert time.monotonic() - started < 1.0


def test_a_large_body_is_parsed_off_the_loop_with_the_same_answers(silent, tokenizer_folder):
    client, _ = silent
    with ApiServer(build_app([_served(client, tokenizer_folder)])) as server:
        url = server.url + "/v1/completions"
        status, _, body = _post(url, {"model": "m", "prompt": "hello " * 20_000})
        assert (status, body["error"]["code"]) == (400, "context_length_exceeded")
        status, _, body = _post(url, {"model": "m", "prompt": "hi", "stop": ["x" * 70_000]})
        assert (status, body["error"]["param"]) == (400, "stop")
    assert client.active == 0


def test_served_on_the_callers_loop_it_starts_no_thread_and_closes_at_once(
    silent, tokenizer_folder
):
    """As the daemon serves its models: ``start_async`` on the running loop (no thread or loop
    of its own); ``close_async`` cancels a request waiting on the ring without hanging."""
    client, _ = silent

    async def main():
        server = ApiServer(build_app([_served(client, tokenizer_folder)]))
        before = threading.active_count()
        url = await server.start_async()
        assert threading.active_count() == before
        body = {"model": "m", "prompt": "hi", "max_tokens": 4}
        waiting = asyncio.ensure_future(asyncio.to_thread(_post, url + "/v1/completions", body))
        deadline = time.monotonic() + 10
        while client.active == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert client.active == 1  # the request waits on a ring that never answers
        started = time.monotonic()
        await server.close_async()
        assert time.monotonic() - started < 3.0
        status, _, _ = await asyncio.wait_for(waiting, 10)
        assert status == 503
        assert client.active == 0  # its session was cancelled
        await server.close_async()  # idempotent

    asyncio.run(main())
