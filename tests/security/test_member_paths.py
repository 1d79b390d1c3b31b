"""A member names files with ``..``: nothing outside its folder may be read or written
(issue 15, items 2 and 9). Every node/ call site confines the names it is given
(:func:`swarmp2p.paths.confine`, :func:`swarmp2p.paths.check_id`)."""

from __future__ import annotations

import asyncio

import pytest
from security_harness import credentials, member_request

from swarmp2p.net import AsyncSecureContext, NodeKey, RpcClient, RpcError, RpcServer, ServerKeys
from swarmp2p.net.auth import KeyCheck
from swarmp2p.node.messages import FilePull, ServeStageStart, ShardChunk, ShardRead

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("job_id", "file"),
    [
        ("..", "secret"),
        ("..", "node_id"),
        ("j1", "../../secret"),
        ("j1", "x/../../../secret"),
        ("j1", "/etc/passwd"),
        ("../..", "etc/passwd"),
    ],
)
def test_shard_read_reads_nothing_outside_the_job_folder(victim, job_id, file):
    msg = ShardRead(job_id="j1", file="x", offset=0, size=4096)
    with pytest.raises(RpcError) as info:
        reply = member_request(victim.endpoint, victim.token, msg, job_id=job_id, file=file)
        assert not (isinstance(reply, ShardChunk) and b"swarm1-" in reply.data), "read the token"
    assert info.value.code == "bad_field", info.value


def test_file_pull_writes_nothing_outside_the_job_folder(victim):
    """The member serves a file and tells the victim to pull it into job ``..``: before the
    fix it overwrote the victim's node_id (it came back as the member's choice and led)."""
    node_id_before = victim.state.node_id_file.read_text()
    keys = credentials(victim.endpoint, victim.token)
    mine = NodeKey(keys.public, keys.secret)
    served = ServerKeys(
        public=mine.public, secret=mine.secret, admits=KeyCheck.anyone(), domain="evil"
    )

    async def evil(msg, peer):
        if isinstance(msg, ShardRead):
            data = b"a0\n"
            return ShardChunk(data=data[msg.offset : msg.offset + msg.size], total=len(data))
        return None

    async def attack() -> str:
        ctx = AsyncSecureContext()
        server = RpcServer(ctx, served, "127.0.0.1", 0, evil)
        await server.start()
        client = RpcClient(ctx, keys, victim.endpoint)
        try:
            await client.request(FilePull(job_id="..", file="node_id", source=server.endpoint), 15)
            return "pulled"
        except RpcError as exc:
            return exc.code
        finally:
            await client.close()
            await server.close()
            ctx.destroy(0)

    code = asyncio.run(attack())
    overwritten = victim.state.node_id_file.read_text() != node_id_before
    if overwritten:  # put it back for the other tests
        victim.state.node_id_file.write_text(node_id_before)
    assert code == "bad_field" and not overwritten, (code, overwritten)


def test_serve_stage_start_creates_nothing_outside_the_state_dir(victim):
    """serve.stage_start(serve_id='../../x') made the worker's log outside the state dir; a
    serve id is one path component on the wire now."""
    from swarmp2p.plan import from_config
    from swarmp2p.plan.serve import ServeInputs

    outside = victim.state.root.parent
    before = set(outside.iterdir())
    shape = from_config(
        {
            "model_type": "llama",
            "vocab_size": 128,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        }
    )
    msg = ServeStageStart(
        serve_id="s1",
        attempt=1,
        stage=0,
        inputs=ServeInputs(shape=shape),
        plan="{}",
        model="/nonexistent-model",
        issuer="zmallory",
    )
    with pytest.raises(RpcError) as info:
        member_request(victim.endpoint, victim.token, msg, serve_id="../../escaped")
    assert info.value.code == "bad_field" and "serve_id" in info.value.detail, info.value
    assert sorted(p.name for p in set(outside.iterdir()) - before) == []
