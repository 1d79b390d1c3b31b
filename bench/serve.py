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

Prints a markdown table, then as its last line one JSON object.

    python bench/serve.py [--quick] [--tokens N] [--repeats R] [--threads T]
"""

from __future__ import annotations

import argparse
import json
import statistics
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
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats (<3 min)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens generated per run")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    args = parser.parse_args()
    tokens = args.tokens or (32 if args.quick else 128)
    repeats = args.repeats or 5

    import torch
    from transformers import AutoModelForCausalLM

    from swarmp2p.runtime.models import resolve_model_ref
    from swarmp2p.serve.local import LocalRing, even_bounds
    from swarmp2p.serve.text import TextCodec

    torch.set_num_threads(args.threads)
    folder = resolve_model_ref("embedded")
    prompt_ids = TextCodec.from_folder(folder).encode_chat(PROMPT)
    blocks = json.loads((Path(folder) / "config.json").read_text())["num_hidden_layers"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rings = {}
    results: dict[str, dict[str, list[float]]] = {}
    same_tokens = True
    try:
        for n in (1, 2, 3):
            rings[n] = LocalRing(
                "embedded",
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
        f"embedded SmolLM2-135M, float32, {len(prompt_ids)}-token prompt, {tokens} new tokens, "
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
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
