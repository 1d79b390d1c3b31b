"""LoRA across stages: target resolution by module names, in-place adapters, each stage
training only its blocks' adapters, fingerprints, clear failure when nothing trains."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from test_pipeline import _reference_lora, run_pipeline  # noqa: E402
from train_models import build_model, stage_copies, token_batches  # noqa: E402

from swarmp2p.plan.job import LoraConfig  # noqa: E402
from swarmp2p.plan.worker_spec import StageTraining  # noqa: E402
from swarmp2p.runtime.torch.model.introspect import introspect  # noqa: E402
from swarmp2p.runtime.torch.model.lora import (  # noqa: E402
    apply_lora,
    default_target_modules,
    lora_fingerprint,
    resolve_targets,
)
from swarmp2p.runtime.torch.train.bundle import build_bundle  # noqa: E402
from swarmp2p.runtime.torch.train.compression import NoCompression  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.mark.parametrize(
    ("family", "targets"),
    [
        ("llama", ("q_proj", "k_proj", "v_proj", "o_proj")),
        ("gpt2", ("c_attn",)),
        ("mixtral", ("q_proj", "k_proj", "v_proj", "o_proj")),
    ],
)
def test_default_targets_follow_the_family_table(family, targets):
    assert default_target_modules(list(introspect(build_model(family, layers=2)).blocks)) == targets


def test_unknown_architecture_falls_back_to_every_2d_weight():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mix = torch.nn.Linear(4, 4)
            self.norm = torch.nn.LayerNorm(4)
            from transformers.pytorch_utils import Conv1D

            self.fused = Conv1D(12, 4)  # GPT-2 style: matched on its 2-D weight, not nn.Linear

    assert default_target_modules([Block(), Block()]) == ("fused", "mix")


def test_fingerprint_depends_on_every_setting():
    base = LoraConfig(r=8, alpha=16, dropout=0.0)
    fp = lora_fingerprint(base, ["q_proj", "v_proj"])
    assert fp == lora_fingerprint(base, ["v_proj", "q_proj"])
    assert fp == lora_fingerprint(
        LoraConfig(r=8, alpha=16, dropout=0.0, export="adapters"), ["q_proj", "v_proj"]
    )
    others = [
        lora_fingerprint(
            LoraConfig(r=4, alpha=8, dropout=0.0), ["q_proj", "v_proj"]
        ),  # scaling same, rank not
        lora_fingerprint(LoraConfig(r=8, alpha=32, dropout=0.0), ["q_proj", "v_proj"]),
        lora_fingerprint(LoraConfig(r=8, alpha=16, dropout=0.1), ["q_proj", "v_proj"]),
        lora_fingerprint(base, ["q_proj"]),
    ]
    assert len({fp, *others}) == 5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"r": 0}, "r: must be an integer >= 1, got 0"),
        ({"dropout": 1.0}, "dropout: must be a number >= 0 and < 1, got 1.0"),
        ({"export": "zip"}, 'export: must be one of "merged", "adapters", got "zip"'),
        ({"target_modules": []}, "target_modules: must be a non-empty list"),
    ],
)
def test_bad_lora_settings_are_refused(kwargs, message):
    """The runtime takes the job's record, checked where job.json (or a manifest) is read."""
    from swarmp2p.schema import SchemaError, parse

    with pytest.raises(SchemaError) as info:
        parse(LoraConfig, kwargs)
    assert message in str(info.value)


def test_targets_that_match_nothing_fail_at_once():
    model = build_model("llama", layers=2)
    with pytest.raises(ValueError, match=r"target_modules \['c_attn'\] matched nothing"):
        apply_lora(model, LoraConfig(target_modules=("c_attn",)))


def test_stage_without_adapters_fails_clearly():
    model = build_model("llama", layers=2)
    (stage, _), _ = stage_copies(model, [1])
    with pytest.raises(ValueError, match="stage 0 has no LoRA adapters in its blocks"):
        build_bundle(
            stage, index=0, n_stages=2, send_compressor=NoCompression(), finetune_mode="lora"
        )


@pytest.mark.parametrize(
    ("family", "n", "schedule"), [("llama", 2, "1f1b"), ("gpt2", 3, "1f1b"), ("llama", 3, "zb-h1")]
)
def test_lora_pipeline_trains_only_adapters_and_matches_single_process(family, n, schedule):
    model = build_model(family)
    apply_lora(model, LoraConfig(r=4, alpha=8, dropout=0.0))
    with torch.no_grad():  # a non-zero B so that A's gradient is not zero either
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    settings = StageTraining.of(steps=2, micro_batches=2, lr=1e-3)
    batches = token_batches(2, 4, 9)
    ref_losses, ref_params = _reference_lora(model, batches, settings)
    metrics, bundles = run_pipeline(model, n, batches, settings, schedule, mode="lora")
    assert [m.loss for m in metrics[-1]] == pytest.approx(ref_losses, abs=1e-5)
    before = dict(model.named_parameters())
    for bundle, names in bundles:
        trained = {names[id(p)] for p in bundle.trainable_parameters}
        assert trained and all("lora_" in t for t in trained)
        for p in bundle.stage.parameters():
            name = names[id(p)]
            if name in trained:
                assert not torch.equal(p, before[name]), name
                torch.testing.assert_close(p.detach(), ref_params[name], atol=1e-5, rtol=0)
            else:
                assert torch.equal(p, before[name]), name
    owned = [{names[id(p)] for p in b.trainable_parameters} for b, names in bundles]
    assert set().union(*owned) == {n for n in before if "lora_" in n}
    assert sum(len(o) for o in owned) == len(set().union(*owned))  # disjoint halves
    copy.deepcopy(model)  # the adapted model stays copyable
    # resolution reads through the adapters: the same targets before and after injection
    assert resolve_targets(model, LoraConfig()) == default_target_modules(
        list(introspect(build_model(family, layers=2)).blocks)
    )


def _hybrid(family: str):
    """A tiny hybrid causal LM: block 0 linear attention only, then full, linear, full."""
    import transformers as tf

    types = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    common = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=types,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    if family == "qwen3_5":
        config = tf.Qwen3_5TextConfig(**common)
    else:
        config = tf.Qwen3NextConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16
        )
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "group"),
    [
        (
            "qwen3_5",
            ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj"),
        ),
        ("qwen3_next", ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "out_proj")),
    ],
)
def test_hybrid_stages_resolve_one_target_set_and_their_shards_merge(family, group, tmp_path):
    """Cut [1]: stage 0 holds one linear-attention block and no attention projection; it must
    resolve the whole architecture's targets, as stage 1 does, so the shards merge."""
    from swarmp2p.runtime.torch.model.loader import load_stage_shard
    from swarmp2p.runtime.torch.train.export import export_stage, reconstruct_from_shards

    base = tmp_path / "base"
    _hybrid(family).save_pretrained(base)
    settings = LoraConfig(r=4, alpha=8, dropout=0.0)
    bundles, fingerprints, dirs = [], [], []
    for index, (a, b) in enumerate([(0, 1), (1, 4)]):
        torch.manual_seed(0)
        stage = load_stage_shard(base, a, b, a == 0, b == 4)
        assert set(stage.block_types) == (
            {"linear_attention"} if index == 0 else {"linear_attention", "full_attention"}
        )
        assert resolve_targets(stage, settings) == group
        fingerprints.append(apply_lora(stage, settings))
        with torch.no_grad():  # a non-zero B: the merged shards must carry each stage's delta
            for name, p in stage.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
        bundle = build_bundle(
            stage,
            index=index,
            n_stages=2,
            finetune_mode="lora",
            recv_compressor=NoCompression() if index else None,
            send_compressor=None if index else NoCompression(),
        )
        adapted = {
            n.split(".lora_")[0].rsplit(".", 1)[-1]
            for n, _ in stage.named_parameters()
            if ".lora_" in n
        }
        assert adapted & set(group), "each stage adapts its own blocks"
        assert not adapted & {"gate_proj", "up_proj", "down_proj"}, "no MLP fallback"
        folder = tmp_path / f"stage-{index}"
        export_stage(
            bundle,
            folder,
            layers=(a, b),
            n_layers=4,
            compression=["none"],
            lora=settings,
            lora_targets=resolve_targets(stage, settings),
            lora_fingerprint=fingerprints[-1],
        )
        bundles.append(bundle)
        dirs.append(folder)
    assert fingerprints[0] == fingerprints[1] == lora_fingerprint(settings, group)
    rebuilt = reconstruct_from_shards(base, dirs).eval()  # refused when fingerprints differ
    ids = token_batches(1, 2, 8, seed=3)[0][:, :-1]
    with torch.no_grad():
        chained = bundles[1].stage(bundles[0].stage(ids))
        torch.testing.assert_close(rebuilt(ids).logits, chained, atol=1e-5, rtol=0)
        assert not torch.allclose(_hybrid(family)(ids).logits, chained, atol=1e-3)


def test_the_runtime_trains_at_the_jobs_defaults():
    """A job.json that sets nothing: the adapters PEFT builds and the optimizer the stage steps
    take the job's defaults (declared once, in ``plan/job.py``)."""
    from swarmp2p.plan.job import TrainConfig
    from swarmp2p.runtime.torch.model.lora import lora_config
    from swarmp2p.runtime.torch.train.steps import make_optimizer
    from swarmp2p.schema import parse

    lora, train = parse(LoraConfig, {}), parse(TrainConfig, {})
    model = build_model("llama", layers=2)
    peft = lora_config(model, lora)
    assert (peft.r, peft.lora_alpha, peft.lora_dropout) == (lora.r, lora.alpha, lora.dropout)
    assert (peft.r, peft.lora_alpha, peft.lora_dropout) == (8, 16.0, 0.05)
    apply_lora(model, lora)
    (stage, _), _ = stage_copies(model, [1])
    bundle = build_bundle(
        stage, index=0, n_stages=2, send_compressor=NoCompression(), finetune_mode="lora"
    )
    (group,) = make_optimizer(bundle, StageTraining.of()).param_groups
    assert group["lr"] == train.lr == 2e-4
    assert group["weight_decay"] == 0.0
