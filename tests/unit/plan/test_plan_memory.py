"""Stage memory prices: weights, trainable state, activations, loss, KV cache, transient."""

from __future__ import annotations

import pytest
from _plan_factories import llama_config

from swarmp2p.plan import Pricing, StagePricer, Workload, from_config, load_model_shape
from swarmp2p.plan import normalize_quantization as q
from swarmp2p.plan.memory import lora_params_per_layer, loss_chunk_tokens

SMOL = load_model_shape("embedded")
L = SMOL.n_layers


def price(pricing: Pricing, workload: Workload | None = None, first=True, last=True, **kw):
    pricer = StagePricer(SMOL, pricing, workload or Workload(batch_size=4, seq_len=128))
    return pricer.price(0, L, first=first, last=last, **kw)


@pytest.mark.parametrize(
    ("dtype", "per_param"),
    [("bfloat16", 16), ("float16", 16), ("float32", 12)],
)
def test_full_finetune_state_per_parameter(dtype, per_param):
    m = price(Pricing(dtype=dtype, finetune_mode="full"))
    assert m.trainable_state == SMOL.total_params * per_param


def test_weights_by_dtype_and_quantization():
    params = SMOL.total_params
    assert price(Pricing(dtype="float32")).weights == params * 4
    assert price(Pricing(dtype="bfloat16")).weights == params * 2
    four = price(Pricing(dtype="bfloat16", finetune_mode="lora", quantization=q({"bits": 4})))
    layer = sum(SMOL.layer_params)
    outer = params - layer  # embeddings and head stay in the compute dtype
    assert four.weights == int(layer * 0.52 + outer * 2)


def test_weight_dtype_applies_only_to_a_frozen_backbone():
    lora = price(Pricing(dtype="float32", finetune_mode="lora", weight_dtype="float16"))
    full = price(Pricing(dtype="float32", finetune_mode="full", weight_dtype="float16"))
    assert lora.weights == SMOL.total_params * 2
    assert full.weights == SMOL.total_params * 4


@pytest.mark.parametrize(
    ("dtype", "per_adapter"),
    # the adapter itself (compute dtype), its fp32 gradient and two moments, and in half
    # precision the fp32 master copy AdamW steps
    [("bfloat16", 2 + 4 + 4 + 8), ("float16", 2 + 4 + 4 + 8), ("float32", 4 + 4 + 8)],
)
def test_lora_adapters_only(dtype, per_adapter):
    m = price(Pricing(dtype=dtype, finetune_mode="lora", lora_r=8))
    per_layer = 8 * ((576 + 576) + 2 * (576 + 192) + (576 + 576))
    assert lora_params_per_layer(SMOL, 8, None) == per_layer
    assert m.trainable_state == per_layer * L * per_adapter


def test_modes_order_and_none_trains_nothing():
    full, lora, comp, none = (
        price(Pricing(dtype="bfloat16", finetune_mode=m))
        for m in ("full", "lora", "compressor_only", "none")
    )
    assert full.trainable_state > lora.trainable_state > comp.trainable_state == 0
    assert none.trainable_state == none.activations == none.loss == 0


def test_recompute_and_efficient_attention_shrink_activations():
    base = Workload(batch_size=4, seq_len=1024)
    plain = price(Pricing(dtype="bfloat16"), base)
    flash = price(
        Pricing(dtype="bfloat16"), Workload(batch_size=4, seq_len=1024, efficient_attention=True)
    )
    recompute = price(
        Pricing(dtype="bfloat16"), Workload(batch_size=4, seq_len=1024, recompute=True)
    )
    assert flash.activations < plain.activations
    assert recompute.activations + recompute.transient < plain.activations
    tokens = 4 * 1024
    assert recompute.activations == tokens * 576 * 2 * L  # one input per layer
    # Korthikanti et al.: 34 s b h + 5 a s^2 b bytes per layer at 16 bits; SmolLM2's gated
    # MLP (3 x 576 x 1536) has exactly the parameters of GPT's 4h MLP (8 x 576^2)
    assert flash.activations == 34 * 576 * tokens * L
    assert plain.activations == (34 * 576 + 5 * 9 * 1024) * tokens * L


def test_activations_scale_with_micro_batches_in_flight():
    w = Workload(batch_size=8, seq_len=128, micro_batches=4)
    one = price(Pricing(dtype="bfloat16"), w, in_flight=1)
    three = price(Pricing(dtype="bfloat16"), w, in_flight=3)
    assert three.activations == 3 * one.activations
    whole = price(Pricing(dtype="bfloat16"), Workload(batch_size=8, seq_len=128))
    assert whole.activations == 4 * one.activations


def test_chunked_loss():
    w = Workload(batch_size=16, seq_len=2048)
    plain = price(Pricing(dtype="bfloat16"), w)
    chunked = price(
        Pricing(dtype="bfloat16"), Workload(batch_size=16, seq_len=2048, chunked_loss=True)
    )
    assert plain.loss == 2 * 16 * 2048 * 49152 * 4
    assert chunked.loss == 2 * loss_chunk_tokens(49152) * 49152 * 4
    assert price(Pricing(dtype="bfloat16"), w, last=False).loss == 0


def test_kv_cache_for_serving():
    w = Workload(training=False, serving_sessions=3, serving_tokens=1000)
    m = price(Pricing(dtype="bfloat16", finetune_mode="none"), w)
    assert m.kv_cache == 2 * L * 3 * 64 * 2 * 3 * 1000
    assert m.trainable_state == m.activations == 0


def test_quantized_load_transient_is_one_layer():
    m = price(Pricing(dtype="bfloat16", finetune_mode="lora", quantization=q({"bits": 8})))
    assert m.transient >= max(SMOL.layer_params) * 4


def test_tied_last_stage_holds_the_embedding():
    pricer = StagePricer(SMOL, Pricing(dtype="float32"), Workload())
    assert pricer.held_outer_params(False, True) == SMOL.head_params + SMOL.embed_params
    untied = from_config(llama_config())
    p2 = StagePricer(untied, Pricing(dtype="float32"), Workload())
    assert p2.held_outer_params(False, True) == untied.head_params


def test_learned_compressor_halves_are_priced():
    from swarmp2p.plan import parse_compression

    c = parse_compression({"method": "learned_bottleneck", "learned_dim": 256})
    pricer = StagePricer(
        SMOL, Pricing(dtype="float32", finetune_mode="compressor_only"), Workload()
    )
    sender = pricer.price(0, 15, first=True, last=False, send=c)
    halves = 576 * 256 + 256
    assert sender.trainable_state == halves * 12  # fp32 gradient + two moments
    half = StagePricer(
        SMOL, Pricing(dtype="bfloat16", finetune_mode="compressor_only"), Workload()
    ).price(0, 15, first=True, last=False, send=c)
    assert half.trainable_state == halves * 16  # + the fp32 master copy
    assert half.weights == sender.weights // 2  # the halves compute in the job's dtype too
