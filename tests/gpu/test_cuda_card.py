"""The card itself: the daemon's NVML probe reads it and the planner picks its dtype; the SDPA
kernels ``plan/hardware.py`` reasons about, at 4096 tokens, run where it says and hold what it
prices (Flash takes grouped-query heads on 8.0+, the memory-efficient kernel refuses them and
runs once ``swarm_sdpa`` expands keys and values, the math kernel holds seq x seq scores)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _gpu import MARKS, tiny_model

from swarmp2p.node.hardware import probe
from swarmp2p.plan import Plan, parse_job, plan_job
from swarmp2p.plan.hardware import (
    CAPABILITIES,
    SWARM_SDPA_CAPABILITY,
    expands_grouped_kv,
    training_kernel,
)

pytestmark = MARKS

SEQ, HEADS, KV_HEADS, HEAD_DIM = 4096, 8, 2, 64


def _torch():
    import torch

    return torch


def test_nvml_probe_reads_the_card_and_the_planner_resolves_its_dtype(tmp_path: Path):
    torch = _torch()
    record, host = probe(node_id="g", name="gpu-host", version="test", env={})
    node = record.node
    cuda = [d for d in node.devices if d.kind == "cuda"]
    assert len(cuda) == torch.cuda.device_count(), record
    card = cuda[0]
    props = torch.cuda.get_device_properties(0)
    assert card.name == props.name and not record.fake
    assert abs(card.memory_total - props.total_memory) <= 0.02 * props.total_memory
    assert 0 < card.memory_free <= card.memory_total
    major, minor = torch.cuda.get_device_capability(0)
    assert card.compute_capability == f"{major}.{minor}"
    assert host.driver, host

    model = tiny_model(tmp_path / "m")
    job = parse_job({"model": {"pretrained": str(model)}, "split": {"stages": 1}})
    plan = plan_job(job, [node])
    want = "bfloat16" if (major, minor) >= (8, 0) else "float16" if major >= 7 else "float32"
    assert isinstance(plan, Plan), plan
    assert plan.dtype == want, plan.dtype
    assert plan.stages[0].devices[0] == "cuda:0"


def _qkv(dtype, kv_heads=KV_HEADS):
    torch = _torch()
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, HEADS, SEQ, HEAD_DIM, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(1, kv_heads, SEQ, HEAD_DIM, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(1, kv_heads, SEQ, HEAD_DIM, device="cuda", dtype=dtype, generator=gen)
    return q, k, v


def _peak(fn):
    """(fn's result, the CUDA memory it allocated past what was held before it)."""
    torch = _torch()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - before


def _scores_bytes(dtype) -> int:
    return HEADS * SEQ * SEQ * _torch().tensor([], dtype=dtype).element_size()


def test_sdpa_kernels_at_4096_tokens_with_and_without_the_grouped_query_expansion():
    torch = _torch()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    cc = torch.cuda.get_device_capability(0)
    bf16 = torch.bfloat16
    q, k, v = _qkv(bf16)
    groups = HEADS // KV_HEADS
    k_x, v_x = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = _scores_bytes(bf16)

    # the memory-efficient kernel takes no grouped-query call: the reason swarm_sdpa expands
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION), pytest.raises(RuntimeError):
        sdpa(q, k, v, is_causal=True, enable_gqa=True)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        expanded, held = _peak(lambda: sdpa(q, k_x, v_x, is_causal=True))
    assert held < scores / 4, (held, scores)  # no seq x seq scores
    # the math kernel (where transformers' own grouped call lands without Flash) holds them
    with sdpa_kernel(SDPBackend.MATH):
        math_out, math_held = _peak(lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True))
    assert math_held >= scores, (math_held, scores)
    torch.testing.assert_close(expanded, math_out, atol=2e-2, rtol=2e-2)

    # the rule both the planner and swarm_sdpa follow, on this card
    assert expands_grouped_kv(cc, "bfloat16", True) == (cc < (8, 0))
    assert expands_grouped_kv(cc, "float32", True)  # Flash never runs float32
    if cc >= (8, 0):  # the branch this card takes: Flash runs the grouped call as it is
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            flash, flash_held = _peak(lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True))
        assert flash_held < scores / 4, (flash_held, scores)
        torch.testing.assert_close(flash, expanded, atol=2e-2, rtol=2e-2)
    else:  # below 8.0 Flash is not there at all
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), pytest.raises(RuntimeError):
            sdpa(q, k, v, is_causal=True, enable_gqa=True)


def test_swarm_sdpa_keeps_scores_off_the_card_in_bfloat16_and_float32():
    """``swarm_sdpa_forward`` as a training stage calls it: no seq x seq scores in either dtype
    (float32 through the expansion and the memory-efficient kernel, bfloat16 by Flash on 8.0+),
    and the planner names the same kernel for the probed card."""
    torch = _torch()
    from swarmp2p.runtime.torch.model.attention import swarm_sdpa_forward

    class Attn(torch.nn.Module):
        num_key_value_groups = HEADS // KV_HEADS
        is_causal = True
        training = True

    record, _ = probe(node_id="g", name="gpu-host", version="test", env={})
    node = record.node
    card = next(d for d in node.devices if d.kind == "cuda")
    own = frozenset(CAPABILITIES)
    assert SWARM_SDPA_CAPABILITY in own
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = _qkv(dtype)
        (out, _), held = _peak(lambda q=q, k=k, v=v: swarm_sdpa_forward(Attn(), q, k, v, None))
        assert held < _scores_bytes(dtype) / 4, (dtype, held)
        assert out.isfinite().all()
        name = str(dtype).removeprefix("torch.")
        kernel = training_kernel(node, card, name, True, own)
        assert kernel in ("flash", "memory-efficient"), kernel
        if torch.cuda.get_device_capability(0) >= (8, 0):
            assert kernel == ("flash" if dtype == torch.bfloat16 else "memory-efficient")
