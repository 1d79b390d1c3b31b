"""Speculative decoding across the serving ring (issue 27 item 1): one greedy session on a ring
of stage worker processes of the embedded model with ``--speculate auto`` and ``ngram``, against
the same ring with ``none``, and against transformers' ``generate`` with and without
``prompt_lookup_num_tokens=10`` on a copy packed the way a CPU stage packs its layers (the same
kernels). Two workloads from ``bench/speculate_prompts.json``: input-grounded prompts whose
answers copy long spans of the prompt (repeat a passage, edit a function and print it again,
fill a template) and open-ended ones. Every setup generates ``--tokens`` tokens (eos ignored);
tok/s is tokens over the time from the request to the last token (prefill included on every
side). The runs alternate setup by setup ``--repeats`` times and medians are reported (the box
is shared). Acceptance is the share of drafted tokens the last stage kept; tokens/lap the
mean tokens one decode lap of the ring gave. Targets (issue 27): grounded, speculative ring
over the ``none`` ring >= 2.0x on 2 stages and >= 1.0x ``generate(prompt_lookup_num_tokens=10)``
packed; open-ended >= 0.95x the plain ring.

``--draft``: speculative decoding by a draft model at stage 0 instead (``--speculate draft``).
There is no second real model offline, so the embedded model drafts for itself (every greedy
draft kept: the mechanism's upper bound, at a drafter as costly as the target) and a truncated
copy of it (its first ``--draft-layers`` blocks, its norm and head: a realistic weaker drafter)
drafts too (``draft``: 10 a lap; and ``auto``: adaptive), each against the same ring with
``none``; the table gives acceptance, tokens/lap,
tok/s over ``none`` and the measured cost of a drafted token in plain laps (the lap's time
over a plain lap's, less one, per drafted token: what ``DRAFT_LAP_COST`` prices).

Prints a markdown table, then as its last line one JSON object.

    python bench/speculate.py [--quick] [--tokens N] [--repeats R] [--stages S] [--threads T]
    python bench/speculate.py --draft [--draft-layers L] [...]
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
PROMPTS = HERE / "speculate_prompts.json"
LOOKUP = 10
"""transformers' ``prompt_lookup_num_tokens`` (its documented example's value)."""
RINGS = ("auto", "ngram", "none")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def _generate(model, ids: list[int], tokens: int, lookup: int | None) -> tuple[float, list[int]]:
    import torch

    kw = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    x = torch.tensor([ids])
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=2,
            **kw,
        )
        took = time.perf_counter() - start
    return tokens / took, out[0, len(ids) :].tolist()


def _ring(ring, ids: list[int], tokens: int) -> tuple[float, list[int], dict]:
    before = ring.client.spec_stats()
    start = time.perf_counter()
    got = ring.client.generate(ids, max_tokens=tokens, timeout=600)
    took = time.perf_counter() - start
    after = ring.client.spec_stats()
    delta = {k: after[k] - before[k] for k in ("laps", "tokens", "drafted", "accepted")}
    return tokens / took, got, delta


def _local_ring(ref: str, args, blocks: int, context: int, speculate: str, draft=None):
    """A ring of ``args.stages`` worker processes of ``ref`` (two session slots)."""
    from swarmp2p.serve.local import LocalRing, even_bounds

    return LocalRing(
        ref,
        bounds=even_bounds(blocks, args.stages),
        threads=args.threads,
        max_context=context,
        max_sessions=2,
        speculate=speculate,
        draft=draft,
    )


def _workloads(ref: str) -> tuple[str, dict[str, list[list[int]]], int, int]:
    """The model's folder, the prompts of each workload as token ids (chat-templated), the
    longest prompt's length and the model's block count."""
    from swarmp2p.models import resolve_model_ref
    from swarmp2p.serve.text import TextCodec

    folder = resolve_model_ref(ref)
    codec = TextCodec.from_folder(folder)
    workloads = json.loads(PROMPTS.read_text())
    prompts = {
        kind: [codec.encode_chat(p["messages"]) for p in entries]
        for kind, entries in workloads.items()
    }
    longest = max(len(p) for ps in prompts.values() for p in ps)
    blocks = json.loads((Path(folder) / "config.json").read_text())["num_hidden_layers"]
    return folder, prompts, longest, blocks


def _truncated_folder(source: str, folder: str, layers: int) -> str:
    """A copy of the model in ``source`` keeping its first ``layers`` blocks, norm and head,
    saved in ``folder`` with the source's tokenizer files."""
    import torch
    from transformers import AutoModelForCausalLM

    from swarmp2p.runtime.torch.serve.draft import truncated_copy

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    truncated_copy(model, layers).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            shutil.copy(Path(source) / name, Path(folder) / name)
    return folder


def _draft_seconds(folder: str, ids: list[int], k: int = 8, runs: int = 3) -> float:
    """Seconds one drafted token takes the draft model in ``folder`` in this process (its
    cache warm: the prompt fed first), the median of ``runs`` drafts of ``k``."""
    import torch
    from transformers import AutoModelForCausalLM

    from swarmp2p.runtime.torch.serve.draft import DraftModel

    drafter = DraftModel(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
    drafter.open(1, None)
    drafter.extend(1, 0, ids[:-1])
    drafter.propose(1, len(ids) - 1, ids[-1], 1)  # the prompt into its cache
    took = []
    for _ in range(runs):
        start = time.perf_counter()
        drafter.propose(1, len(ids) - 1, ids[-1], k)  # rolled back to the prompt each time
        took.append((time.perf_counter() - start) / k)
    return statistics.median(took)


def _draft_main(args, tokens: int, repeats: int) -> None:
    """``--draft``: the self-drafting and the truncated-drafter rings against ``none``."""
    import torch
    from serve import _tiny_served_folder

    torch.set_num_threads(args.threads)
    tmp = tempfile.mkdtemp()
    ref = _tiny_served_folder(tmp + "/model") if args.quick else "embedded"
    folder, prompts, longest, blocks = _workloads(ref)
    layers = min(args.draft_layers, blocks)
    drafts = {"self": folder, "truncated": _truncated_folder(folder, tmp + "/draft", layers)}
    drafts["truncated_auto"] = drafts["truncated"]
    setups = ("self", "truncated", "truncated_auto", "none")
    modes = {"self": "draft", "truncated": "draft", "truncated_auto": "auto", "none": "none"}
    rings: dict = {}
    tok_s: dict = {}
    spec: dict = {}
    lap_s: dict = {}
    same = True
    try:
        for setup in setups:
            context = longest + tokens + 16
            rings[setup] = _local_ring(ref, args, blocks, context, modes[setup], drafts.get(setup))
        for ring in rings.values():  # warm-up, not counted
            _ring(ring, prompts["open"][0], 4)
        for kind, ps in prompts.items():
            for setup in setups:
                tok_s[kind, setup], lap_s[kind, setup] = [], []
                spec[kind, setup] = {"laps": 0, "tokens": 0, "drafted": 0, "accepted": 0}
            for _ in range(repeats):
                for ids in ps:
                    reference = None
                    for setup in setups:
                        rate, got, delta = _ring(rings[setup], ids, tokens)
                        tok_s[kind, setup].append(rate)
                        # seconds a decode lap took (the first token's prefill included)
                        lap_s[kind, setup].append(tokens / rate / max(1, delta["laps"] or tokens))
                        for k, v in delta.items():
                            spec[kind, setup][k] += v
                        reference = got if reference is None else reference
                        same = same and got == reference
        forward_s = {
            s: _draft_seconds(drafts[s], prompts["open"][0]) for s in ("self", "truncated")
        }
    finally:
        for ring in rings.values():
            ring.close()
        shutil.rmtree(tmp, ignore_errors=True)

    med = {key: statistics.median(v) for key, v in tok_s.items()}
    lap = {key: statistics.median(v) for key, v in lap_s.items()}
    plain_lap = statistics.median(lap[kind, "none"] for kind in prompts)
    summary: dict = {
        "model": "tiny random Llama" if args.quick else "embedded SmolLM2-135M",
        "mode": "draft",
        "draft_layers": layers,
        "blocks": blocks,
        "stages": args.stages,
        "tokens": tokens,
        "repeats": repeats,
        "threads": args.threads,
        "same_tokens": same,
    }
    print(
        f"{summary['model']}, float32, {args.stages} stages, {tokens} new tokens, "
        f"{args.threads} thread(s) per process, median of {repeats} x each prompt; drafters: "
        f"the model itself and its first {layers} of {blocks} blocks + head"
    )
    print()
    print(
        "| workload | drafter | tok/s | x ring none | acceptance | tokens/lap | "
        "drafted/lap | cost of a drafted token (plain laps) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for kind in prompts:
        summary[kind] = {"none_tok_s": round(med[kind, "none"], 2)}
        for setup in ("self", "truncated", "truncated_auto"):
            s = spec[kind, setup]
            acceptance = s["accepted"] / s["drafted"] if s["drafted"] else 0.0
            per_lap = s["tokens"] / s["laps"] if s["laps"] else 0.0
            drafted_lap = s["drafted"] / s["laps"] if s["laps"] else 0.0
            cost = (lap[kind, setup] / lap[kind, "none"] - 1) / drafted_lap if drafted_lap else 0.0
            row = {
                "tok_s": round(med[kind, setup], 2),
                "over_none": round(med[kind, setup] / med[kind, "none"], 3),
                "acceptance": round(acceptance, 3),
                "tokens_per_lap": round(per_lap, 3),
                "drafted_per_lap": round(drafted_lap, 3),
                "drafted_token_lap_cost": round(cost, 3),
            }
            summary[kind][setup] = row
            print(
                f"| {kind} | {setup} | {row['tok_s']:.1f} | {row['over_none']:.2f} | "
                f"{acceptance:.0%} | {per_lap:.2f} | {drafted_lap:.2f} | {cost:.3f} |"
            )
    print()
    for setup, seconds in forward_s.items():
        summary[f"draft_forward_{setup}_s"] = round(seconds, 5)
        summary[f"draft_forward_{setup}_laps"] = round(seconds / plain_lap, 3)
        print(
            f"the {setup} drafter's forward per drafted token, in this process: "
            f"{seconds * 1000:.1f} ms = {seconds / plain_lap:.3f} plain laps"
        )
    print(f"greedy tokens of the draft rings and the none ring equal: {same}")
    print(json.dumps(summary))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny random Llama, few tokens")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    parser.add_argument("--draft", action="store_true", help="a draft model at stage 0")
    parser.add_argument(
        "--draft-layers", type=int, default=4, help="blocks of the truncated drafter"
    )
    args = parser.parse_args()
    tokens = args.tokens or (16 if args.quick else 96)
    repeats = args.repeats or (1 if args.quick else 3)
    if args.draft:
        _draft_main(args, tokens, repeats)
        return

    import torch
    from serve import _tiny_served_folder
    from transformers import AutoModelForCausalLM

    from swarmp2p.runtime.torch.model.packed import pack_linears

    torch.set_num_threads(args.threads)
    tmp = tempfile.mkdtemp() if args.quick else None
    ref = _tiny_served_folder(tmp) if tmp else "embedded"
    folder, prompts, longest, blocks = _workloads(ref)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    packed = copy.deepcopy(model)
    pack_linears(packed)
    rings = {}
    tok_s: dict = {}
    spec: dict = {}
    same = True
    try:
        for mode in RINGS:
            rings[mode] = _local_ring(ref, args, blocks, longest + tokens + 16, mode)
        for ring in rings.values():  # warm-up, not counted
            _ring(ring, prompts["open"][0], 4)
        _generate(packed, prompts["open"][0], 4, None)
        for kind, ps in prompts.items():
            for setup in (*RINGS, "generate", "generate_lookup"):
                tok_s[kind, setup] = []
            for mode in RINGS:
                spec[kind, mode] = {"laps": 0, "tokens": 0, "drafted": 0, "accepted": 0}
            for _ in range(repeats):
                for ids in ps:
                    reference = None
                    for mode in RINGS:
                        rate, got, delta = _ring(rings[mode], ids, tokens)
                        tok_s[kind, mode].append(rate)
                        for k, v in delta.items():
                            spec[kind, mode][k] += v
                        reference = got if reference is None else reference
                        same = same and got == reference
                    rate, _ = _generate(packed, ids, tokens, None)
                    tok_s[kind, "generate"].append(rate)
                    rate, _ = _generate(packed, ids, tokens, LOOKUP)
                    tok_s[kind, "generate_lookup"].append(rate)
    finally:
        for ring in rings.values():
            ring.close()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    med = {key: statistics.median(v) for key, v in tok_s.items()}
    summary: dict = {
        "model": "tiny random Llama" if tmp else "embedded SmolLM2-135M",
        "stages": args.stages,
        "tokens": tokens,
        "repeats": repeats,
        "threads": args.threads,
        "same_tokens": same,
    }
    print(
        f"{summary['model']}, float32, {args.stages} stages, {tokens} new tokens, "
        f"{args.threads} thread(s) per process, median of {repeats} x each prompt"
    )
    print()
    print(
        "| workload | ring auto tok/s | x ring none | ring ngram x none | x generate(lookup=10) "
        "packed | x generate packed | acceptance (auto) | tokens/lap (auto) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for kind in prompts:
        s = spec[kind, "auto"]
        acceptance = s["accepted"] / s["drafted"] if s["drafted"] else 0.0
        per_lap = s["tokens"] / s["laps"] if s["laps"] else 0.0
        row = {
            "auto_tok_s": round(med[kind, "auto"], 2),
            "ngram_tok_s": round(med[kind, "ngram"], 2),
            "none_tok_s": round(med[kind, "none"], 2),
            "generate_packed_tok_s": round(med[kind, "generate"], 2),
            "generate_lookup_packed_tok_s": round(med[kind, "generate_lookup"], 2),
            "auto_over_none": round(med[kind, "auto"] / med[kind, "none"], 3),
            "ngram_over_none": round(med[kind, "ngram"] / med[kind, "none"], 3),
            "auto_over_generate_lookup": round(med[kind, "auto"] / med[kind, "generate_lookup"], 3),
            "auto_over_generate": round(med[kind, "auto"] / med[kind, "generate"], 3),
            "acceptance_auto": round(acceptance, 3),
            "tokens_per_lap_auto": round(per_lap, 3),
            "acceptance_ngram": round(
                spec[kind, "ngram"]["accepted"] / max(1, spec[kind, "ngram"]["drafted"]), 3
            ),
            "tokens_per_lap_ngram": round(
                spec[kind, "ngram"]["tokens"] / max(1, spec[kind, "ngram"]["laps"]), 3
            ),
        }
        summary[kind] = row
        print(
            f"| {kind} | {row['auto_tok_s']:.1f} | {row['auto_over_none']:.2f} | "
            f"{row['ngram_over_none']:.2f} | {row['auto_over_generate_lookup']:.2f} | "
            f"{row['auto_over_generate']:.2f} | {acceptance:.0%} | {per_lap:.2f} |"
        )
    print()
    print(f"greedy tokens of auto, ngram and none rings equal: {same}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
