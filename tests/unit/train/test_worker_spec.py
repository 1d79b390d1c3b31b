"""Worker spec validation (no torch needed) and the data rule (a batch is a function of the step).

The spec is the job and its plan plus what only the stage's node knows; these tests build it
with ``worker_spec()``, as the daemon does."""

from __future__ import annotations

import json
from io import StringIO

import pytest

from swarmp2p.plan import from_config, parse_job
from swarmp2p.plan.worker_spec import local_plan, worker_spec
from swarmp2p.runtime.worker import EXIT_BAD_SPEC, WorkerSpecError, main, parse_worker_spec
from swarmp2p.schema import SchemaError

CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 6,
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "tie_word_embeddings": False,
    "max_position_embeddings": 512,
}
JOB = {
    "name": "spec-test",
    "model": {"pretrained": "/m", "lora": {"enabled": True, "r": 4}},
    "data": {"source": "random"},
    "train": {"steps": 3, "batch_size": 4, "seq_len": 8, "micro_batches": 2, "seed": 3},
    "split": {"compression": ["none", {"method": "learned_bottleneck", "learned_dim": 16}]},
}


def _job(**train):
    return parse_job({**JOB, "train": {**JOB["train"], **train}})


def _good(stage: int = 0, **local) -> dict:
    job = _job()
    plan = local_plan(job, from_config(CONFIG), cuts=[2, 4])
    nxt = "tcp://127.0.0.1:5000" if stage < 2 else None
    return worker_spec(job, plan, stage, token="t", next_endpoint=nxt, **local).to_dict()


def test_a_good_spec_round_trips_and_reads_the_job_and_plan():
    data = json.loads(json.dumps(_good()))
    spec = parse_worker_spec(data)
    assert spec.to_dict() == data
    assert spec.is_first and not spec.is_last and spec.n_stages == 3
    assert spec.layers == (0, 2) and spec.n_layers == 6
    assert spec.train.schedule == "1f1b" and spec.train.micro_batches == 2
    assert spec.train.checkpoint_every == 0  # no snapshot_dir: no snapshots
    assert spec.data.source == "random" and spec.finetune_mode == "lora" and spec.lora.r == 4
    assert spec.compression[1] == {
        "method": "learned_bottleneck",
        "learned_dim": 16,
        "code_bits": 8,
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"stage": 3}, "stage: must be < the plan's 3 stage(s), got 3"),
        ({"next": None}, "next: required on every stage but the last"),
        ({"next": "udp://x"}, "next: "),
        (
            {"job": {**JOB, "train": {"schedule": "zigzag"}}},
            'job.train.schedule: must be one of "auto", "gpipe", "1f1b", "zb-h1", "zb-h2", got "zigzag"',
        ),
        ({"job": {**JOB, "train": {"lr": 0}}}, "job.train.lr: must be a number > 0, got 0"),
        ({"job": {**JOB, "name": "other"}}, "plan.job: 'spec-test' is not the job's name 'other'"),
        ({"data": {"source": "tokens"}}, 'data.path: required when source is "tokens"'),
        ({"resume": True}, "resume: needs snapshot_dir"),
        ({"model": ""}, "model: must be a non-empty string"),
        ({"port": 2**64}, "port: must be an integer >= 0 and <= 65535"),
        ({"extra": 1}, "extra: unknown key"),
        ({"loss_scale": 1024.0}, "loss_scale: applies only to float16 jobs"),
        ({"loss_scale": 0}, "loss_scale: must be a number > 0, got 0"),
        ({"inject_nan_step": -1}, "inject_nan_step: must be an integer >= 0"),
    ],
)
def test_bad_fields_are_named(change, message):
    with pytest.raises(WorkerSpecError) as info:
        parse_worker_spec({**_good(), **change})
    assert any(message in str(e) for e in info.value.errors), info.value.errors


def test_a_tampered_plan_is_named_by_its_path():
    data = _good()
    data["plan"]["stages"][1]["layers"] = [3, 4]  # no longer where stage 0 ends
    with pytest.raises(WorkerSpecError) as info:
        parse_worker_spec(data)
    assert any(
        e.path == "plan" and "stages[1] starts at block 3" in e.message for e in info.value.errors
    )


def test_half_precision_fields_parse():
    job = parse_job(
        {**JOB, "model": {**JOB["model"], "dtype": "float16", "weight_dtype": "float16"}}
    )
    plan = local_plan(job, from_config(CONFIG), cuts=[2, 4])
    spec = worker_spec(job, plan, 2, token="t", loss_scale=1024, inject_nan_step=3)
    spec = parse_worker_spec(spec.to_dict())
    assert spec.dtype == "float16" and spec.weight_dtype == "float16"
    assert spec.train.loss_scale == 1024.0 and spec.train.inject_nan_step == 3


def test_each_training_default_is_the_jobs():
    """The runtime trains with the job's records: a job.json that sets nothing trains at the
    job's defaults (``lr`` 2e-4, LoRA r 8...), inside a spec and outside one (tests, benches)."""
    from swarmp2p.plan.job import LoraConfig, TrainConfig
    from swarmp2p.plan.worker_spec import StageTraining
    from swarmp2p.schema import parse

    job = parse_job(
        {"model": {"pretrained": "/m", "lora": {"enabled": True}}, "split": {"stages": 1}}
    )
    defaults = parse(TrainConfig, {})
    spec = worker_spec(
        job, local_plan(job, from_config(CONFIG)), 0, token="t", tokens_path="/t.npz"
    )
    for t in (spec.train, StageTraining.of()):
        assert t.lr == defaults.lr == 2e-4
        assert (t.steps, t.batch_size, t.seq_len, t.micro_batches, t.schedule) == (
            defaults.steps,
            defaults.batch_size,
            defaults.seq_len,
            defaults.micro_batches,
            "1f1b",  # the default "auto", as the planner resolves it for a LoRA job
        )
        assert defaults.schedule == "auto"
        assert t.eval_batches == defaults.eval_batches
        assert t.calibration_tokens == job.split.calibration_tokens
        assert (t.weight_decay, t.loss_chunk_tokens, t.loss_scale) == (
            spec.weight_decay,
            spec.loss_chunk_tokens,
            spec.loss_scale,
        )
    assert spec.lora is job.model.lora and spec.lora == parse(LoraConfig, {"enabled": True})
    # what a run outside a spec names is checked as job.json's train is
    assert StageTraining.of(lr=1e-3, micro_batches=2).lr == 1e-3
    with pytest.raises(ValueError, match=r"micro_batches: must divide train\.batch_size 4"):
        StageTraining.of(micro_batches=3)


def test_every_problem_is_reported_at_once():
    with pytest.raises(WorkerSpecError) as info:
        parse_worker_spec({"stage": 0})
    assert {e.path for e in info.value.errors} >= {"job", "plan", "model", "token"}


def test_a_one_stage_spec_needs_no_next():
    job = _job()
    job = parse_job({**JOB, "split": {"stages": 1}})
    plan = local_plan(job, from_config(CONFIG))
    spec = parse_worker_spec(worker_spec(job, plan, 0, token="t").to_dict())
    assert spec.is_first and spec.is_last and spec.layers == (0, 6)


def test_main_reports_a_bad_spec_as_an_event_and_exit_code():
    out = StringIO()
    assert main(StringIO(json.dumps({**_good(), "stage": "zero"})), out) == EXIT_BAD_SPEC
    (event,) = [json.loads(line) for line in out.getvalue().splitlines()]
    assert event["event"] == "error" and event["type"] == "WorkerSpecError"
    assert 'stage: must be an integer >= 0, got "zero"' in event["message"]
    assert any(e.startswith("stage: ") for e in event["errors"])
    out = StringIO()
    assert main(StringIO("{not json"), out) == EXIT_BAD_SPEC
    assert "spec is not JSON" in out.getvalue()


def test_a_stage_is_ready_before_it_imports_torch():
    """The leader starts the stages one by one, each once the next is ready: a stage binds its
    link and says so before it imports torch (here: an interpreter where torch cannot load)."""
    import subprocess
    import sys

    from swarmp2p.net.security import SwarmSecret

    spec = _good(1)
    spec["token"] = SwarmSecret.generate().token
    code = "import sys; sys.modules['torch'] = None; from swarmp2p.runtime.worker import main; sys.exit(main())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        timeout=60,
    )
    events = [json.loads(line) for line in out.stdout.splitlines()]
    assert out.returncode == 1 and [e["event"] for e in events] == ["ready", "error"], out
    assert events[0]["stage"] == 1 and events[0]["port"] > 0
    assert "torch" in events[1]["message"] and events[1]["type"] in (
        "ImportError",
        "ModuleNotFoundError",
    )


@pytest.mark.torch
def test_batches_are_a_function_of_the_step_and_held_out_is_separate(tmp_path):
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    from swarmp2p.runtime.torch.train.stage_runner import _load_tokens, eval_batches, train_batch

    job = parse_job({**JOB, "train": {"batch_size": 2, "seq_len": 4, "eval_batches": 3}})
    plan = local_plan(job, from_config(CONFIG), cuts=[2, 4])
    spec = worker_spec(job, plan, 0, token="t", next_endpoint="tcp://h:1")
    assert torch.equal(train_batch(spec, 5, 100), train_batch(spec, 5, 100))
    assert not torch.equal(train_batch(spec, 5, 100), train_batch(spec, 6, 100))
    assert train_batch(spec, 0, 100).shape == (2, 5)
    path = tmp_path / "ids.npy"
    np.save(path, np.arange(5 * 40))
    spec = worker_spec(job, plan, 0, token="t", next_endpoint="tcp://h:1")
    spec = parse_worker_spec({**spec.to_dict(), "data": {"source": "tokens", "path": str(path)}})
    tokens = _load_tokens(spec)
    assert tokens["train"].shape == (38, 5) and tokens["held_out"].shape == (2, 5)
    assert int(tokens["held_out"].min()) > int(tokens["train"].max())  # the last windows
    assert len(eval_batches(spec, 100, tokens)) == 1  # only one batch of 2 is held out
    assert torch.equal(train_batch(spec, 1, 100, tokens), tokens["train"][2:4])


def test_a_text_corpus_is_read_by_stage_0_from_its_token_file():
    from swarmp2p.plan.worker_spec import needs_tokens, stage_data

    text = parse_job({**JOB, "data": {"source": "embedded"}})
    assert needs_tokens(text) and not needs_tokens(_job())
    assert not needs_tokens(parse_job({**JOB, "data": {"source": "/ids.npy"}}))
    with pytest.raises(ValueError, match="must be tokenized for stage 0 first"):
        stage_data(text, 0, None)
    assert stage_data(text, 0, "/t.npy").path == "/t.npy"
    assert stage_data(text, 1, None).source == "random"  # stages past the first read none


def test_the_boundarys_calibration_tokens_reach_the_worker():
    """``calibration_tokens`` on a learned boundary in job.json (issue 26 item 5) is in the spec
    the daemon builds (``worker_spec``) and in what the worker's calibration reads."""
    learned = {"method": "learned_bottleneck", "learned_dim": 16, "calibration_tokens": 1000}
    job = parse_job({**JOB, "split": {"compression": ["none", learned]}})
    plan = local_plan(job, from_config(CONFIG), cuts=[2, 4])
    data = worker_spec(job, plan, 0, token="t", next_endpoint="tcp://127.0.0.1:5000").to_dict()
    assert data["calibration_tokens"] == 1000
    spec = parse_worker_spec(json.loads(json.dumps(data)))
    assert spec.train.calibration_tokens == 1000
    assert spec.compression[1]["calibration_tokens"] == 1000
    default = parse_worker_spec(_good())
    assert default.calibration_tokens == 16384 and default.train.calibration_tokens == 16384


NONE_JOB = {  # freeze_backbone with a fixed quantizer: finetune mode none
    **JOB,
    "model": {"pretrained": "/m", "freeze_backbone": True},
    "split": {"compression": ["fixed_int4", "none"]},
    "train": {**JOB["train"], "eval_batches": 4},
}


@pytest.mark.parametrize("source", ["embedded", "/corpus.jsonl", "/ids.npy", "hf:x/y"])
def test_a_none_job_reads_no_data_on_any_stage_and_plans_no_evaluation(source):
    """Reference ("Which parameters train"): none reads no data and runs no step."""
    from swarmp2p.plan.worker_spec import needs_tokens, reads_data, stage_data

    job = parse_job({**NONE_JOB, "data": {"source": source}})
    assert job.finetune_mode == "none" and not reads_data(job)
    assert not needs_tokens(job)  # stage 0 tokenizes nothing
    assert stage_data(job, 0, "/somewhere/tokens.npy").source == "random"  # a path is ignored
    plan = local_plan(job, from_config(CONFIG), cuts=[2, 4])
    assert plan.eval_batches == 0  # both stages run the same (empty) set of passes
    spec = worker_spec(job, plan, 0, token="t", next_endpoint="tcp://127.0.0.1:5000")
    assert spec.data.path is None and spec.train.eval_batches == 0
    trains = parse_job({**JOB, "data": {"source": source}})  # the lora job reads it
    assert reads_data(trains) and local_plan(trains, from_config(CONFIG), cuts=[2, 4]).eval_batches


def test_a_none_spec_that_names_data_is_refused_naming_the_field():
    job = parse_job(NONE_JOB)
    plan = local_plan(job, from_config(CONFIG), cuts=[2, 4])
    data = worker_spec(job, plan, 0, token="t", next_endpoint="tcp://127.0.0.1:5000").to_dict()
    data["data"] = {"source": "tokens", "path": "/ids.npy"}
    with pytest.raises(WorkerSpecError, match=r"data\.source.*finetune mode none reads no data"):
        parse_worker_spec(data)


def test_a_text_corpus_reaches_stage_0_as_its_row_split_corpus_file():
    from swarmp2p.plan.worker_spec import stage_data

    text = parse_job({**JOB, "data": {"source": "/c.jsonl"}})
    assert stage_data(text, 0, "/job/data/corpus.npz").source == "corpus"
    ids = parse_job({**JOB, "data": {"source": "/ids.npy"}})
    assert stage_data(ids, 0, None).source == "tokens"  # token ids: no rows to count


def _replicated(stage: int, replica: int, **local):
    """A spec of stage ``stage`` of replica ``replica`` of a 2 replicas x 3 stages plan."""
    job = parse_job({**JOB, "split": {"replicas": 2}})
    plan = local_plan(job, from_config(CONFIG), cuts=[2, 4])
    assert plan.n_replicas == 2
    nxt = "tcp://127.0.0.1:5000" if stage < 2 else None
    return worker_spec(job, plan, stage, token="t", next_endpoint=nxt, replica=replica, **local)


def test_a_replicas_ring_fields_are_required_where_it_dials_and_named():
    ring = {"ring_prev": "tcp://h:1", "ring_next": "tcp://h:2"}
    assert _replicated(0, 0).n_replicas == 2  # replica 0 binds both ends
    assert _replicated(1, 1, **ring).sync.mode == "step"
    for replica, local, path, words in [
        (2, ring, "replica", "must be < the plan's 2 replica(s)"),
        (1, {"ring_next": "tcp://h:2"}, "ring_prev", "dials the replica before it"),
        (1, {"ring_prev": "tcp://h:1"}, "ring_next", "closes the ring"),
        (1, {**ring, "export_dir": "/x"}, "export_dir", "replica 0 exports"),
    ]:
        with pytest.raises(SchemaError) as err:
            _replicated(1, replica, **local)
        assert any(e.path == path and words in e.message for e in err.value.errors), err.value


@pytest.mark.torch
def test_each_replica_reads_its_share_of_a_batch_n_times_as_large(tmp_path):
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    from swarmp2p.runtime.torch.train.stage_runner import _load_tokens, train_batch

    ring = {"ring_prev": "tcp://h:1", "ring_next": "tcp://h:2"}
    specs = [_replicated(0, 0), _replicated(0, 1, **ring)]
    one = worker_spec(_job(batch_size=8), local_plan(_job(batch_size=8), from_config(CONFIG),
                      cuts=[2, 4]), 0, token="t", next_endpoint="tcp://h:1")  # fmt: skip
    for step in (0, 3):  # random rows: the halves of the 8-row batch one pipeline would read
        whole = train_batch(one, step, 100)
        assert torch.equal(torch.cat([train_batch(s, step, 100) for s in specs]), whole)
    path = tmp_path / "ids.npy"
    np.save(path, np.arange(9 * 200))
    data = {"data": {"source": "tokens", "path": str(path)}}
    specs = [parse_worker_spec({**s.to_dict(), **data}) for s in specs]
    one = parse_worker_spec({**one.to_dict(), **data})
    tokens = _load_tokens(one)
    for step in (0, 5):
        whole = train_batch(one, step, 100, tokens)
        assert torch.equal(torch.cat([train_batch(s, step, 100, tokens) for s in specs]), whole)
