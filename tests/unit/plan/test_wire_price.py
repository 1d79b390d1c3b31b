"""The planner prices a boundary at the bytes of the frame the wire actually sends for it
(issue 26 item 4): one layout (``swarmp2p.codec_layout``) gives both the price and the packing,
so ``fixed_int3`` costs what ``fixed_int4`` costs and ``fixed_int5``..``fixed_int7`` what
``fixed_int8`` costs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from _plan_factories import A5000, gpu, job, node

from swarmp2p.plan import load_model_shape, plan_job
from swarmp2p.plan.hardware import Speeds
from swarmp2p.plan.split import parse_compression
from swarmp2p.wire import encode_tensor

SPECS = [
    "none",
    "fp16",
    *(f"fixed_int{n}" for n in range(2, 9)),
    *(
        {"method": "learned_bottleneck", "learned_dim": k, "code_bits": b}
        for b in (2, 3, 4, 5, 6, 7, 8, 16)
        for k in (64, 100)
    ),
]
WIDTHS = (576, 577, 2048, 5120)


def _frame(c, tokens: int, hidden: int, dtype: str = "float32"):
    """The frame the wire encodes for ``tokens`` tokens of this boundary's payload."""
    x = np.random.default_rng(0).standard_normal((tokens, c.payload_width(hidden)))
    return encode_tensor(x.astype(np.float32), c.sent_codec(dtype), exact=False)


@pytest.mark.parametrize("hidden", WIDTHS)
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_one_token_price_is_a_one_token_frame(spec, hidden):
    c = parse_compression(spec)
    assert c.bytes_per_token(hidden, "float32") == _frame(c, 1, hidden).nbytes


@pytest.mark.parametrize("hidden", WIDTHS)
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_a_frame_of_many_tokens_costs_what_it_has(spec, hidden):
    c = parse_compression(spec)
    for tokens in (3, 512):
        assert c.frame_bytes(tokens, hidden, "float32") == _frame(c, tokens, hidden).nbytes


@pytest.mark.parametrize(("bits", "slot"), [(2, 2), (3, 4), (4, 4), (5, 8), (6, 8), (7, 8)])
def test_codes_are_priced_by_their_slot_not_their_width(bits, slot):
    c = parse_compression(f"fixed_int{bits}")
    assert c.bytes_per_token(576, "float32") == 576 * slot // 8 + 4
    assert c.frame_bytes(1000, 576, "float32") == 1000 * 576 * slot // 8 + 4  # one scale a frame


def test_the_speed_split_counts_the_frames_it_sends():
    link = 10_000_000
    dev = dataclasses.replace(gpu(*A5000, 20), speed=Speeds.from_data({"float32": 2e12}, "speed"))
    cluster = [dataclasses.replace(node(n, dev), link_speed=link) for n in ("a", "b")]
    spec = job(
        split={"compression": "fixed_int5"},
        model={"pretrained": "embedded", "dtype": "float32"},
        train={"batch_size": 4, "seq_len": 128, "micro_batches": 2},
    )
    shape = load_model_shape("embedded")
    plan = plan_job(spec, cluster, shape=shape)
    assert plan.features and "wire-v2" in plan.features
    micro = plan.schedule.micro_batches
    c = parse_compression("fixed_int5")
    frame = _frame(c, 4 // micro * 128, shape.hidden).nbytes
    sent = plan.timing.stages[0].sent_bytes
    assert sent == micro * frame + 4 * 128 * 8  # the activation frames and the int64 labels
    assert plan.boundaries[0].bytes_per_token == shape.hidden + 4  # 576, not 364
