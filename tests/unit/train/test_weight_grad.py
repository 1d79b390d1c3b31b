"""The zero-bubble split backward: B gives the input gradient and leaves the weights' for W,
which then equals the whole backward's (plain and oneDNN layers, biases, frozen layers)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from swarmp2p.runtime.torch.model.packed import packing_available, use_onednn  # noqa: E402
from swarmp2p.runtime.torch.train.weight_grad import (  # noqa: E402
    SplitLinear,
    WeightGradStore,
    split_linears,
)

pytestmark = pytest.mark.torch


def _net(onednn: bool, frozen_first: bool = False) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4, bias=False))
    if frozen_first:
        net[0].requires_grad_(False)
    if onednn:
        use_onednn(net)
    return net


@pytest.mark.parametrize("onednn", [False, pytest.param(True, id="onednn")])
@pytest.mark.parametrize("frozen_first", [False, True])
def test_b_sends_the_input_gradient_and_w_the_weights(onednn, frozen_first):
    if onednn and not packing_available():
        pytest.skip("this torch build has no oneDNN linear")  # the x86 CI build has it
    ref = _net(onednn, frozen_first)
    net = copy.deepcopy(ref)
    store = WeightGradStore()
    assert split_linears(net, store) == (1 if frozen_first else 2)
    xs = [torch.randn(3, 5, 8, requires_grad=True) for _ in range(2)]
    for x in xs:  # the reference: whole backwards, accumulated
        ref(x).square().sum().backward()
    ref_input_grads = [x.grad.clone() for x in xs]
    for micro, x in enumerate(xs):
        x.grad = None
        store.collect(micro, lambda x=x: net(x).square().sum().backward())
        torch.testing.assert_close(x.grad, ref_input_grads[micro], atol=1e-6, rtol=0)
    assert store.pending() == [0, 1]
    assert all(p.grad is None for p in net.parameters())  # nothing of W ran in B
    store.apply(0)
    store.apply(1)
    for p, q in zip(net.parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0)
    assert isinstance(net[2], SplitLinear) and isinstance(net[2], nn.Linear)
    assert set(net.state_dict()) == set(ref.state_dict())


def test_outside_a_collection_the_backward_is_whole():
    net = _net(False)
    split_linears(net, WeightGradStore())
    net(torch.randn(2, 8)).sum().backward()
    assert all(p.grad is not None for p in net.parameters())


def test_w_before_b_and_b_twice_are_refused():
    store = WeightGradStore()
    with pytest.raises(ValueError, match="W3 before B3"):
        store.apply(3)
    store.collect(0, lambda: None)
    with pytest.raises(ValueError, match="micro-batch 0's backward ran twice"):
        store.collect(0, lambda: None)
