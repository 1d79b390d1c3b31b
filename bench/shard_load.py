"""Peak host RSS of loading half a model's blocks (load_stage_shard) vs the whole model, both in
bfloat16 from a float32 checkpoint (so every tensor needs a conversion), each in a fresh
subprocess, alternated and repeated. Prints a markdown table, then one JSON line.

    python bench/shard_load.py                      # the embedded model (SmolLM2-135M)
    python bench/shard_load.py --model PATH         # any local safetensors checkpoint
    python bench/shard_load.py --build-demo DIR     # write a ~540 MB float32 Llama to DIR first
    python bench/shard_load.py --quick              # a tiny model in a temp dir: checks it runs

Target (issue 4, from the reference's 2.23 vs 4.45 GB on a 1.19B model): stage/full <= 0.6.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = 0.6


def _child(kind: str, model: str) -> None:
    """Load one way and print this process's peak RSS in GB."""
    import torch

    sys.path.insert(0, str(ROOT))
    from swarmp2p.runtime.torch import load_stage_shard

    if kind == "baseline":
        import transformers  # noqa: F401  the imports alone, for reference
    elif kind == "full":
        from transformers import AutoModelForCausalLM

        from swarmp2p.runtime.torch.model.loader import _Checkpoint

        folder = _Checkpoint(model).folder
        loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        assert next(loaded.parameters()).dtype == torch.bfloat16
    else:
        from transformers import AutoConfig

        from swarmp2p.runtime.torch import decoder_config
        from swarmp2p.runtime.torch.model.loader import _Checkpoint

        folder = _Checkpoint(model).folder
        n = decoder_config(AutoConfig.from_pretrained(folder)).num_hidden_layers
        stage = load_stage_shard(model, 0, n // 2, True, False, torch.bfloat16)
        assert next(stage.parameters()).dtype == torch.bfloat16
    print(json.dumps({"kind": kind, "rss_gb": _peak_rss_gb()}))


def _peak_rss_gb() -> float:
    """VmHWM: the peak resident set of this address space. Unlike ru_maxrss it starts afresh at
    exec, so a child does not inherit the parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20  # kB
    raise RuntimeError("/proc/self/status has no VmHWM: this benchmark needs Linux")


def _measure(kind: str, model: str) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--child", kind, "--model", model],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if out.returncode != 0:
        raise SystemExit(f"{kind} load of {model} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["rss_gb"]


def build_demo(folder: Path, *, hidden: int = 768, layers: int = 12, vocab: int = 32000) -> Path:
    """A random float32 Llama saved as sharded safetensors (~540 MB at the defaults)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 192),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(folder, max_shard_size="100MB")
    return folder


def _build_in_child(folder: Path, *, tiny: bool) -> str:
    """Build the demo model in a subprocess, so this process stays small."""
    sizes = "hidden=64, layers=4, vocab=256" if tiny else ""
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); "
        f"from shard_load import build_demo; from pathlib import Path; "
        f"build_demo(Path({str(folder)!r}), {sizes})"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=1800)
    return str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded", help="folder, Hub id or 'embedded'")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--build-demo", type=Path, help="write a float32 demo Llama here first")
    parser.add_argument("--quick", action="store_true", help="tiny model, one repeat")
    parser.add_argument("--child", choices=["stage", "full", "baseline"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.model)
        return

    with tempfile.TemporaryDirectory() as scratch:
        model = args.model
        if args.quick:
            model = _build_in_child(Path(scratch), tiny=True)
            args.repeats = 1
        elif args.build_demo:
            model = _build_in_child(args.build_demo, tiny=False)
        samples: dict[str, list[float]] = {"baseline": [], "stage": [], "full": []}
        for _ in range(args.repeats):  # alternated: a noisy neighbour hits both alike
            for kind in samples:
                samples[kind].append(_measure(kind, model))

    median = {kind: statistics.median(values) for kind, values in samples.items()}
    ratio = median["stage"] / median["full"]
    base = median["baseline"]
    net = (median["stage"] - base) / max(median["full"] - base, 1e-9)
    print(f"Peak host RSS, bfloat16 from a float32 checkpoint: `{model}`")
    print(f"({args.repeats} alternated run(s) each, medians)\n")
    print("| load | peak RSS (GB) | over imports (GB) |")
    print("|---|---|---|")
    print(f"| imports only | {base:.3f} | 0 |")
    print(
        f"| half the blocks (load_stage_shard) | {median['stage']:.3f} | {median['stage'] - base:.3f} |"
    )
    print(f"| whole model (from_pretrained) | {median['full']:.3f} | {median['full'] - base:.3f} |")
    print(f"\nstage / full = {ratio:.2f} (target <= {TARGET}); above imports: {net:.2f}\n")
    print(
        json.dumps(
            {
                "model": "quick" if args.quick else model,
                "repeats": args.repeats,
                "stage_rss_gb": round(median["stage"], 4),
                "full_rss_gb": round(median["full"], 4),
                "baseline_rss_gb": round(base, 4),
                "stage_over_full": round(ratio, 4),
                "stage_over_full_above_imports": round(net, 4),
                "target": TARGET,
                "meets_target": ratio <= TARGET,
            }
        )
    )


if __name__ == "__main__":
    main()
