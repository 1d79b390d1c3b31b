"""Structured outputs' cost (issue 31): one user's tokens/s of ``json_schema``-constrained
decoding against unconstrained decoding on the same ring of stage worker processes of the
embedded model (``--quick``: a tiny random Llama with the embedded tokenizer, so the grammar's
cost is all there is), and what one constrained token costs in the last stage's Python: the
llguidance mask, its bitmask -> torch conversion, and advancing the matcher.

Greedy; the constrained reply ends where its JSON does (drafting off, ``json_schema``, and
on, ``json_schema+spec``: what a constrained request gets by default; the same tokens, or the
bench fails); the unconstrained one is asked for as many tokens (eos ignored), drafting off
(``plain``) and on (``plain+spec``: what an unconstrained request gets by default). tok/s is tokens over the time from the request to the last token (prefill included
on every side). Setups alternate ``--repeats`` times; medians. Target: constrained >= 0.8x
unconstrained (each with drafting off, and each as served by default). On a shared machine the end-to-end ratio moves with the load, so the grammar's own work
is also measured alone and set against a plain token's time (the ratio a quiet machine gives).

Prints a markdown table, then as its last line one JSON object.

    python bench/grammar.py [--quick] [--repeats R] [--stages S] [--threads T]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "maxLength": 32},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 32},
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "kind": {"enum": ["customer", "supplier", "staff"]},
    },
    "required": ["name", "age", "email", "tags", "address", "kind"],
    "additionalProperties": False,
}
ASK = [
    {
        "role": "user",
        "content": "Describe a customer named Ada Lovelace, 36, from London, as JSON with her "
        "name, age, email, a few tags, her address and kind.",
    }
]
SETUPS = ("json_schema", "json_schema+spec", "plain", "plain+spec")


def _timed(client, prompt, **kw) -> tuple[float, list[int]]:
    start = time.perf_counter()
    got = client.generate(prompt, timeout=600, **kw)
    return time.perf_counter() - start, got


def _per_token_us(codec, grammar, tokens: list[int], vocab: int) -> dict[str, float]:
    """Microseconds a constrained token spends in the last stage's grammar work, replaying
    ``tokens`` (the constrained reply) through a fresh matcher."""
    import torch

    from swarmp2p.runtime.torch.serve.sampling import allowed_ids
    from swarmp2p.serve.decoding.grammar import Matcher, ll_tokenizer

    llt = ll_tokenizer(codec.tokenizer, vocab_size=vocab, eos_ids=codec.eos_ids)
    spent = {"mask": 0.0, "to_torch": 0.0, "mask_logits": 0.0, "advance": 0.0}
    matcher = Matcher(llt, grammar)
    logits = torch.randn(1, vocab)
    for token in tokens:
        a = time.perf_counter()
        mask = matcher.mask()
        b = time.perf_counter()
        allowed = allowed_ids(mask, vocab)
        c = time.perf_counter()
        torch.where(allowed, logits, float("-inf"))  # as Sampler._scores applies it
        d = time.perf_counter()
        if token in codec.eos_ids:
            break
        matcher.advance(token)
        e = time.perf_counter()
        for key, seconds in zip(spent, (b - a, c - b, d - c, e - d), strict=True):
            spent[key] += seconds
    n = max(1, len(tokens))
    return {k: round(v / n * 1e6, 1) for k, v in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny random Llama, 1 repeat")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 5)

    from serve import _tiny_served_folder

    from swarmp2p.models import resolve_model_ref
    from swarmp2p.serve.decoding.grammar import grammar_for
    from swarmp2p.serve.local import LocalRing, even_bounds
    from swarmp2p.serve.text import TextCodec

    tmp = tempfile.mkdtemp() if args.quick else None
    ref = _tiny_served_folder(tmp) if tmp else "embedded"
    folder = Path(resolve_model_ref(ref))
    codec = TextCodec.from_folder(folder)
    config = json.loads((folder / "config.json").read_text())
    vocab, blocks = config["vocab_size"], config["num_hidden_layers"]
    grammar = grammar_for({"type": "json_schema", "json_schema": {"schema": PERSON}})
    prompt = codec.encode_chat(ASK)
    limit = 256
    took: dict[str, list[float]] = {s: [] for s in SETUPS}
    counts: dict[str, list[int]] = {s: [] for s in SETUPS}
    reply: list[int] = []
    try:
        with LocalRing(
            ref,
            bounds=even_bounds(blocks, args.stages),
            threads=args.threads,
            max_context=len(prompt) + limit + 16,
            max_sessions=2,
        ) as ring:
            client = ring.client
            constrained = dict(max_tokens=limit, stop_ids=codec.eos_ids, grammar=grammar.text)
            _timed(client, prompt, **constrained)  # warm-up (the stage's grammar tokenizer)
            _timed(client, prompt, max_tokens=8)
            for _ in range(repeats):
                for setup, spec in (("json_schema", False), ("json_schema+spec", True)):
                    seconds, got = _timed(client, prompt, speculate=spec, **constrained)
                    took[setup].append(seconds)
                    counts[setup].append(len(got))
                    if reply and got != reply:
                        raise SystemExit("the constrained reply changed with drafting: a bug")
                    reply = got
                for setup, spec in (("plain", False), ("plain+spec", True)):
                    seconds, got = _timed(client, prompt, max_tokens=len(reply), speculate=spec)
                    took[setup].append(seconds)
                    counts[setup].append(len(got))
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    text = codec.decode(reply)
    try:
        import jsonschema

        jsonschema.validate(json.loads(text), PERSON)
        valid = True
    except (ValueError, ImportError, jsonschema.ValidationError):
        valid = False
    rate = {
        s: statistics.median(n / t for n, t in zip(counts[s], took[s], strict=True)) for s in SETUPS
    }
    import torch

    torch.set_num_threads(args.threads)  # as a stage worker runs
    per_token = _per_token_us(codec, grammar, reply, vocab)
    summary = {
        "model": "tiny random Llama" if tmp else "embedded SmolLM2-135M",
        "stages": args.stages,
        "threads": args.threads,
        "repeats": repeats,
        "tokens": len(reply),
        "valid_json": valid,
        **{f"{s.replace('+', '_')}_tok_s": round(rate[s], 2) for s in SETUPS},
        "json_schema_over_plain": round(rate["json_schema"] / rate["plain"], 3),
        "json_schema_over_plain_spec": round(rate["json_schema"] / rate["plain+spec"], 3),
        "json_schema_spec_over_plain_spec": round(rate["json_schema+spec"] / rate["plain+spec"], 3),
        "grammar_us_per_token": per_token,
        # the grammar's own work against a plain token's time: the ratio a quiet machine gives
        "grammar_share_of_a_token": round(sum(per_token.values()) * 1e-6 * rate["plain"], 4),
        "expected_json_schema_over_plain": round(
            1 / (1 + sum(per_token.values()) * 1e-6 * rate["plain"]), 3
        ),
    }
    print(
        f"{summary['model']}, float32, {args.stages} stages, one user, greedy, "
        f"{len(reply)}-token reply to a nested json_schema, median of {repeats}"
    )
    print()
    print("| setup | tok/s | x plain |")
    print("|---|---|---|")
    for s in SETUPS:
        print(f"| {s} | {rate[s]:.1f} | {rate[s] / rate['plain']:.2f} |")
    print()
    print(
        "last stage's grammar work per constrained token: "
        + ", ".join(f"{k} {v:.0f} us" for k, v in per_token.items())
        + f" ({summary['grammar_share_of_a_token']:.1%} of a plain token's time, so "
        f"{summary['expected_json_schema_over_plain']:.2f}x where the machine is quiet); "
        f"the reply parses and validates: {valid}"
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
