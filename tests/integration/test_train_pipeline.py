"""Real stage workers (``python -m swarmp2p.runtime.worker``) over CURVE ZmqLinks on loopback:
loss and trained parameters equal a single process; a dead neighbour fails fast; bad specs
name their field; a resumed run equals an uninterrupted one."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from swarm_harness import direct_plan, direct_spec  # noqa: E402

from swarmp2p.workers.events import decode  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

try:  # tqdm's monitor thread (transformers' progress bars) would trip the thread-leak check
    import tqdm

    tqdm.tqdm.monitor_interval = 0
except ImportError:
    pass
ROOT = Path(__file__).resolve().parents[2]
VOCAB = 128


def _model(family: str):
    import transformers as tf

    torch.manual_seed(0)
    if family == "gpt2":
        config = tf.GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=4,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=False,
        )
    else:
        config = tf.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        )
    return tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    saved = {}

    def get(family: str) -> Path:
        if family not in saved:
            folder = tmp_path_factory.mktemp(family)
            _model(family).save_pretrained(folder, max_shard_size="40KB")
            saved[family] = folder
        return saved[family]

    return get


@pytest.fixture(scope="module")
def token():
    from swarmp2p.net import SwarmSecret

    return SwarmSecret.generate().token


class Worker:
    """One worker process; its stdout events and stderr drained on threads."""

    def __init__(self, spec: dict) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "swarmp2p.runtime.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        self.events: list[dict] = []
        self.stderr: list[str] = []
        self._ready = threading.Event()
        self._threads = [
            threading.Thread(target=self._out, daemon=True),
            threading.Thread(target=self._err, daemon=True),
        ]
        for t in self._threads:
            t.start()
        self.proc.stdin.write(json.dumps(spec))
        self.proc.stdin.close()

    def _out(self) -> None:
        for line in self.proc.stdout:
            event = json.loads(line)
            decode(event)  # every line a worker writes is a record the daemon reads
            self.events.append(event)
            if event["event"] in ("ready", "error"):
                self._ready.set()
        self._ready.set()

    def _err(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)

    def port(self, timeout: float = 60) -> int | None:
        assert self._ready.wait(timeout), "worker never said ready"
        ready = [e for e in self.events if e["event"] == "ready"]
        assert ready, self.describe()
        return ready[0]["port"]

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for t in self._threads:
            t.join(5)
        self.proc.stdout.close()
        self.proc.stderr.close()

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["event"] == kind]

    def describe(self) -> str:
        return f"events {self.events}\nstderr tail:\n{''.join(self.stderr[-30:])}"


BASE_JOB = {
    "name": "pipeline-test",
    "train": {
        "steps": 2,
        "batch_size": 4,
        "seq_len": 9,
        "lr": 1e-3,
        "micro_batches": 1,
        "eval_batches": 0,
        "seed": 3,
    },
}


def job_for(job: dict | None) -> dict:
    """BASE_JOB with the sections of ``job`` merged in one level deep."""
    out = copy.deepcopy(BASE_JOB)
    for key, value in (job or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def spec_for(i, n, folder, token, cuts, job=None, next_port=None, **local) -> dict:
    """Stage i's worker spec, made as the daemon makes it (``worker_spec`` of a plan)."""
    assert len(cuts) == n - 1
    parsed, plan = direct_plan(folder, job_for(job), cuts=cuts)
    local = {"loss_chunk_tokens": 7, "link_timeout_s": 30, **local}
    return direct_spec(parsed, plan, i, token=token, next_port=next_port, **local)


def run_workers(n, folder, token, cuts, job=None, **local) -> list[Worker]:
    """Start stages last to first (each dials the bound port of the next); wait for all."""
    workers: list[Worker | None] = [None] * n
    nxt = None
    try:
        for i in reversed(range(n)):
            workers[i] = Worker(spec_for(i, n, folder, token, cuts, job, next_port=nxt, **local))
            nxt = workers[i].port()
        for w in workers:
            w.wait()
    finally:
        for w in workers:
            if w is not None:
                w.stop()
    return workers


def reference(folder, steps, batch_size, seq_len, seed, lr):
    """Single process: the loss of each step and the parameters after the last."""
    from transformers import AutoModelForCausalLM

    from swarmp2p.runtime.torch.train.loss import chunked_loss

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        tokens = torch.randint(0, VOCAB, (batch_size, seq_len + 1), generator=gen)
        opt.zero_grad()
        loss = chunked_loss(model(tokens[:, :-1]).logits, tokens[:, 1:], 7)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _snapshot_params(snap_dir: Path, i: int, step: int, layer_start: int) -> dict:
    """A stage snapshot's parameters under the whole model's names."""
    payload = torch.load(snap_dir / f"stage-{i}" / f"step-{step:08d}.pt", weights_only=True)
    return payload["state"]


@pytest.mark.parametrize(
    ("family", "n", "schedule", "m"),
    [
        ("llama", 2, "1f1b", 4),
        ("llama", 3, "gpipe", 4),
        ("gpt2", 4, "1f1b", 1),
        ("llama", 3, "zb-h1", 4),  # the workers' oneDNN layers split their backward too
    ],
)
def test_workers_match_a_single_process(checkpoint, token, tmp_path, family, n, schedule, m):
    folder = checkpoint(family)
    cuts = {2: [2], 3: [1, 3], 4: [1, 2, 3]}[n]
    workers = run_workers(
        n,
        folder,
        token,
        cuts,
        job={"train": {"micro_batches": m, "schedule": schedule, "checkpoint_every": 2}},
        snapshot_dir=str(tmp_path),
    )
    for w in workers:
        assert w.proc.returncode == 0, w.describe()
    ref_losses, ref_params = reference(folder, 2, 4, 9, 3, 1e-3)
    for w in workers:
        assert [e["loss"] for e in w.of("step")] == pytest.approx(ref_losses, abs=1e-5)
    # every trained parameter after 2 AdamW steps equals the single process's
    from swarmp2p.runtime.torch import build_stage

    whole = copy.deepcopy(_model_from(folder))
    bounds = [0, *cuts, 4]
    compared = 0
    for i in range(n):
        stage = build_stage(whole, bounds[i], bounds[i + 1])
        names = {id(p): name for name, p in whole.named_parameters()}
        state = _snapshot_params(tmp_path, i, 2, bounds[i])
        for name, p in stage.named_parameters():
            got = state[f"stage.{name}"]
            torch.testing.assert_close(got, ref_params[names[id(p)]], atol=1e-5, rtol=0, msg=name)
            compared += 1
    assert compared == len(ref_params)
    first = workers[0].of("step")[0]
    assert first["act_bytes"] > 4 * 9 * 32 * 4 and first["grad_bytes"] == 0
    assert workers[-1].of("step")[0]["grad_bytes"] > 4 * 9 * 32 * 4


def _model_from(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").float()


def test_a_killed_neighbour_fails_the_survivor_within_the_link_timeout(checkpoint, token):
    folder = checkpoint("llama")
    long = {"train": {"steps": 1000}}
    last = Worker(spec_for(1, 2, folder, token, [2], long, link_timeout_s=3))
    try:
        port = last.port()
        first = Worker(spec_for(0, 2, folder, token, [2], long, next_port=port, link_timeout_s=3))
        try:
            deadline = time.monotonic() + 60
            while not first.of("step") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert first.of("step"), first.describe()
            first.proc.kill()
            killed_at = time.monotonic()
            assert last.wait(30) == 1, last.describe()
            assert time.monotonic() - killed_at < 3 + 10
            (error,) = last.of("error")
            assert error["type"] == "LinkTimeout" and "within 3 s" in error["message"]
        finally:
            first.stop()
    finally:
        last.stop()


def _set(path: str, value):
    def change(spec: dict) -> None:
        *parents, leaf = path.split(".")
        node = spec
        for key in parents:
            node = node[int(key)] if key.isdigit() else node[key]
        if value is _DROP:
            del node[leaf]
        else:
            node[int(leaf) if leaf.isdigit() else leaf] = value

    return change


_DROP = object()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (_set("stage", 5), "stage: must be < the plan's 2 stage(s), got 5"),
        (_set("plan.stages.1.layers", [3, 4]), "stages[1] starts at block 3"),
        (_set("job.split.compression", ["fixed_int9"]), "job.split.compression[0]: must be"),
        (_set("job.train.micro_batches", 3), "job.train.micro_batches: must divide"),
        (_set("plan.finetune_mode", "lora"), "plan.finetune_mode: 'lora' is not the job's 'full'"),
        (_set("bogus", 1), "bogus: unknown key"),
        (_set("next", _DROP), "next: required on every stage but the last"),
    ],
)
def test_bad_specs_name_the_field(change, field, checkpoint, token):
    spec = spec_for(0, 2, checkpoint("llama"), token, [2], next_port=1)
    change(spec)
    w = Worker(spec)
    assert w.wait(60) == 2, w.describe()
    (error,) = w.of("error")
    assert error["type"] == "WorkerSpecError" and field in error["message"]


def test_lora_workers_evaluate_export_and_reconstruct(checkpoint, token, tmp_path):
    folder = checkpoint("llama")
    workers = run_workers(
        2,
        folder,
        token,
        [2],
        job={
            "model": {
                "lora": {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0, "export": "adapters"}
            },
            "train": {"steps": 3, "eval_batches": 2, "lr": 1e-2},
        },
        export_dir=str(tmp_path),
    )
    for w in workers:
        assert w.proc.returncode == 0, w.describe()
    passes = [[(e["pass"], e["loss"], e["tokens"]) for e in w.of("eval")] for w in workers]
    assert passes[0] == passes[1]  # every stage reports the last stage's numbers
    assert [p[0] for p in passes[0]] == ["base", "trained"]  # no compressor: no calibrated pass
    (_, base_loss, tokens), (_, trained_loss, _) = passes[0]
    assert tokens == 2 * 4 * 9
    built = [w.of("built")[0] for w in workers]
    assert built[0]["lora_fingerprint"] == built[1]["lora_fingerprint"] is not None

    from swarmp2p.runtime.torch.train.evaluation import score_logits
    from swarmp2p.runtime.torch.train.export import read_manifest, reconstruct_from_shards
    from swarmp2p.runtime.torch.train.stage_runner import eval_batches
    from swarmp2p.runtime.worker import parse_worker_spec

    dirs = [tmp_path / "stage-0", tmp_path / "stage-1"]
    assert read_manifest(dirs[1])["weights_included"] is False
    model = reconstruct_from_shards(folder, dirs).eval()
    spec = parse_worker_spec(
        spec_for(0, 2, folder, token, [2], {"train": {"eval_batches": 2}}, next_port=1)
    )
    loss_sum, n = 0.0, 0
    with torch.no_grad():
        for batch in eval_batches(spec, VOCAB):
            s, _, k = score_logits(model(batch[:, :-1]).logits, batch[:, 1:])
            loss_sum, n = loss_sum + s, n + k
    assert loss_sum / n == pytest.approx(trained_loss, abs=1e-5)
    assert trained_loss != base_loss  # the adapters moved (random tokens: nothing to learn)


def test_learned_bottleneck_workers_calibrate_and_train(checkpoint, token):
    folder = checkpoint("llama")
    # calibration_tokens is the boundary's setting in job.json (issue 26 item 5)
    learned = {
        "method": "learned_bottleneck",
        "learned_dim": 16,
        "code_bits": 8,
        "calibration_tokens": 72,
    }
    workers = run_workers(
        3,
        folder,
        token,
        [1, 3],
        job={
            "model": {"freeze_backbone": True},
            "split": {"compression": [learned, learned]},
            "train": {"steps": 4, "eval_batches": 1, "lr": 1e-2, "micro_batches": 2},
        },
    )
    for w in workers:
        assert w.proc.returncode == 0, w.describe()
    assert [w.of("calibrated")[0]["tokens"] for w in workers] == [72, 72, 0]
    names = [e["pass"] for e in workers[1].of("eval")]
    assert names == ["base", "calibrated_boundary", "trained"]
    trainable = [w.of("built")[0]["trainable_parameters"] for w in workers]
    # the halves only: down (32x16 + 16) on a sender, up (16x32 + 32) on a receiver
    assert trainable == [528, 544 + 528, 544]
    steps = workers[0].of("step")
    assert steps[0]["act_bytes"] < 2 * (2 * 9 * 16 + 2 * 4 + 2 * 9 * 8) + 600  # codes, not floats


def test_a_none_job_reads_no_data_runs_no_step_and_exports_its_boundary(
    checkpoint, token, tmp_path
):
    """Reference ("Which parameters train"): none loads, puts the quantizer on the boundary and
    exports; no data is read (stage 0's tokens file is unreadable) and no step runs."""
    folder = checkpoint("llama")
    broken = tmp_path / "tokens.npy"
    broken.write_bytes(b"read me and fail")
    workers = run_workers(
        2,
        folder,
        token,
        [2],
        job={
            "model": {"freeze_backbone": True},
            "split": {"compression": ["fixed_int4"]},
            "data": {"source": str(broken)},
            "train": {"steps": 3, "eval_batches": 2},
        },
        tokens_path=str(broken),
        export_dir=str(tmp_path / "export"),
    )
    for w in workers:
        assert w.proc.returncode == 0, w.describe()
        assert w.of("built")[0]["finetune_mode"] == "none"
        assert w.of("built")[0]["trainable_parameters"] == 0
        assert w.of("step") == [] and w.of("eval") == [] and w.of("calibrated") == []
        assert [e["steps"] for e in w.of("done")] == [0]

    from swarmp2p.runtime.torch.train.export import read_manifest, reconstruct_from_shards

    dirs = [tmp_path / "export" / "stage-0", tmp_path / "export" / "stage-1"]
    manifests = [read_manifest(d) for d in dirs]
    assert [m["compression"] for m in manifests] == [["fixed_int4"]] * 2
    assert all(m["evaluation"] == {} for m in manifests)
    from transformers import AutoModelForCausalLM

    rebuilt = reconstruct_from_shards(folder, dirs).eval()
    base = AutoModelForCausalLM.from_pretrained(folder).eval()
    for (name, p), q in zip(rebuilt.named_parameters(), base.parameters(), strict=True):
        assert torch.equal(p, q), name  # nothing trained


def _corpus_model(folder: Path) -> Path:
    """A tiny Llama over the embedded model's tokenizer (so a text corpus tokenizes for it)."""
    import shutil

    from swarm_harness import tiny_llama

    from swarmp2p.models import resolve_model_ref

    tokenizer = Path(resolve_model_ref("embedded"))
    tiny_llama(folder, vocab=49152, layers=2, shard_size="10MB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    return folder


def _corpus(tmp_path: Path, n: int) -> tuple[list[str], Path]:
    """``n`` JSONL rows tokenized as the daemon does (``prepare_tokens``, a subprocess)."""
    import asyncio

    from swarmp2p.node.training.corpus import prepare_tokens

    rows = [f"row {i} " + " ".join(f"w{i}x{j}" for j in range(8 + i % 5)) for i in range(n)]
    source = tmp_path / f"rows-{n}.jsonl"
    source.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    out = tmp_path / f"corpus-{n}.npz"
    asyncio.run(prepare_tokens(str(tmp_path / "m"), str(source), "text", out))
    return rows, out


def test_a_corpus_trains_on_its_first_rows_and_evaluates_on_its_last(token, tmp_path):
    """Reference: a bucket file's validation split is its last rows, one in twenty, and none of
    them is trained on; under 20 rows there is none, and every pass opens with 0 batches on
    both stages, so the job still completes."""
    import numpy as np
    from transformers import AutoTokenizer

    from swarmp2p.data import tokenize_rows
    from swarmp2p.runtime.torch.train.stage_runner import _load_tokens
    from swarmp2p.runtime.worker import parse_worker_spec

    folder = _corpus_model(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(folder)
    job = {"data": {"source": "x.jsonl"}, "train": {"eval_batches": 4, "batch_size": 1}}
    rows, corpus = _corpus(tmp_path, 100)  # rows 95..99 are held out
    spec = parse_worker_spec(
        spec_for(0, 2, folder, token, [1], job, next_port=1, tokens_path=str(corpus))
    )
    assert spec.data.source == "corpus"
    w = spec.train.seq_len + 1
    windows = _load_tokens(spec)
    held = tokenize_rows(rows[95:], tok)
    train = tokenize_rows(rows[:95], tok)
    assert len(held) >= 4 * w  # the test's premise: four held-out windows
    np.testing.assert_array_equal(windows["held_out"].flatten().numpy(), held[: len(held) // w * w])
    np.testing.assert_array_equal(windows["train"].flatten().numpy(), train[: len(train) // w * w])
    seen = {int(t) for t in windows["train"].flatten()}
    only_held = {int(t) for t in tokenize_rows(["w99x0 w98x1 w97x2"], tok)[:-1]} - {
        int(t) for t in train
    }
    assert only_held and not (only_held & seen)  # tokens only the held-out rows have: untrained

    workers = run_workers(2, folder, token, [1], job, tokens_path=str(corpus))
    for w_ in workers:
        assert w_.proc.returncode == 0, w_.describe()
    passes = [[(e["pass"], e["tokens"]) for e in w_.of("eval")] for w_ in workers]
    assert passes[0] == passes[1] == [("base", 4 * 9), ("trained", 4 * 9)]

    _, small = _corpus(tmp_path, 19)  # fewer than 20 rows: no validation split
    with np.load(small) as saved:
        assert len(saved["validation"]) == 0 and len(saved["train"]) > 19 * w
    workers = run_workers(2, folder, token, [1], job, tokens_path=str(small))
    for w_ in workers:
        assert w_.proc.returncode == 0, w_.describe()
        assert [(e["pass"], e["tokens"]) for e in w_.of("eval")] == [("base", 0), ("trained", 0)]
        assert len(w_.of("step")) == 2  # it still trains
