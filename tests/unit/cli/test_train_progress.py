"""`swarm train`'s live line and plan, rendered by rich at a terminal's width."""

from __future__ import annotations

import io

from rich.console import Console

from swarmp2p.cli._jobs import plan_table, progress_bar, progress_fields


def _view(**over):
    view = {
        "state": "RUNNING",
        "step": 12,
        "steps": 30,
        "reason": "",
        "metrics": {
            "loss": 2.3456,
            "tokens_per_s": 812.0,
            "step_s": 1.5,
            "boundaries": {"0": {"act_mb_s": 1.25, "grad_mb_s": 1.5}},
        },
        "plan": {
            "stages": [
                {"node": "n1", "node_name": "box-a", "devices": ["cpu"], "layers": [0, 15]},
                {
                    "node": "n2",
                    "node_name": "",
                    "devices": ["cuda:0"],
                    "layers": [15, 30],
                    "predicted_s": 0.25,
                },
            ],
            "dtype": "float32",
            "finetune_mode": "lora",
            "predicted_step_s": 0.5,
            "bottleneck": 1,
        },
    }
    view.update(over)
    return view


def _line(view, width: int) -> str:
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=False, color_system=None)
    with progress_bar(console) as bar:
        bar.add_task(
            "j-1a2b3c", total=view["steps"], completed=view["step"], **progress_fields(view)
        )
        bar.refresh()
    return [line for line in out.getvalue().splitlines() if line.strip()][-1]


def test_at_80_columns_the_bar_the_step_and_the_eta_stay_and_only_the_details_are_cut():
    line = _line(_view(), 80)
    assert len(line) <= 80, line
    assert "j-1a2b3c" in line and "12/30" in line and "ETA 27s" in line
    assert "━" in line  # the bar itself
    assert "RUNNING" in line and line.endswith("…"), line  # the details give way, cut visibly
    wide = _line(_view(), 200)
    assert "loss 2.3456" in wide and "812 tok/s" in wide and "b0 1.25/1.50 MB/s" in wide


def test_the_first_frame_says_no_step_yet_rather_than_none():
    fields = progress_fields(_view(state="PLACED", step=0, steps=30, metrics={}))
    assert fields == {"steps": "-/30", "eta": "", "info": "PLACED"}
    assert progress_fields(_view(steps=None, step=0, state="PENDING"))["steps"] == "-/?"
    waiting = progress_fields(_view(state="PENDING", reason="no node fits\nmore", metrics={}))
    assert waiting["info"] == "PENDING · no node fits"


def test_the_plan_names_each_stage_its_node_layers_and_the_slowest():
    out = io.StringIO()
    Console(file=out, width=100, color_system=None).print(plan_table(_view()))
    text = out.getvalue()
    assert "plan: dtype float32, lora, predicted 0.50 s/step" in text
    assert "box-a" in text and "n2" in text  # a node's name, its id where none is known
    assert "0-14" in text and "15-29" in text and "0.250 (slowest)" in text


def test_a_placed_job_says_what_each_stage_does_before_its_first_step():
    from swarmp2p.node.training.metrics import MetricsStore
    from swarmp2p.workers.events import Phase, Ready, StepDone

    store = MetricsStore()
    fold = store.fold
    fold("j", attempt=1, stage=0, n_stages=3, events=[Phase(name="fetching", total=48_000_000)])
    fold(
        "j",
        attempt=1,
        stage=0,
        n_stages=3,
        events=[Phase(name="fetching", done=12_000_000, total=48_000_000)],
    )
    fold("j", attempt=1, stage=1, n_stages=3, events=[Ready(port=5000)])
    fold("j", attempt=1, stage=2, n_stages=3, events=[Ready(port=5001), Phase(name="calibrating")])
    placed = _view(state="PLACED", step=0, attempt=1, metrics=store.get("j"))
    assert progress_fields(placed)["info"] == (
        "PLACED · s0 fetching 12/48 MB · s1 loading weights · s2 calibrating"
    )
    # another attempt's phases are not this one's; a stage that trains says nothing more
    assert progress_fields({**placed, "attempt": 2})["info"] == "PLACED"
    step = StepDone(
        step=0,
        loss=2.5,
        tokens=64,
        tokens_per_s=None,
        act_bytes=0,
        grad_bytes=0,
        step_s=0.5,
        peak_memory_bytes=0,
    )
    for stage in range(3):
        fold("j", attempt=1, stage=stage, n_stages=3, events=[step])
    running = _view(state="RUNNING", step=1, attempt=1, metrics=store.get("j"))
    info = progress_fields(running)["info"]
    assert info.startswith("RUNNING · loss 2.5000 · b0") and " s0 " not in info, info
    # a new attempt (a node lost) starts its phases afresh
    fold("j", attempt=2, stage=1, n_stages=3, events=[Phase(name="tokenizing")])
    again = _view(state="PLACED", step=1, attempt=2, metrics=store.get("j"))
    assert progress_fields(again)["info"].endswith("s1 tokenizing")


def test_a_phase_outside_the_known_ones_is_refused_naming_it():
    import pytest

    from swarmp2p.schema import SchemaError
    from swarmp2p.workers.events import decode

    with pytest.raises(SchemaError, match="name"):
        decode({"event": "phase", "stage": 0, "name": "mining bitcoin"})
