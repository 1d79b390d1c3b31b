"""Decode tokens/s and time to first token of the embedded model: swarmp2p rings of 1, 2 and 3
stage worker processes on loopback (CURVE ZmqLinks) against ``model.generate`` in one process.

Every process (the generate process and each stage worker) uses ``--threads`` intra-op
threads. One session's step runs on one stage at a time, so a ring never computes on more
threads at once than ``model.generate`` does. The runs alternate (generate, 1, 2, 3 stages,
again) ``--repeats`` times and the medians are reported, since neighbours on a shared machine
stall a run now and then. Decode tokens/s counts tokens after the first over the time after
the first; TTFT is the time from the request to the first token (prefill included).
``hop_ms`` is what one more stage costs per token: the median over N = 2, 3 of
(per-token time with N stages - with 1 stage) / (N - 1), i.e. one extra loopback hop plus
the stage's bookkeeping; ``hop_ms_tiny`` is the same over rings of a tiny model, whose
compute is negligible, so noise in the real model's compute does not swamp it. Targets (issue 8): ratio_2 >= 0.95, ratio_3 >= 0.9.

Then the same through HTTP with many users at once (issue 16): a ``python -m swarmp2p.serve``
server of 1, 2 and 3 stages (one thread per stage worker) answers 1, 4, 8 and 16 concurrent
streamed chat requests of the official ``openai`` client (greedy, ``--conc-tokens`` each),
against ``model.generate`` on a batch of the same size in one process with as many threads as
the ring has stages. Aggregate tok/s is every request's completion tokens over the wall time
from the first request to the last token (prefill included, on both sides); TTFT and the gaps
between streamed chunks are reported as p50/p99 over all requests. A CPU stage packs its linear
layers for oneDNN (``runtime/torch/packed``), so ``generate`` is also run on a copy packed the
same way ("x generate packed": the ring against the same kernels). ``--quick`` runs that part
on a tiny random Llama (the embedded tokenizer), 1 and 2 stages, 1 and 8 users. Targets: 8 sessions >= 0.8x
batched ``generate(8)`` and >= 4x one session; one session through HTTP >= 0.95x generate.

Prints markdown tables, then as its last line one JSON object.

    python bench/serve.py [--quick] [--tokens N] [--repeats R] [--threads T] [--conc-tokens N]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


def _generate_run(model, prompt_ids, tokens: int) -> tuple[float, float, list[int]]:
    """(ttft_s, decode tok/s, ids) of model.generate, eos ignored."""
    import torch

    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=2)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(
            ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=2
        )
        total = time.perf_counter() - start
    decode_s = max(total - ttft, 1e-9)
    return ttft, (tokens - 1) / decode_s, out[0, len(prompt_ids) :].tolist()


def _ring_run(ring, prompt_ids, tokens: int) -> tuple[float, float, list[int]]:
    """(ttft_s, decode tok/s, ids) of one greedy session round the ring, eos ignored."""
    stamps: list[float] = []
    started = time.monotonic()
    session = ring.client.submit(
        prompt_ids,
        max_tokens=tokens,
        hook=lambda kind, value: stamps.append(time.monotonic()) if kind == "token" else None,
    )
    ids = session.result(600)
    ttft = stamps[0] - started
    return ttft, (tokens - 1) / max(stamps[-1] - stamps[0], 1e-9), ids


def _tiny_hop_ms(threads: int, tokens: int, repeats: int) -> dict[int, float]:
    """Median ms/token of rings of 1, 2, 3 stages of a 4-block Llama of width 32, whose compute
    is negligible: what remains is the hops and each stage's per-step bookkeeping."""
    import tempfile

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from swarmp2p.serve.local import LocalRing

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    bounds = {1: [(0, 4)], 2: [(0, 2), (2, 4)], 3: [(0, 1), (1, 3), (3, 4)]}
    times: dict[int, list[float]] = {n: [] for n in bounds}
    with tempfile.TemporaryDirectory() as folder:
        LlamaForCausalLM(config).save_pretrained(folder)
        rings = {}
        try:
            for n, b in bounds.items():
                rings[n] = LocalRing(folder, bounds=b, threads=threads, max_context=tokens + 8)
            for _ in range(repeats):
                for n, ring in rings.items():
                    _, tok_s, _ = _ring_run(ring, [5, 6, 7], tokens)
                    times[n].append(1000 / tok_s)
        finally:
            for ring in rings.values():
                ring.close()
    return {n: statistics.median(v) for n, v in times.items()}


CONCURRENCY = (1, 4, 8, 16)
HEADLINE_STAGES = 2
"""The issue's measurement: 2 loopback stages."""


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _tiny_served_folder(folder: str) -> str:
    """A tiny random Llama with the embedded model's tokenizer (its vocabulary), saved in
    ``folder``: serving overheads with negligible compute (``--quick``)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from swarmp2p.models import resolve_model_ref

    source = Path(resolve_model_ref("embedded"))
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, Path(folder) / name)
    return folder


class _Server:
    """``python -m swarmp2p.serve MODEL --stages N`` in its own process, one thread per stage,
    from this checkout or from ``root`` (another checkout: the code before a change)."""

    def __init__(
        self, model: str, stages: int, max_context: int, max_sessions: int, root: str | None = None
    ) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/v1"
        root = root or str(Path(__file__).resolve().parents[1])
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        }
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (lives as long as the server)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "swarmp2p.serve",
                model,
                "--stages",
                str(stages),
                "--port",
                str(port),
                "--threads",
                "1",
                "--max-sessions",
                str(max_sessions),
                "--max-context",
                str(max_context),
            ],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=env,
            cwd=root,
        )
        line = self.proc.stdout.readline()
        if "serving" not in line:
            self.proc.kill()
            self._stderr.seek(0)
            raise RuntimeError(f"the server did not start: {line!r} {self._stderr.read()[-2000:]}")

    def close(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._stderr.close()


def _http_round(client, model: str, users: int, tokens: int) -> dict:
    """``users`` streamed greedy chat requests at once; aggregate tok/s, TTFTs, chunk gaps."""
    results: list = [None] * users
    barrier = threading.Barrier(users + 1)

    def one(i: int) -> None:
        barrier.wait()
        started = time.perf_counter()
        stamps, used = [], 0
        stream = client.chat.completions.create(
            model=model,
            messages=PROMPT,
            temperature=0,
            max_tokens=tokens,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                stamps.append(time.perf_counter())
            if chunk.usage is not None:
                used = chunk.usage.completion_tokens
        results[i] = (started, stamps, used)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(users)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    end = max(r[1][-1] for r in results)
    total = sum(r[2] for r in results)
    return {
        "tok_s": total / (end - start),
        "tokens": total,
        "ttft": [r[1][0] - r[0] for r in results],
        "gaps": [b - a for r in results for a, b in zip(r[1], r[1][1:])],
    }


def _generate_batch(model, prompt_ids, batch: int, tokens: int, threads: int) -> float:
    """Aggregate tok/s of ``model.generate`` on ``batch`` copies of the prompt (prefill
    included), eos ignored, ``threads`` intra-op threads, on the model's device."""
    import torch

    torch.set_num_threads(threads)
    ids = torch.tensor([prompt_ids] * batch, device=model.device)
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=2,
        )
        if ids.is_cuda:  # generate returns before the card is done
            torch.cuda.synchronize()
        return batch * tokens / (time.perf_counter() - start)


def concurrency(
    model_ref: str,
    *,
    stages: tuple[int, ...],
    users: tuple[int, ...],
    tokens: int,
    repeats: int,
    baseline_root: str | None = None,
) -> dict:
    """The HTTP section: per stage count and concurrency, ring vs batched generate; with
    ``baseline_root``, the headline stage count is served by that checkout too (alternated)."""
    import openai
    import torch
    from transformers import AutoModelForCausalLM

    from swarmp2p.models import resolve_model_ref
    from swarmp2p.runtime.torch.model.packed import pack_linears
    from swarmp2p.serve.text import TextCodec

    folder = resolve_model_ref(model_ref)
    prompt_ids = TextCodec.from_folder(folder).encode_chat(PROMPT)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    packed = copy.deepcopy(model)  # the kernels a CPU serve stage runs (runtime/torch/packed)
    pack_linears(packed)
    context = len(prompt_ids) + tokens + 8
    servers = {n: _Server(model_ref, n, context, max(users)) for n in stages}
    if baseline_root is not None:
        servers["before"] = _Server(model_ref, HEADLINE_STAGES, context, max(users), baseline_root)
    ring: dict = {(n, u): [] for n in servers for u in users}
    gen: dict = {(n, u): [] for n in stages for u in users}
    gen_packed: dict = {(n, u): [] for n in stages for u in users}
    try:
        clients = {
            n: openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=600)
            for n, s in servers.items()
        }
        for n in servers:  # warm-up, not counted
            _http_round(clients[n], model_ref, 2, 4)
        _generate_batch(model, prompt_ids, 2, 4, 1)
        _generate_batch(packed, prompt_ids, 2, 4, 1)
        for _ in range(repeats):
            for n in stages:
                for u in users:
                    ring[n, u].append(_http_round(clients[n], model_ref, u, tokens))
                    if n == HEADLINE_STAGES and "before" in servers:
                        ring["before", u].append(
                            _http_round(clients["before"], model_ref, u, tokens)
                        )
                    gen[n, u].append(_generate_batch(model, prompt_ids, u, tokens, n))
                    gen_packed[n, u].append(_generate_batch(packed, prompt_ids, u, tokens, n))
    finally:
        for server in servers.values():
            server.close()
        torch.set_num_threads(1)
    out: dict = {}
    for (n, u), runs in ring.items():
        ttft = [t for r in runs for t in r["ttft"]]
        gaps = [g for r in runs for g in r["gaps"]]
        out[n, u] = {
            "tok_s": statistics.median(r["tok_s"] for r in runs),
            "generate_tok_s": statistics.median(gen[HEADLINE_STAGES if n == "before" else n, u]),
            "generate_1_thread_tok_s": statistics.median(gen[min(stages), u]),
            "generate_packed_tok_s": statistics.median(
                gen_packed[HEADLINE_STAGES if n == "before" else n, u]
            ),
            "ttft_p50_ms": 1000 * _percentile(ttft, 0.5),
            "ttft_p99_ms": 1000 * _percentile(ttft, 0.99),
            "itl_p50_ms": 1000 * _percentile(gaps, 0.5),
            "itl_p99_ms": 1000 * _percentile(gaps, 0.99),
            "tokens_per_request": runs[-1]["tokens"] / u,
        }
    return out


def single(args) -> dict:
    """One session round rings of 1, 2 and 3 stages against ``model.generate`` (issue 8)."""
    tokens = args.tokens or (16 if args.quick else 128)
    repeats = args.repeats or (2 if args.quick else 5)

    import torch
    from transformers import AutoModelForCausalLM

    from swarmp2p.models import resolve_model_ref
    from swarmp2p.serve.local import LocalRing, even_bounds
    from swarmp2p.serve.text import TextCodec

    torch.set_num_threads(args.threads)
    # quick mode (CI: it cannot rot) rings a tiny random Llama: the same code, little compute
    tmp = tempfile.mkdtemp() if args.quick else None
    ref = _tiny_served_folder(tmp) if tmp else "embedded"
    folder = resolve_model_ref(ref)
    prompt_ids = TextCodec.from_folder(folder).encode_chat(PROMPT)
    blocks = json.loads((Path(folder) / "config.json").read_text())["num_hidden_layers"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rings = {}
    results: dict[str, dict[str, list[float]]] = {}
    same_tokens = True
    try:
        for n in (1, 2, 3):
            rings[n] = LocalRing(
                ref,
                bounds=even_bounds(blocks, n),
                threads=args.threads,
                max_context=len(prompt_ids) + tokens + 8,
                max_sessions=2,
            )
        setups = {"generate": None, **{f"stages_{n}": rings[n] for n in (1, 2, 3)}}
        reference = None
        for name in setups:
            results[name] = {"ttft": [], "tok_s": []}
        # a warm-up of each (first-call allocations), not counted
        _generate_run(model, prompt_ids, 4)
        for n in (1, 2, 3):
            _ring_run(rings[n], prompt_ids, 4)
        for _ in range(repeats):
            for name, ring in setups.items():
                if ring is None:
                    ttft, tok_s, ids = _generate_run(model, prompt_ids, tokens)
                    reference = ids
                else:
                    ttft, tok_s, ids = _ring_run(ring, prompt_ids, tokens)
                    same_tokens = same_tokens and ids == reference
                results[name]["ttft"].append(ttft)
                results[name]["tok_s"].append(tok_s)
    finally:
        for ring in rings.values():
            ring.close()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    tok_s = {name: statistics.median(r["tok_s"]) for name, r in results.items()}
    if tmp:  # the rings above were tiny already
        tiny = {n: 1000 / tok_s[f"stages_{n}"] for n in (1, 2, 3)}
    else:
        tiny = _tiny_hop_ms(args.threads, tokens, repeats)
    tiny_hop = statistics.median((tiny[n] - tiny[1]) / (n - 1) for n in (2, 3))
    tok_s = {name: statistics.median(r["tok_s"]) for name, r in results.items()}
    ttft = {name: statistics.median(r["ttft"]) * 1000 for name, r in results.items()}
    per_token_ms = {name: 1000 / v for name, v in tok_s.items()}
    hop_ms = statistics.median(
        (per_token_ms[f"stages_{n}"] - per_token_ms["stages_1"]) / (n - 1) for n in (2, 3)
    )
    summary = {
        "generate_tok_s": round(tok_s["generate"], 2),
        "stages_1_tok_s": round(tok_s["stages_1"], 2),
        "stages_2_tok_s": round(tok_s["stages_2"], 2),
        "stages_3_tok_s": round(tok_s["stages_3"], 2),
        "ratio_1": round(tok_s["stages_1"] / tok_s["generate"], 3),
        "ratio_2": round(tok_s["stages_2"] / tok_s["generate"], 3),
        "ratio_3": round(tok_s["stages_3"] / tok_s["generate"], 3),
        "ttft_ms": {name: round(v, 1) for name, v in ttft.items()},
        "hop_ms": round(hop_ms, 3),
        "hop_ms_tiny": round(tiny_hop, 3),
        "tiny_ms_per_token": {f"stages_{n}": round(v, 3) for n, v in tiny.items()},
        "same_tokens": same_tokens,
        "tokens": tokens,
        "prompt_tokens": len(prompt_ids),
        "repeats": repeats,
        "threads": args.threads,
    }
    print(
        f"{'tiny random Llama' if tmp else 'embedded SmolLM2-135M'}, float32, {len(prompt_ids)}-token prompt, {tokens} new tokens, "
        f"{args.threads} thread(s) per process, median of {repeats}"
    )
    print()
    print("| setup | decode tok/s | ms/token | x generate | TTFT ms |")
    print("|---|---|---|---|---|")
    for name in setups:
        print(
            f"| {name} | {tok_s[name]:.1f} | {per_token_ms[name]:.2f} | "
            f"{tok_s[name] / tok_s['generate']:.3f} | {ttft[name]:.1f} |"
        )
    print()
    print(f"per-hop overhead: {hop_ms:.3f} ms/token; greedy tokens equal generate's: {same_tokens}")
    print(
        f"per-hop overhead with a tiny model (compute negligible): {tiny_hop:.3f} ms/token "
        f"({', '.join(f'{n} stage(s) {v:.2f} ms' for n, v in tiny.items())})"
    )
    return summary


def http(args) -> dict:
    """Many users at once through HTTP: the table and the JSON keys."""
    users = (1, 8) if args.quick else CONCURRENCY
    tokens = args.conc_tokens or (16 if args.quick else 64)
    repeats = args.conc_repeats or (1 if args.quick else 3)
    with tempfile.TemporaryDirectory() as tmp:
        model = _tiny_served_folder(tmp) if args.quick else "embedded"
        stages = (1, 2) if args.quick else (1, 2, 3)
        table = concurrency(
            model,
            stages=stages,
            users=users,
            tokens=tokens,
            repeats=repeats,
            baseline_root=args.baseline_root,
        )
    name = "tiny random Llama (embedded tokenizer)" if args.quick else "embedded SmolLM2-135M"
    print()
    print(
        f"{name} through HTTP (openai client, streamed chat, greedy), {tokens} tokens per "
        f"request, one thread per stage; generate: a batch of the same size, as many threads "
        f"as stages (and with 1 thread); median of {repeats}"
        + ("; `before`: the same ring from the baseline checkout" if args.baseline_root else "")
    )
    print()
    print(
        "| stages | users | ring tok/s | generate(batch) tok/s | x generate | x generate 1 thread "
        "| x generate packed | x 1 user | TTFT p50/p99 ms | inter-token p50/p99 ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (n, u), r in table.items():
        single_user = table[n, 1]["tok_s"]
        label = f"{HEADLINE_STAGES} (before)" if n == "before" else str(n)
        print(
            f"| {label} | {u} | {r['tok_s']:.1f} | {r['generate_tok_s']:.1f} | "
            f"{r['tok_s'] / r['generate_tok_s']:.2f} | "
            f"{r['tok_s'] / r['generate_1_thread_tok_s']:.2f} | "
            f"{r['tok_s'] / r['generate_packed_tok_s']:.2f} | {r['tok_s'] / single_user:.2f} | "
            f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
            f"{r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} |"
        )
    head = table[HEADLINE_STAGES, 8]
    summary = {
        "conc_8_tok_s": round(head["tok_s"], 2),
        "generate_batch_8_tok_s": round(head["generate_tok_s"], 2),
        "ratio_conc_8": round(head["tok_s"] / head["generate_tok_s"], 3),
        "generate_packed_batch_8_tok_s": round(head["generate_packed_tok_s"], 2),
        "ratio_conc_8_packed": round(head["tok_s"] / head["generate_packed_tok_s"], 3),
        "conc_8_over_single": round(head["tok_s"] / table[HEADLINE_STAGES, 1]["tok_s"], 3),
        "http_single_ratio": round(table[1, 1]["tok_s"] / table[1, 1]["generate_tok_s"], 3),
        "conc_headline_stages": HEADLINE_STAGES,
        "conc_tokens": tokens,
        "concurrency": {
            f"stages_{n}_users_{u}": {k: round(v, 2) for k, v in r.items()}
            for (n, u), r in table.items()
        },
    }
    if ("before", 8) in table:
        summary["before_conc_8_tok_s"] = round(table["before", 8]["tok_s"], 2)
        summary["before_conc_8_over_single"] = round(
            table["before", 8]["tok_s"] / table["before", 1]["tok_s"], 3
        )
    return summary


USERS = 4
"""The daemons section's second round: as many users at once as ``swarm serve`` admits by
default (``--max-sessions``)."""


def _daemons_env() -> dict[str, str]:
    """The loopback daemons' environment: this checkout on the path, a fresh swarm token, no
    dashboard, and none of the caller's SWARM_ or thread settings (the daemons choose)."""
    from swarmp2p.net.security import SwarmSecret

    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SWARM_") and k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
    }
    env.update(
        PYTHONPATH=str(Path(__file__).resolve().parents[1]),
        SWARM_TOKEN=SwarmSecret.generate().token,
        SWARM_DASHBOARD_PORT="off",
    )
    return env


def daemons(args) -> dict:
    """One user's streamed chat through ``swarm serve`` on two loopback daemons (the user's own
    path: the issuing daemon's API, its ring client, stage workers its daemons started, with the
    threads the daemons give them) against ``model.generate`` with its default threads (every
    core) and on a packed copy, alternated in one run."""
    import openai
    import torch
    from _swarm import LoopbackSwarm, free_port
    from _swarm import wait as wait_for
    from transformers import AutoModelForCausalLM

    from swarmp2p.models import resolve_model_ref
    from swarmp2p.runtime.torch.model.packed import pack_linears
    from swarmp2p.serve.text import TextCodec

    tokens = args.tokens or (16 if args.quick else 128)
    repeats = args.repeats or (2 if args.quick else 5)
    threads = os.cpu_count() or 1  # what generate takes by default: every core
    with tempfile.TemporaryDirectory() as tmp:
        ref = _tiny_served_folder(str(Path(tmp) / "tiny")) if args.quick else "embedded"
        folder = resolve_model_ref(ref)
        prompt_ids = TextCodec.from_folder(folder).encode_chat(PROMPT)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        packed = copy.deepcopy(model)
        pack_linears(packed)
        env = _daemons_env()  # the daemons choose their stages' threads as for a user
        ring: list[float] = []
        gen: list[float] = []
        gen_packed: list[float] = []
        many: list[float] = []
        gen_many: list[float] = []
        with LoopbackSwarm("ab", Path(tmp), env=env, heartbeat=0.5, failure_timeout=3.0) as sw:
            try:
                wait_for(lambda: sw.ready("a") and sw.ready("b"), 90, "the swarm")
                port = free_port()
                out = sw.cli(
                    "b",
                    "serve",
                    folder,
                    "--name",
                    "bench",
                    "--stages",
                    "2",
                    "--port",
                    str(port),
                    *args.serve_flags,
                    "--json",
                    timeout=600,
                )
                if out.returncode != 0:
                    raise SystemExit(f"swarm serve failed: {out.stderr}\n{sw.log_tail()}")
                view = json.loads(out.stdout)
                client = openai.OpenAI(
                    base_url=view["url"].rstrip("/") + "/v1",
                    api_key="unused",
                    max_retries=0,
                    timeout=600,
                )
                _http_round(client, "bench", 1, 4)  # warm-up, not counted
                _generate_batch(model, prompt_ids, 1, 4, threads)
                _generate_batch(packed, prompt_ids, 1, 4, threads)
                for _ in range(repeats):
                    ring.append(_http_round(client, "bench", 1, tokens)["tok_s"])
                    gen.append(_generate_batch(model, prompt_ids, 1, tokens, threads))
                    gen_packed.append(_generate_batch(packed, prompt_ids, 1, tokens, threads))
                    many.append(_http_round(client, "bench", USERS, tokens)["tok_s"])
                    gen_many.append(_generate_batch(packed, prompt_ids, USERS, tokens, threads))
                nodes = [s["node"] for s in view["stages"]]
                stage_threads = _stage_threads(sw)
            except BaseException:
                print(sw.log_tail(), file=sys.stderr)
                raise
    r, g, gp, m, gm = (statistics.median(v) for v in (ring, gen, gen_packed, many, gen_many))
    name = "tiny random Llama (embedded tokenizer)" if args.quick else "embedded SmolLM2-135M"
    print()
    print(
        f"{name}: one streamed chat (openai client, greedy, {tokens} tokens, prefill included) "
        f"through `swarm serve --stages 2` on two loopback daemons (stages on {nodes}), "
        f"with {stage_threads} thread(s) per stage, against `generate` in one process with "
        f"{threads} thread(s) (every core, its default); median of {repeats}, alternated"
    )
    print()
    print("| setup | tok/s | x generate | x generate packed |")
    print("|---|---|---|---|")
    print(f"| swarm serve, 2 daemons | {r:.1f} | {r / g:.2f} | {r / gp:.2f} |")
    print(f"| generate | {g:.1f} | 1.00 | {g / gp:.2f} |")
    print(f"| generate, packed copy | {gp:.1f} | {gp / g:.2f} | 1.00 |")
    print()
    print(
        f"{USERS} users at once (the default --max-sessions), aggregate tok/s: swarm serve "
        f"{m:.1f}, `generate({USERS})` on the packed copy {gm:.1f}: {m / gm:.2f}x"
    )
    return {
        "daemons_tok_s": round(r, 2),
        "daemons_generate_tok_s": round(g, 2),
        "daemons_generate_packed_tok_s": round(gp, 2),
        "daemons_ratio": round(r / g, 3),
        "daemons_ratio_packed": round(r / gp, 3),
        "daemons_tokens": tokens,
        "daemons_users": USERS,
        "daemons_users_tok_s": round(m, 2),
        "daemons_users_generate_packed_tok_s": round(gm, 2),
        "daemons_users_ratio_packed": round(m / gm, 3),
        "daemons_stage_threads": stage_threads,
        "daemons_generate_threads": threads,
    }


SYSTEM_RULES = 66
"""Rules in the prefix section's system prompt: about 1,000 tokens of the embedded tokenizer
(``--quick``: 20, within the tiny model's 512 positions)."""


def _system_prompt(nonce: int, rules: int = SYSTEM_RULES) -> str:
    """A long system prompt; ``nonce`` first, so two nonces share no cached block."""
    rules = " ".join(
        f"Rule {i}: answer politely and precisely about topic {i}." for i in range(rules)
    )
    return f"Session {nonce}. You are a careful assistant. {rules}"


def _first_token_s(client, model: str, system: str, question: str) -> float:
    """Seconds from a streamed greedy chat request to its first content chunk."""
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        temperature=0,
        max_tokens=2,
        stream=True,
    )
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - started
    return first if first is not None else time.perf_counter() - started


def prefix(args) -> dict:
    """Time to first token of a session sharing a ~1,000-token system prompt with the one before
    it (warm: the prefix cache holds the prompt's blocks on both stages) over a session whose
    system prompt no earlier one had (cold), through ``swarm serve --stages 2`` on two
    loopback daemons; cold and warm alternate in one run."""
    import openai
    from _swarm import LoopbackSwarm, free_port
    from _swarm import wait as wait_for

    from swarmp2p.models import resolve_model_ref
    from swarmp2p.serve.text import TextCodec

    repeats = args.repeats or (2 if args.quick else 5)
    rules = 20 if args.quick else SYSTEM_RULES
    with tempfile.TemporaryDirectory() as tmp:
        ref = _tiny_served_folder(str(Path(tmp) / "tiny")) if args.quick else "embedded"
        folder = resolve_model_ref(ref)
        system_tokens = len(
            TextCodec.from_folder(folder).encode_chat(
                [{"role": "system", "content": _system_prompt(0, rules)}]
            )
        )
        env = _daemons_env()
        cold: list[float] = []
        warm: list[float] = []
        with LoopbackSwarm("ab", Path(tmp), env=env, heartbeat=0.5, failure_timeout=3.0) as sw:
            try:
                wait_for(lambda: sw.ready("a") and sw.ready("b"), 90, "the swarm")
                port = free_port()
                out = sw.cli(
                    "b", "serve", folder, "--name", "bench", "--stages", "2",
                    "--port", str(port), *args.serve_flags, "--json", timeout=600,
                )  # fmt: skip
                if out.returncode != 0:
                    raise SystemExit(f"swarm serve failed: {out.stderr}\n{sw.log_tail()}")
                view = json.loads(out.stdout)
                client = openai.OpenAI(
                    base_url=view["url"].rstrip("/") + "/v1", api_key="unused", max_retries=0,
                    timeout=600,
                )  # fmt: skip
                _first_token_s(client, "bench", _system_prompt(-1, rules), "Hello?")  # warm-up
                for i in range(repeats):
                    system = _system_prompt(i, rules)
                    cold.append(_first_token_s(client, "bench", system, "What is topic 3?"))
                    warm.append(_first_token_s(client, "bench", system, "And topic 7?"))
                status = sw.cli("b", "status", "--json", timeout=60)
                served = json.loads(status.stdout).get("served") or [{}]
                stats = (served[0].get("sessions") or {}).get("prefix_cache")
            except BaseException:
                print(sw.log_tail(), file=sys.stderr)
                raise
    c, w = statistics.median(cold), statistics.median(warm)
    name = "tiny random Llama (embedded tokenizer)" if args.quick else "embedded SmolLM2-135M"
    print()
    print(
        f"{name}: time to first token of a chat whose {system_tokens}-token system prompt an "
        f"earlier session had (warm) against one whose system prompt is new (cold), through "
        f"`swarm serve --stages 2` on two loopback daemons; median of {repeats}, alternated"
    )
    print()
    print("| session | TTFT (ms) | x cold |")
    print("|---|---|---|")
    print(f"| cold | {c * 1e3:.0f} | 1.00 |")
    print(f"| warm (prefix cached) | {w * 1e3:.0f} | {w / c:.2f} |")
    print(f"\nprefix cache after the run: {stats}")
    return {
        "prefix_system_tokens": system_tokens,
        "prefix_cold_ttft_s": round(c, 4),
        "prefix_warm_ttft_s": round(w, 4),
        "prefix_ttft_ratio": round(w / c, 3),
        "prefix_cache": stats,
    }


def _stage_threads(sw) -> list[int]:
    """The intra-op threads of each serve stage worker the daemons started (its
    ``OMP_NUM_THREADS``, read from /proc: what the daemon gave it)."""
    found = []
    daemons = {p.pid for p in sw.procs}
    for pid in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if b"serve_worker" not in cmd or parent not in daemons:
                continue
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"OMP_NUM_THREADS="):
                found.append(int(item.split(b"=", 1)[1]))
    return sorted(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats (<3 min)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens generated per run")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    parser.add_argument("--conc-tokens", type=int, default=None, help="tokens per HTTP request")
    parser.add_argument("--conc-repeats", type=int, default=None)
    parser.add_argument("--only", choices=("single", "http", "daemons", "prefix"), default=None)
    parser.add_argument(
        "--serve-flags",
        nargs="*",
        default=[],
        help="the daemons section: more `swarm serve` flags (default: none, a user's defaults)",
    )
    parser.add_argument(
        "--baseline-root",
        default=None,
        help="another checkout (the code before a change) to serve the headline ring too",
    )
    args = parser.parse_args()
    summary: dict = {}
    if args.only in (None, "single"):
        summary.update(single(args))
    if args.only in (None, "http"):
        summary.update(http(args))
    if args.only in (None, "daemons"):
        summary.update(daemons(args))
    if args.only in (None, "prefix"):
        summary.update(prefix(args))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
