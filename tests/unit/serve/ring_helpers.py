"""Helpers of the serving tests: a ring of StageServers on threads, and reference generation."""

from __future__ import annotations

import copy
import itertools
import threading
from contextlib import contextmanager

import torch

from swarmp2p.net import InProcLink
from swarmp2p.runtime.torch import build_stage
from swarmp2p.runtime.torch.model.introspect import introspect
from swarmp2p.runtime.torch.model.packed import pack_linears
from swarmp2p.runtime.torch.serve.server import StageServer
from swarmp2p.runtime.torch.train.boundary import apply_boundary
from swarmp2p.serve import RingClient


@contextmanager
def thread_stages(
    model,
    cuts,
    *,
    compression=None,
    codes=None,
    max_context=64,
    max_sessions=16,
    servers=None,
    hold=None,
    pack=False,
    drafter=None,
    **server_kw,
):
    """Stage servers of ``model`` cut at ``cuts``, each on its own thread; yields the manager's
    ends ``(to_stage0, from_last)`` and the links between stages (``servers``, a list, gets the
    StageServers; ``server_kw`` go to each; with ``hold``, an event, they serve once it is
    set, so messages sent before wait together; with ``pack``, the stages are a copy of the
    model with its linear layers packed as a CPU serve worker packs them; ``drafter``: stage 0's
    draft model)."""
    if pack:
        model = copy.deepcopy(model)
    bounds = [0, *cuts, introspect(model).num_blocks]
    n = len(bounds) - 1
    compression = compression or ["none"] * (n - 1)
    codes = codes or [False] * (n - 1)
    links = [InProcLink.pair() for _ in range(n + 1)]  # links[i]: into stage i (n: manager)
    stop = threading.Event()
    threads = []
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        stage = build_stage(model, a, b)
        if pack:
            assert pack_linears(stage) > 0
        server = StageServer(
            stage,
            inbound=links[i][1],
            outbound=links[i + 1][0],
            send_compression=compression[i] if i < n - 1 else "none",
            send_codes=codes[i] if i < n - 1 else False,
            max_context=max_context,
            max_sessions=max_sessions,
            drafter=drafter if i == 0 else None,
            **server_kw,
        )
        if servers is not None:
            servers.append(server)

        def serve(server=server):
            if hold is not None:
                hold.wait()
            server.serve_forever(stop, 0.02)

        thread = threading.Thread(target=serve, name=f"stage{i}")
        thread.start()
        threads.append(thread)
    try:
        yield links[0][0], links[n][1], links
    finally:
        stop.set()
        if hold is not None:
            hold.set()
        for thread in threads:
            thread.join()


@contextmanager
def thread_ring(
    model,
    cuts,
    *,
    compression=None,
    codes=None,
    max_context=64,
    prefill_chunk=64,
    pack=False,
    drafter=None,
    **client_kw,
):
    """A RingClient over stages of ``model`` cut at ``cuts``, each served on its own thread
    (``client.servers``: the StageServers; ``drafter``: stage 0's draft model)."""
    servers: list = []
    with thread_stages(
        model,
        cuts,
        compression=compression,
        codes=codes,
        max_context=max_context,
        servers=servers,
        prefill_chunk=prefill_chunk,
        pack=pack,
        drafter=drafter,
    ) as (first, last, links):
        client_kw.setdefault("draft_model", drafter is not None)
        client = RingClient(first, last, max_context=max_context, **client_kw)
        client.servers = servers
        client.boundary_bytes = lambda: [links[i][0].bytes_sent for i in range(1, len(links) - 1)]
        with client:
            yield client


@contextmanager
def served_ring(servers, *, max_context=64, **client_kw):
    """A RingClient over prebuilt stages, each served on its own thread: ``servers`` holds one
    dict of StageServer keyword arguments (``stage`` and any others) per stage, in order."""
    n = len(servers)
    links = [InProcLink.pair() for _ in range(n + 1)]  # links[i]: into stage i (n: manager)
    stop = threading.Event()
    threads = []
    try:
        for i, kwargs in enumerate(servers):
            server = StageServer(
                inbound=links[i][1], outbound=links[i + 1][0], max_context=max_context, **kwargs
            )
            thread = threading.Thread(
                target=server.serve_forever, args=(stop, 0.02), name=f"stage{i}"
            )
            thread.start()
            threads.append(thread)
        client = RingClient(links[0][0], links[n][1], max_context=max_context, **client_kw)
        client.boundary_bytes = lambda: [links[i][0].bytes_sent for i in range(1, n)]
        with client:
            yield client
    finally:
        stop.set()
        for thread in threads:
            thread.join()


def reference_generate(model, prompt, max_new_tokens, *, cuts=(), compression=None):
    """``model.generate`` greedy, with each boundary's compression applied in the graph at the
    output of the block before each cut (the same quantization in one process)."""
    blocks = introspect(model).blocks
    handles = []
    for cut, spec in zip(cuts, compression or ()):
        if spec == "none":
            continue

        def hook(module, args, output, spec=spec):
            if isinstance(output, tuple):
                return (apply_boundary(output[0], spec), *output[1:])
            return apply_boundary(output, spec)

        handles.append(blocks[cut - 1].register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
    finally:
        for handle in handles:
            handle.remove()
    return out[0, len(prompt) :].tolist()
