"""The GPU benchmark: on the one card, ratios in one run.

- decode: greedy completions through ``swarm serve --stages 2`` on two loopback daemons that
  share the card (the user's path: HTTP API, ring client, both stage workers on ``cuda:0``),
  1 user and 8 at once, against ``model.generate`` on the card on a batch of the same size
  (aggregate tokens/s, prefill included on both sides, eos as each side meets it);
- training: ``swarm train`` of a 2-stage full fine-tune on those daemons (equal split) against
  torch.distributed.pipelining's Schedule1F1B with the same cut, two ranks on the card (NCCL,
  which may refuse two ranks on one device: then the row says so);
- bytes per boundary: what one step sends across the cut, forward and back, per compression
  (``bench/train_pipeline.boundary_bytes``; the bytes depend on the shape, not the device).

    python bench/gpu.py [--dry-run] [--docs PATH]

On a GPU it writes its section of ``docs/benchmarks.md`` (between the ``gpu`` markers, which
``bench/run_all.py`` keeps); ``--dry-run`` runs every part on the CPU in float32 at tiny sizes
(the plumbing, not the numbers; ``bench/gpu_check.sh --dry-run``, in CI) and writes the section
only to ``--docs``. ``bench/run_all.py`` leaves this script out: ``bench/gpu_check.sh`` runs it.
Prints markdown tables, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))  # _gpu: the tiny tokenizer

import train_pipeline as tp  # noqa: E402 (puts the checkout, bench/ and tests/integration first)
from serve import _generate_batch  # noqa: E402

DOCS = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- gpu:begin -->", "<!-- gpu:end -->"
PROMPT = "The lighthouse keeper climbed the stairs"
USERS = (1, 8)


def sizes(dry: bool) -> dict:
    """The model and the workloads: a 16-block Llama of width 1024 on the card, tiny dry."""
    if dry:
        return dict(layers=4, hidden=64, tokens=8, repeats=1, batch=4, seq=32, micro=2, steps=4)
    return dict(layers=16, hidden=1024, tokens=128, repeats=3, batch=8, seq=512, micro=4, steps=12)


def build_model(folder: Path, size: dict) -> Path:
    """A random Llama with the GPU tests' byte-level tokenizer (no download, no embedded
    model on the GPU machine), grouped-query heads of width 64."""
    import torch
    from _gpu import tiny_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = tiny_tokenizer(folder)
    hidden = size["hidden"]
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=size["layers"],
        num_attention_heads=max(hidden // 64, 4),
        num_key_value_heads=max(hidden // 256, 2),
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _complete(url: str, tokens: int) -> int:
    """One greedy completion through the API; the tokens it generated."""
    body = json.dumps(
        {"model": "bench", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0}
    ).encode()
    request = urllib.request.Request(
        f"{url.rstrip('/')}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())["usage"]["completion_tokens"]


def _api_round(url: str, users: int, tokens: int) -> float:
    """Aggregate tokens/s of ``users`` completions at once."""
    with concurrent.futures.ThreadPoolExecutor(users) as pool:
        start = time.perf_counter()
        done = list(pool.map(lambda _: _complete(url, tokens), range(users)))
    return sum(done) / (time.perf_counter() - start)


def _env(dry: bool) -> dict:
    from swarmp2p.net.security import SwarmSecret

    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env.update(PYTHONPATH=path, SWARM_TOKEN=SwarmSecret.generate().token)
    env.update(SWARM_SPEED_PROBE="off", SWARM_DASHBOARD_PORT="off")
    if dry:
        env["OMP_NUM_THREADS"] = "1"
    return env


def decode(folder: Path, size: dict, device: str, dtype: str) -> dict:
    """tokens/s through ``swarm serve --stages 2`` and of ``generate``, per user count."""
    import torch
    from _swarm import LoopbackSwarm, free_port, wait
    from transformers import AutoModelForCausalLM

    from swarmp2p.serve.text import TextCodec

    tokens, repeats = size["tokens"], size["repeats"]
    prompt_ids = TextCodec.from_folder(folder).encode(PROMPT)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    ring: dict[int, list[float]] = {u: [] for u in USERS}
    gen: dict[int, list[float]] = {u: [] for u in USERS}
    threads = torch.get_num_threads()
    with (
        tempfile.TemporaryDirectory() as tmp,
        LoopbackSwarm("ab", Path(tmp), env=_env(device == "cpu")) as sw,
    ):
        try:
            wait(lambda: sw.ready("a") and sw.ready("b"), 120, "the swarm")
            args = ["serve", str(folder), "--name", "bench", "--stages", "2"]
            args += ["--port", str(free_port()), "--dtype", dtype, "--max-context", "1024"]
            out = sw.cli("a", *args, "--max-sessions", str(max(USERS)), "--json", timeout=600)
            if out.returncode != 0:
                raise SystemExit(f"swarm serve failed: {out.stderr}")
            view = json.loads(out.stdout)
            _api_round(view["url"], 2, 4)  # warm-up, not counted
            _generate_batch(model, prompt_ids, 2, 4, threads)
            for _ in range(repeats):
                for u in USERS:
                    ring[u].append(_api_round(view["url"], u, tokens))
                    gen[u].append(_generate_batch(model, prompt_ids, u, tokens, threads))
            stages = [s["node"] for s in view["stages"]]
        except BaseException:
            print(sw.log_tail(), file=sys.stderr)
            raise
    return {
        "stages": stages,
        "tokens": tokens,
        **{f"serve_{u}_tok_s": statistics.median(ring[u]) for u in USERS},
        **{f"generate_{u}_tok_s": statistics.median(gen[u]) for u in USERS},
    }


def training(folder: Path, size: dict, device: str, dtype: str) -> dict:
    """Steady tokens/s of ``swarm train`` (equal split) and of torch pipelining, same cut."""
    args = argparse.Namespace(
        batch=size["batch"],
        seq=size["seq"],
        micro=size["micro"],
        steps=size["steps"],
        daemon_steps=size["steps"],
        warmup=2,
    )
    got = tp.run_daemons(folder, args, modes=("equal",), probe=False)["equal"]
    cut = got["layers"][0][1]
    tokens = args.batch * args.seq
    out = {"layers": got["layers"], "swarm_tok_s": got["tok_s"], "torch_pipelining_tok_s": None}
    try:
        steps = tp.run_torch_pipelining(
            folder, size["layers"], args, 1, cut=cut, device=device, dtype=dtype
        )
        out["torch_pipelining_tok_s"] = tokens / statistics.median(steps)
    except RuntimeError as exc:  # NCCL may refuse two ranks on one card
        out["torch_pipelining_error"] = str(exc)
    return out


def boundary(size: dict) -> dict:
    """Bytes per step across the cut (forward activations, backward gradients) per compression,
    measured on a 2-block copy of the model's shape (the bytes depend on width and tokens)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden = size["hidden"]
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=hidden,
        intermediate_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=max(hidden // 64, 4),
        num_key_value_heads=max(hidden // 256, 2),
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float()
    args = argparse.Namespace(batch=size["batch"], seq=size["seq"], micro=size["micro"])
    return tp.boundary_bytes(model, args)


def render(result: dict) -> str:
    """The markdown tables of a run (also the docs section's body)."""
    d, t = result["decode"], result["training"]
    lines = [
        f"## GPU: {result['device_name']}, {result['dtype']}"
        + (" (DRY RUN on the CPU: the numbers mean nothing)" if result["dry_run"] else ""),
        "",
        f"Model: random Llama, {result['size']['layers']} blocks of width "
        f"{result['size']['hidden']}; {result['date']}.",
        "",
        f"### Decode: `swarm serve --stages 2` (two daemons on one card) over `model.generate`, "
        f"{d['tokens']} tokens a request, prefill included",
        "",
        "| users | swarm serve tok/s | generate tok/s | ratio |",
        "|---|---|---|---|",
    ]
    for u in USERS:
        mine, theirs = d[f"serve_{u}_tok_s"], d[f"generate_{u}_tok_s"]
        lines.append(f"| {u} | {mine:.1f} | {theirs:.1f} | {mine / theirs:.2f}x |")
    s = result["size"]
    lines += [
        "",
        f"### Training: `swarm train` 2-stage full fine-tune over torch.distributed.pipelining "
        f"Schedule1F1B, the same cut {t['layers']}, batch {s['batch']} x {s['seq']}, "
        f"{s['micro']} micro-batches",
        "",
        "| run | tokens/s | ratio |",
        "|---|---|---|",
        f"| swarm train (2 daemons, one card) | {t['swarm_tok_s']:.1f} | - |",
    ]
    if t["torch_pipelining_tok_s"]:
        pp = t["torch_pipelining_tok_s"]
        lines.append(
            f"| torch pipelining (2 ranks, one card) | {pp:.1f} | {t['swarm_tok_s'] / pp:.2f}x |"
        )
    else:
        lines.append(f"| torch pipelining | failed: {t.get('torch_pipelining_error')} | - |")
    lines += ["", "### Bytes per step across the boundary", ""]
    lines += ["| compression | activations | gradients |", "|---|---|---|"]
    for label, b in result["bytes"].items():
        lines.append(f"| {label} | {b['act']} | {b['grad']} |")
    return "\n".join(lines)


def write_section(docs: Path, section: str) -> None:
    """Put ``section`` between the gpu markers of ``docs`` (appended when it has none)."""
    from swarmp2p._atomic import write_atomic

    text = docs.read_text(encoding="utf-8") if docs.is_file() else "# Benchmarks\n"
    block = f"{BEGIN}\n{section.strip()}\n{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    write_atomic(docs, text, mode=0o644)


def main(argv: list[str] | None = None) -> dict:
    import datetime as dt

    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="the CPU, float32, tiny sizes")
    parser.add_argument("--docs", type=Path, default=None, help=f"default {DOCS} on a GPU")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA GPU here: run on the GPU machine, or --dry-run on the CPU")
    dry = args.dry_run
    device = "cpu" if dry else "cuda:0"
    dtype = "float32" if dry or torch.cuda.get_device_capability(0) < (8, 0) else "bfloat16"
    size = sizes(dry)
    result: dict = {
        "dry_run": dry,
        "device_name": "CPU" if dry else torch.cuda.get_device_name(0),
        "dtype": dtype,
        "size": size,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(Path(tmp) / "model", size)
        started = time.perf_counter()
        result["decode"] = decode(folder, size, device, dtype)
        result["training"] = training(folder, size, device, dtype)
        result["bytes"] = boundary(size)
        result["seconds"] = round(time.perf_counter() - started, 1)
    markdown = render(result)
    print(markdown)
    docs = args.docs if args.docs is not None else (None if dry else DOCS)
    if docs is not None:
        write_section(docs, markdown)
        result["docs"] = str(docs)
    print()
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
