"""The daemon's local API for the swarm's membership: `swarm remove NODE`, `swarm token
--rotate` (both done by the leader) and `swarm invite` (a pairing code served here).
Never imports torch."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from swarmp2p.errors import Unavailable, UserError
from swarmp2p.net.security import fingerprint
from swarmp2p.node import requests as rq
from swarmp2p.node.api import ApiHandler
from swarmp2p.node.cluster import join as jn
from swarmp2p.schema import Data

if TYPE_CHECKING:
    from swarmp2p.node.cluster.pairing import PairingPort
    from swarmp2p.node.context import NodeContext


def handlers(
    ctx: NodeContext, admission: jn.Admission, pairing: PairingPort
) -> dict[str, ApiHandler]:
    async def remove(req: rq.RemoveRequest) -> dict[str, Data]:
        """`swarm remove NODE`: the leader takes it off the members and revokes its key."""
        node_id = req.node_id
        msg = jn.MemberRemove(node_id=node_id, reason=f"removed from node {ctx.node_id}")
        reply = await ctx.to_leader(msg, ctx.config.timings.rotate_s + 5)
        return {"node_id": node_id, "key": fingerprint(reply.key), "version": reply.version}

    async def rotate(req: rq.RotateRequest) -> dict[str, Data]:
        """`swarm token --rotate`: a new secret for the whole swarm; the old one admits nobody."""
        msg = jn.SecretRotate(reason=f"rotated from node {ctx.node_id}")
        reply = await ctx.to_leader(msg, ctx.config.timings.rotate_s + 5)
        deadline = ctx.clock() + ctx.config.timings.rotate_s
        while ctx.secret.swarm_id != reply.swarm_id and ctx.clock() < deadline:
            admission.check_secret()
            await asyncio.sleep(0.05)
        if ctx.secret.swarm_id != reply.swarm_id:
            raise Unavailable(
                f"the leader rotated the secret (swarm id {reply.swarm_id}) but this node has "
                "not fetched it yet; run `swarm token` again in a moment",
                code="not_ready",
            )
        return {"swarm_id": reply.swarm_id, "version": reply.version}

    async def invite(req: rq.InviteRequest) -> dict[str, Data]:
        """`swarm invite`: a one-time pairing code for a new machine on this LAN."""
        if not ctx.config.mdns:
            raise UserError(
                "this node runs with --no-mdns: a new machine cannot find its invite; give it "
                "the token instead (`swarm token | ssh HOST swarm up --token -`)",
                code="bad_request",
            )
        result = await pairing.invite(req.minutes * 60)
        return {**result, "node_id": ctx.node_id, "swarm_id": ctx.secret.swarm_id}

    return {"remove": remove, "rotate": rotate, "invite": invite}
