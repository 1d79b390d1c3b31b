"""A serving stage worker: ``python -m swarmp2p.runtime.serve_worker``.

stdin, one JSON object per line:
  1. the stage spec (:class:`swarmp2p.serve.spec.ServeSpec`: the serve plan, the stage, what
     only this node knows), checked before torch is imported;
  2. after ``ready``: ``{"op": "connect", "next": "tcp://host:port"}`` (the next stage's input
     link, or the session manager's return link after the last stage);
  then ``{"op": "stop"}`` or end of input stops the worker.
stdout, one JSON event per line: ``{"event": "ready", "endpoint", "stage", "load_s"}``,
``{"event": "serving"}``, every WORKER_TIMINGS.serve_stats_every_s while it works ``{"event": "stats", "stage",
"sessions", "batch", "peak_batch", "steps", "busy_s", "waiting"}`` (the batch size of its latest
decode step, and how busy it is), ``{"event": "stopped", "steps", ...the same stats}``, or
``{"event": "error", "message"}`` before a non-zero exit. Diagnostics go to stderr; faulthandler is on, so a native
crash names where it happened.
"""

from __future__ import annotations

import faulthandler
import json
import sys
import threading
import time

from swarmp2p.runtime._process import exit_now, keep_bitsandbytes_out
from swarmp2p.timings.workers import WORKER_TIMINGS

_EMIT_LOCK = threading.Lock()


def _emit(event: str, **fields) -> None:
    with _EMIT_LOCK:  # the stats reporter writes too: one whole line at a time
        sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
        sys.stdout.flush()


def _read_json_line(what: str) -> dict:
    line = sys.stdin.readline()
    if not line:
        raise EOFError(f"stdin closed before the {what}")
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"the {what} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"the {what} must be a JSON object, got {type(value).__name__}")
    return value


def _watch_stdin(stop: threading.Event) -> None:
    """Stop on ``{"op": "stop"}`` or end of input; other lines are reported and ignored."""
    for line in sys.stdin:
        try:
            op = json.loads(line).get("op")
        except (json.JSONDecodeError, AttributeError):
            op = None
        if op == "stop":
            break
        print(f"serve worker: ignored stdin line {line.strip()[:80]!r}", file=sys.stderr)
    stop.set()


def _report_stats(server, stage: int, stop: threading.Event) -> None:
    """A ``stats`` event every WORKER_TIMINGS.serve_stats_every_s while the stage runs forwards."""
    last = -1
    while not stop.wait(WORKER_TIMINGS.serve_stats_every_s):
        stats = server.stats()
        if stats["steps"] != last:
            last = stats["steps"]
            _emit("stats", stage=stage, **stats)


def _load_trained(spec):
    """The stage from its base and shard; the manifest's boundary compression is the one
    served, and a spec that names another one is refused."""
    from swarmp2p.runtime.torch.serve.trained import load_trained_stage

    trained = load_trained_stage(
        spec.model,
        spec.shard,
        layer_start=spec.layers[0],
        layer_end=spec.layers[1],
        is_first=spec.is_first,
        is_last=spec.is_last,
        dtype=spec.dtype,
        quantization=spec.quantization,
        device=spec.device,
        tied_head=spec.tied_head,
    )
    asked = spec.planned.send_compression
    if asked not in ("none", trained.send_compression):
        raise ValueError(
            f"send_compression: the stage spec asks for {asked!r}, but shard "
            f"{spec.shard} was trained with {trained.send_compression!r} on that boundary"
        )
    return trained


def _grammar_tokenizer(spec, stage):
    """A last stage's tokenizer for structured outputs, from the model folder it loaded (a Hub
    model's cached snapshot): made on a thread now; a folder without one fails only the
    grammar sessions, naming why."""
    from pathlib import Path

    from swarmp2p.models import resolve_model_ref
    from swarmp2p.runtime.torch.serve.sampling import GrammarTokenizer

    folder = resolve_model_ref(spec.model)
    if not Path(folder).is_dir():  # a Hub id: the stage's files are in the local cache
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(folder, "tokenizer.json")
        folder = Path(cached).parent if isinstance(cached, str) else Path(folder)
    return GrammarTokenizer(folder, getattr(stage.config, "vocab_size", 0) or 0)


def _draft_model(spec):
    """Stage 0's draft model, from its folder, checked against the served model's tokenizer
    (ValueError naming both), in the plan's dtype on the stage's device."""
    import torch

    from swarmp2p.models import resolve_model_ref
    from swarmp2p.runtime.torch.serve.draft import load_draft_model

    return load_draft_model(
        resolve_model_ref(spec.draft),
        target=resolve_model_ref(spec.model),
        device=spec.device,
        dtype=getattr(torch, spec.dtype),
    )


def run() -> int:
    from swarmp2p.serve.spec import parse_serve_spec

    spec = parse_serve_spec(_read_json_line("stage spec"))
    keep_bitsandbytes_out(spec.quantization)

    import torch

    from swarmp2p.net import SecureContext, SwarmSecret, ZmqLink, stop_zero_copy_collector
    from swarmp2p.runtime.torch import load_spec_stage
    from swarmp2p.runtime.torch.model.packed import pack_linears
    from swarmp2p.runtime.torch.serve.server import StageServer

    if spec.threads:
        torch.set_num_threads(spec.threads)
    started = time.monotonic()
    halves: dict = {}
    send_compression = spec.planned.send_compression
    if spec.shard is None:
        stage = load_spec_stage(spec)
    else:
        trained = _load_trained(spec)
        stage = trained.stage
        halves = {
            "receiver": trained.receiver,
            "sender": trained.sender,
            "send_codec": trained.send_codec,
        }
        send_compression = "none" if trained.sender is not None else trained.send_compression
    stage.eval()
    packed = pack_linears(stage)  # its float32 CPU layers (see runtime/torch/model/packed.py)
    if spec.link_keys:  # the node's own keys: only the ring's neighbouring nodes connect
        from swarmp2p.net.links import link_credentials

        secret, client = link_credentials(spec.link_keys)
    else:
        secret = client = SwarmSecret.from_token(spec.token)
    ctx = SecureContext()
    inbound = outbound = None
    try:
        inbound = ZmqLink.bind(ctx, secret, spec.host, spec.port)
        _emit(
            "ready",
            endpoint=inbound.endpoint,
            stage=spec.stage_index,
            load_s=round(time.monotonic() - started, 3),
            packed_linears=packed,
        )
        connect = _read_json_line("connect line")
        if connect.get("op") != "connect" or not isinstance(connect.get("next"), str):
            raise ValueError(f'expected {{"op": "connect", "next": endpoint}}, got {connect}')
        if client is None:
            raise ValueError("link_keys: no 'next' key to dial the next stage with")
        outbound = ZmqLink.dial(ctx, client, connect["next"])
        server = StageServer(
            stage,
            inbound=inbound,
            outbound=outbound,
            send_compression=send_compression,
            send_codes=spec.planned.send_codes,
            **halves,
            max_sessions=spec.plan.max_sessions,
            max_context=spec.plan.max_context,
            grammar_tokenizer=_grammar_tokenizer(spec, stage) if spec.is_last else None,
            drafter=_draft_model(spec) if spec.draft is not None else None,
        )
        stop = threading.Event()
        watcher = threading.Thread(target=_watch_stdin, args=(stop,), daemon=True)
        watcher.start()
        reporter = threading.Thread(
            target=_report_stats, args=(server, spec.stage_index, stop), daemon=True
        )
        reporter.start()
        _emit("serving", stage=spec.stage_index)
        server.serve_forever(stop)
        _emit("stopped", stage=spec.stage_index, **server.stats())
    finally:
        for link in (inbound, outbound):
            if link is not None:
                link.close()
        stop_zero_copy_collector()
        ctx.destroy(0)
    return 0


def main() -> None:
    faulthandler.enable()
    try:
        code = run()
    except Exception as e:
        _emit("error", message=f"{type(e).__name__}: {e}")
        print(f"serve worker failed: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    exit_now(code)


if __name__ == "__main__":
    main()
