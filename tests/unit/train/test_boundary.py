"""The boundary: payload and labels forward, (loss, gradient) back, (step, micro) checked,
quantized payloads carried losslessly as codes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from swarmp2p.net import InProcLink  # noqa: E402
from swarmp2p.runtime.torch.train.boundary import (  # noqa: E402
    ACT,
    GRAD,
    BoundaryError,
    Channel,
    LinkTimeout,
    StaleReply,
    from_frame,
    send_through,
    to_frame,
)
from swarmp2p.runtime.torch.train.compression import fake_quantize  # noqa: E402

pytestmark = pytest.mark.torch


def _channels(timeout: float = 5.0) -> tuple[Channel, Channel]:
    a, b = InProcLink.pair()
    return Channel(a, timeout=timeout), Channel(b, timeout=timeout)


def test_gradient_crosses_the_boundary_like_one_graph():
    up, down = _channels()
    w_up = torch.randn(8, 8, requires_grad=True)
    w_down = torch.randn(8, 3, requires_grad=True)
    x = torch.randn(4, 8)
    labels = torch.tensor([0, 1, 2, 0])

    sent = send_through(up, torch.tanh(x @ w_up), step=7, micro=2, labels=labels)
    payload, got_labels = down.recv_activation(7, 2)
    assert torch.equal(got_labels, labels)
    payload.requires_grad_()
    loss = torch.nn.functional.cross_entropy(payload @ w_down, got_labels)
    loss.backward()
    down.send_reply(7, 2, payload.grad, loss.item())
    sent.backward()
    assert sent.loss == pytest.approx(loss.item())

    ref_up = w_up.detach().clone().requires_grad_()
    ref_down = w_down.detach().clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(torch.tanh(x @ ref_up) @ ref_down, labels)
    ref.backward()
    assert torch.equal(w_up.grad, ref_up.grad)
    assert torch.equal(w_down.grad, ref_down.grad)


def test_reply_for_another_micro_batch_raises_stale_reply():
    up, down = _channels()
    w = torch.randn(4, 4, requires_grad=True)
    sent = send_through(up, torch.ones(2, 4) @ w, step=3, micro=0, labels=torch.zeros(2))
    down.recv_activation(3, 0)
    down.send_reply(3, 1, torch.ones(2, 4), 0.5)
    with pytest.raises(
        StaleReply, match=r"expected grad for \(step 3, micro 0\), got grad for \(step 3, micro 1\)"
    ):
        sent.backward()
    assert w.grad is None


def test_activation_for_another_step_raises_stale_reply():
    up, down = _channels()
    up.send_activation(4, 0, torch.zeros(1, 2), torch.zeros(1))
    with pytest.raises(StaleReply, match=r"got act for \(step 4, micro 0\)"):
        down.recv_activation(5, 0)


def test_silent_neighbour_times_out():
    up, _ = _channels(timeout=0.05)
    with pytest.raises(LinkTimeout, match=r"within 0\.05 s"):
        up.recv_reply(0, 0)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("per_token", [False, True])
def test_quantized_payload_crosses_as_codes_losslessly(bits, per_token):
    x = fake_quantize(torch.randn(3, 5, 64) * 3, bits, per_token=per_token)
    codec = f"tokint{bits}" if per_token else f"int{bits}"
    frame = to_frame(x, codec, step=2, micro=1)
    assert frame.codec == codec and (frame.step, frame.micro) == (2, 1)
    assert torch.equal(from_frame(frame), x)
    assert frame.nbytes < x.numel() * bits / 8 + 4 * 15 + 1  # packed codes plus the scale(s)


def test_payload_not_on_the_grid_goes_as_floats():
    x = torch.randn(2, 16)
    frame = to_frame(x, "int8")
    assert frame.codec == "none" and frame.nbytes == 4 * x.numel()
    assert torch.equal(from_frame(frame), x)
    frame = to_frame(x.half().float(), "fp16")
    assert frame.codec == "fp16" and frame.nbytes == 2 * x.numel()


def test_bfloat16_and_byte_counts():
    up, down = _channels()
    x = torch.randn(2, 3, dtype=torch.bfloat16)
    up.send_activation(0, 0, x, torch.arange(2))
    payload, _ = down.recv_activation(0, 0)
    assert payload.dtype == torch.bfloat16 and torch.equal(payload, x)
    assert up.sent_bytes[ACT] > 12 and up.sent_bytes[GRAD] == 0


def test_truncated_frame_is_refused():
    up, down = _channels()
    up.send_activation(0, 0, torch.randn(4), torch.zeros(1))
    message = up.link._outbox.get()
    message[1] = message[1][:-1] if len(message[1]) > 8 else message[1]
    message[2] = message[2][:-1]
    up.link._outbox.put(message)
    with pytest.raises(BoundaryError, match="bad tensor frame"):
        down.recv_activation(0, 0)


def test_control_messages_are_named():
    up, down = _channels()
    up.send_control("projection", [torch.ones(2, 2)], boundary=0)
    header, tensors = down.recv_control("projection")
    assert header["boundary"] == 0 and torch.equal(tensors[0], torch.ones(2, 2))
    up.send_control("eval")
    with pytest.raises(StaleReply, match="expected control message 'projection'"):
        down.recv_control("projection")


def test_on_the_cpu_the_host_copy_is_the_tensor_itself_and_the_bytes_are_unchanged():
    """The pinned, side-stream copy is a card's path: a CPU tensor goes as it is (no copy, no
    stream), and a channel sends exactly the parts ``to_frame`` makes of it."""
    from swarmp2p.runtime.torch.train.boundary import HostCopy

    x = torch.randn(3, 5, requires_grad=True) * 2
    host = HostCopy()(x)
    assert host.data_ptr() == x.data_ptr() and not host.requires_grad and not host.is_pinned()
    sent: list = []

    class Recorder:
        def send(self, parts, timeout=None):
            sent.append([bytes(memoryview(p)) for p in parts])

    channel = Channel(Recorder(), timeout=1.0)
    channel.send_activation(4, 1, x, torch.arange(3))
    want = [bytes(memoryview(p)) for p in to_frame(x, step=4, micro=1).to_parts()]
    assert sent[0][1 : 1 + len(want)] == want


def test_the_gradient_comes_back_in_the_payload_dtype_on_its_device():
    up, down = _channels()
    w = torch.randn(4, 4, dtype=torch.bfloat16, requires_grad=True)
    sent = send_through(
        up, torch.ones(2, 4, dtype=torch.bfloat16) @ w, step=0, micro=0, labels=torch.zeros(2)
    )
    down.recv_activation(0, 0)
    down.send_reply(0, 0, torch.ones(2, 4), 1.0)  # float32 on the wire
    sent.backward()
    assert w.grad.dtype == torch.bfloat16 and w.grad.device == w.device
    assert torch.equal(w.grad, torch.full((4, 4), 2.0, dtype=torch.bfloat16))
