"""``swarm_sdpa`` (runtime/torch/model/attention.py): the dispatch on a faked CUDA capability
(grouped-query keys and values expanded below 8.0 and in float32, transformers' own SDPA path
at and above 8.0 in half precision), outputs equal to transformers' ``sdpa`` on the CPU, the
sliding-window mask kept, and every training stage switched to it."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf

from swarmp2p.runtime.torch.model import attention
from swarmp2p.runtime.torch.model.hf_compat import attn_implementation
from swarmp2p.runtime.torch.model.stage import build_stage
from swarmp2p.runtime.torch.train.bundle import build_bundle

HEADS, KV_HEADS = 4, 2


def tiny(cls=tf.LlamaConfig, **extra):
    torch.manual_seed(0)
    config = cls(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=64,
        **extra,
    )
    return tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Every call of torch's SDPA: (key heads, value heads, its keyword arguments)."""
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, *args, **kwargs):
        calls.append((k.shape[1], v.shape[1], dict(kwargs)))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return calls


def run(model, ids, *, capability, monkeypatch):
    monkeypatch.setattr(attention, "device_capability", lambda device: capability)
    stage = build_stage(model, 0, 2)
    with torch.no_grad():
        return stage(ids)


@pytest.mark.parametrize(
    ("capability", "dtype", "expanded"),
    [
        ((7, 5), torch.float16, True),  # Turing: no Flash, the math kernel would hold scores
        ((6, 1), torch.float32, True),  # Pascal
        ((7, 5), torch.bfloat16, True),
        ((8, 0), torch.bfloat16, False),  # Flash runs the grouped call itself
        ((8, 6), torch.float16, False),
        ((8, 6), torch.float32, True),  # Flash takes no float32
        (None, torch.float32, False),  # not CUDA: transformers' own path
    ],
)
def test_grouped_keys_are_expanded_exactly_where_flash_cannot_run(
    capability, dtype, expanded, sdpa_calls, monkeypatch
):
    model = tiny().to(dtype)
    attention.use_swarm_sdpa(build_stage(model, 0, 2))
    run(model, torch.randint(0, 128, (2, 12)), capability=capability, monkeypatch=monkeypatch)
    assert len(sdpa_calls) == 2  # one per block
    for k_heads, v_heads, kwargs in sdpa_calls:
        if expanded:
            assert (k_heads, v_heads) == (HEADS, HEADS) and "enable_gqa" not in kwargs
        else:
            assert (k_heads, v_heads) == (KV_HEADS, KV_HEADS) and kwargs["enable_gqa"] is True


@pytest.mark.parametrize("capability", [(7, 5), (8, 6), None])
@pytest.mark.parametrize(
    ("cls", "extra"),
    [(tf.LlamaConfig, {}), (tf.MistralConfig, {"sliding_window": 4})],
)
def test_outputs_equal_transformers_sdpa(cls, extra, capability, monkeypatch):
    model = tiny(cls, **extra)
    ids = torch.randint(0, 128, (2, 12))  # longer than the sliding window
    with torch.no_grad():
        want = build_stage(model, 0, 2)(ids)
    ours = copy.deepcopy(model)
    assert attention.use_swarm_sdpa(build_stage(ours, 0, 2))
    got = run(ours, ids, capability=capability, monkeypatch=monkeypatch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_training_stage_runs_swarm_sdpa_and_an_eager_one_keeps_eager():
    model = tiny()
    bundle = build_bundle(build_stage(model, 0, 2), index=0, n_stages=1)
    assert attn_implementation(bundle.stage.config) == "swarm_sdpa"
    assert attn_implementation(model.config) == "swarm_sdpa"  # the blocks read this config
    eager = tf.AutoModelForCausalLM.from_config(model.config, attn_implementation="eager")
    bundle = build_bundle(build_stage(eager, 0, 2), index=0, n_stages=1)
    assert attn_implementation(bundle.stage.config) == "eager"
