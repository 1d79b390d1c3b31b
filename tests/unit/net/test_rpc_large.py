"""Large requests wait in their sender's queue, within a byte budget: a burst of near-cap
messages from one peer does not delay another peer's small requests (issue 24, item 5)."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest

from swarmp2p.net import AsyncSecureContext, RpcClient, RpcError, RpcServer, SwarmSecret, rpc
from swarmp2p.net.rpc import ByteBudget, peek_id
from swarmp2p.wire import MAX_MESSAGE_BYTES, Message, encode, message


@message("test.blob")
class Blob(Message):
    data: bytes
    text: str = ""


def test_the_byte_budget_refills_at_its_rate_up_to_its_burst():
    now = [0.0]
    budget = ByteBudget(rate=100.0, burst=300.0, clock=lambda: now[0])
    assert budget.wait_s(200) == 0.0  # from a full bucket
    assert budget.wait_s(200) == pytest.approx(1.0)  # 100 left, 100 short at 100/s
    now[0] += 1.0
    assert budget.wait_s(200) == 0.0
    now[0] += 100.0
    assert budget.wait_s(10_000) == 0.0  # never more than the burst is asked for
    assert budget.wait_s(1) == pytest.approx(0.01)


def test_peek_id_reads_the_id_without_the_rest():
    assert peek_id(encode(Blob(id=42, data=b"x" * 100_000))) == 42
    assert peek_id(msgpack.packb({"data": b"x", "id": 7, "v": 1})) == 7
    late = {f"k{i}": i for i in range(4)} | {"id": 7}
    assert peek_id(msgpack.packb(late)) == 0  # past the first four entries: not looked for
    assert peek_id(b"\xc1garbage") == 0
    assert peek_id(msgpack.packb({"id": -1})) == 0


def test_a_burst_of_large_requests_from_one_peer_leaves_small_ones_prompt():
    """40 near-cap requests from peer A; peer B's small requests meanwhile are answered at
    once, A's excess past the queue is refused "busy" (paired by its id), the rest in turn."""
    secret = SwarmSecret.generate()
    seen: list[str] = []

    async def handler(msg, peer):
        seen.append(type(msg).TYPE)
        return Blob(data=b"", text="ok")

    async def main() -> None:
        ctx = AsyncSecureContext()
        server = RpcServer(ctx, secret, "127.0.0.1", 0, handler)
        await server.start()
        # two connections; without CURVE keys per node each connection is its own sender
        big_client = RpcClient(ctx, secret, server.endpoint)
        small_client = RpcClient(ctx, secret, server.endpoint)
        try:
            near_cap = b"x" * (MAX_MESSAGE_BYTES - 1024)
            burst = [
                asyncio.ensure_future(big_client.request(Blob(data=near_cap), 60.0))
                for _ in range(40)
            ]
            await asyncio.sleep(0.05)  # the burst is on its way
            lags = []
            for _ in range(20):
                start = time.monotonic()
                reply = await small_client.request(Blob(data=b"hb"), 5.0)
                lags.append(time.monotonic() - start)
                assert reply.text == "ok"
                await asyncio.sleep(0.02)
            results = await asyncio.gather(*burst, return_exceptions=True)
        finally:
            await big_client.close()
            await small_client.close()
            await server.close()
            ctx.destroy(0)
        busy = [r for r in results if isinstance(r, RpcError) and r.code == "busy"]
        done = [r for r in results if isinstance(r, Blob)]
        assert max(lags) < 0.25, lags
        assert busy and "large requests from this node already wait" in busy[0].detail
        assert len(done) + len(busy) == 40, results
        assert len(done) >= rpc.MAX_QUEUED_LARGE

    asyncio.run(main())
