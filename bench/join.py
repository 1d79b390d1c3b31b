"""What joining costs with per-node keys (issue 15) and pairing codes (issue 14).

1. a fresh CURVE handshake and one request: per-node keys (the control port: a ZAP callback
   asks the keyring) vs the shared secret's keys (what every socket used before), alternated;
2. one `node.join` on a real daemon's join port (fresh connection each time);
3. the SPAKE2 exchange of a pairing, both halves, in process (its crypto cost);
4. `swarm up` to listed in both nodes' status on 127.0.0.1 with mDNS: with the token, and with
   a pairing code (`swarm invite` on the first node), alternated.

Prints a markdown table, then one JSON object as the last line. Noisy box: read the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "integration"))


def _ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1000, 2)


def handshakes(n: int) -> dict[str, float]:
    from swarmp2p.net import (
        AsyncSecureContext,
        ClientKeys,
        KeyCheck,
        NodeKey,
        RpcClient,
        RpcServer,
        ServerKeys,
        SwarmSecret,
    )
    from swarmp2p.wire import Hello

    secret = SwarmSecret.generate()
    server_key, client_key = NodeKey.generate(), NodeKey.generate()
    members = {client_key.public, *(NodeKey.generate().public for _ in range(63))}

    async def handler(msg, sender):
        return msg

    hello = Hello(node_id="x", name="x", versions=[1], capabilities=[])

    async def main() -> dict[str, list[float]]:
        ctx = AsyncSecureContext()
        keys = ServerKeys(
            public=server_key.public,
            secret=server_key.secret,
            admits=KeyCheck(members.__contains__),
            domain="bench",
        )
        per_node = RpcServer(ctx, keys, "127.0.0.1", 0, handler)
        shared = RpcServer(ctx, secret, "127.0.0.1", 0, handler)
        await per_node.start()
        await shared.start()
        creds = {
            "per_node": (
                ClientKeys(
                    public=client_key.public, secret=client_key.secret, server=server_key.public
                ),
                per_node.endpoint,
            ),
            "shared": (secret, shared.endpoint),
        }
        times: dict[str, list[float]] = {"per_node": [], "shared": []}
        try:
            for i in range(n):
                for name in ("per_node", "shared") if i % 2 else ("shared", "per_node"):
                    c, endpoint = creds[name]
                    t = time.perf_counter()
                    client = RpcClient(ctx, c, endpoint)
                    await client.request(hello, 5.0)
                    times[name].append(time.perf_counter() - t)
                    await client.close()
        finally:
            await per_node.close()
            await shared.close()
            ctx.destroy(0)
        return times

    times = asyncio.run(main())
    return {"per_node_ms": _ms(times["per_node"]), "shared_ms": _ms(times["shared"])}


def spake2_exchange(n: int) -> float:
    from spake2 import SPAKE2_A

    from swarmp2p.node.cluster import pairing
    from swarmp2p.node.cluster.pairing import Invites, PairFinish, PairStart

    clock = [0.0]
    book = Invites(lambda: clock[0])
    took = []
    for _ in range(n):
        invite = book.create()
        t = time.perf_counter()
        joiner = SPAKE2_A(invite.code.encode(), **pairing._IDS)
        mine, session = joiner.start(), secrets.token_bytes(16)
        reply = book.start(PairStart(nameplate=invite.nameplate, session=session, spake=mine))
        key = joiner.finish(reply.spake)
        transcript = session + mine + reply.spake
        assert reply.confirm == pairing._mac(key, b"inviter", transcript)
        book.finish(PairFinish(session=session, confirm=pairing._mac(key, b"joiner", transcript)))
        took.append(time.perf_counter() - t)
        clock[0] += 2
    return _ms(took)


def _listed(node, other: str) -> bool:
    return any(p["node_id"] == other and p["alive"] for p in node.status()["peers"])


def joins(reps: int) -> dict[str, float]:
    from swarm_harness import NodeProc, free_port, swarm, swarm_env, wait_until

    from swarmp2p.net import SwarmSecret
    from swarmp2p.node.cluster.join import NodeJoin, join_endpoint

    tmp = Path(tempfile.mkdtemp(prefix="bench-join-"))
    token = SwarmSecret.generate().token
    port = free_port()
    env = {"SWARM_TOKEN": token, "SWARM_DASHBOARD_PORT": "off"}
    a = NodeProc(
        tmp / "a", ["--node-id", "a", "--port", str(port), "--interface", "127.0.0.1"], env=env
    ).start()
    out: dict[str, list[float]] = {"token": [], "code": [], "node_join": []}
    try:
        a.wait_up()
        wait_until(lambda: a.status()["leader_ready"], 30, "a to lead")
        # node.join on a's join port, fresh connection each time
        import zmq

        from swarmp2p import PROTOCOL_VERSION
        from swarmp2p.net import NodeKey, request_sync

        with zmq.Context() as ctx:
            for i in range(20):
                msg = NodeJoin(
                    node_id=f"probe{i}",
                    key=NodeKey.generate().public,
                    versions=[PROTOCOL_VERSION],
                    control_port=9,
                    join_port=11,
                    addresses=["127.0.0.1"],
                )
                t = time.perf_counter()
                request_sync(
                    ctx,
                    SwarmSecret.from_token(token),
                    join_endpoint(f"tcp://127.0.0.1:{port}"),
                    msg,
                    5.0,
                )
                out["node_join"].append(time.perf_counter() - t)
        for i in range(reps):
            for how in ("token", "code") if i % 2 == 0 else ("code", "token"):
                name = f"{how[0]}{i}"
                state = tmp / name
                cmd = [
                    sys.executable,
                    "-m",
                    "swarmp2p",
                    "up",
                    "--state-dir",
                    str(state),
                    "--node-id",
                    name,
                    "--port",
                    str(free_port()),
                    "--interface",
                    "127.0.0.1",
                    "--heartbeat",
                    "0.2",
                    "--failure-timeout",
                    "1.5",
                ]
                extra = {"SWARM_DASHBOARD_PORT": "off"}
                if how == "token":
                    extra["SWARM_TOKEN"] = token
                else:
                    code = json.loads(swarm(a, "invite", "--json").stdout)["code"]
                    cmd += ["--code", code]
                t = time.monotonic()
                done = subprocess.run(
                    cmd, capture_output=True, text=True, env=swarm_env(extra), cwd=ROOT, timeout=120
                )
                if done.returncode != 0:
                    raise RuntimeError(done.stderr)
                b = NodeProc(state, [])
                wait_until(
                    lambda n=name, b=b: _listed(a, n) and _listed(b, "a"),
                    30,
                    f"{name} listed",
                    interval=0.02,
                )
                out[how].append(time.monotonic() - t)
                subprocess.run(
                    [sys.executable, "-m", "swarmp2p", "down", "--state-dir", str(state)],
                    capture_output=True,
                    env=swarm_env(),
                    timeout=60,
                )
                time.sleep(1.0)  # an invite allows one try per second
    finally:
        a.stop()
    return {
        "node_join_ms": _ms(out["node_join"]),
        "up_token_s": round(statistics.median(out["token"]), 2),
        "up_code_s": round(statistics.median(out["code"]), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (CI)")
    args = parser.parse_args()
    n, reps = (40, 1) if args.quick else (200, 3)
    hs = handshakes(n)
    pake = spake2_exchange(10 if args.quick else 30)
    jo = joins(reps)
    rows = [
        (
            "fresh handshake + 1 request, per-node keys (ZAP asks the keyring)",
            f"{hs['per_node_ms']} ms",
        ),
        ("fresh handshake + 1 request, the shared secret's keys (before)", f"{hs['shared_ms']} ms"),
        ("ratio per-node / shared", f"{hs['per_node_ms'] / hs['shared_ms']:.2f}x"),
        ("`node.join` on a real daemon (fresh connection)", f"{jo['node_join_ms']} ms"),
        ("SPAKE2 pairing exchange, both halves, in process", f"{pake} ms"),
        ("`swarm up` to listed, token (loopback, mDNS)", f"{jo['up_token_s']} s"),
        ("`swarm up --code` to listed (loopback, mDNS)", f"{jo['up_code_s']} s"),
    ]
    print("| what | median |\n|---|---|")
    for what, value in rows:
        print(f"| {what} | {value} |")
    print(json.dumps({"handshake": hs, "spake2_ms": pake, **jo}))


if __name__ == "__main__":
    main()
