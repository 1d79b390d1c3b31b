"""Quality on the embedded model (SmolLM2-135M-Instruct) and the embedded corpus: a half-width
8-bit learned bottleneck at the middle layer, calibrated and untrained, keeps >= 95 % of the
uncompressed model's top-1 (the reference's table: 99 % on Qwen3-0.6B)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.torch, pytest.mark.slow]

try:
    import tqdm

    tqdm.tqdm.monitor_interval = 0
except ImportError:
    pass

SEQ = 128
EVAL_WINDOWS = 8
CALIBRATION_TOKENS = 4096


def _windows(rows, tokenizer, n: int) -> torch.Tensor:
    from swarmp2p.data.windows import tokenize_rows

    ids = tokenize_rows(rows, tokenizer, max_tokens=n * (SEQ + 1))
    return torch.from_numpy(ids[: n * (SEQ + 1)].astype("int64")).reshape(n, SEQ + 1)


def test_half_width_learned_bottleneck_keeps_top1_untrained():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swarmp2p.data.sources import load_splits
    from swarmp2p.runtime.torch import build_stage
    from swarmp2p.runtime.torch.model.embedded import ensure_embedded
    from swarmp2p.runtime.torch.train.calibration import CovarianceAccumulator, principal_projection
    from swarmp2p.runtime.torch.train.compression import compressor_from_spec

    folder = ensure_embedded()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).float().eval()
    n, hidden = model.config.num_hidden_layers, model.config.hidden_size
    first, second = build_stage(model, 0, n // 2), build_stage(model, n // 2, n)
    splits = load_splits("embedded")
    calibration = _windows(splits.train, tokenizer, CALIBRATION_TOKENS // SEQ)
    held_out = _windows(splits.validation, tokenizer, EVAL_WINDOWS)

    comp = compressor_from_spec("learned_bottleneck", hidden, n // 2)
    assert comp.k == 256 and comp.code_bits == 8  # half of 576, a multiple of 64
    acc = CovarianceAccumulator(hidden)
    with torch.no_grad():
        for batch in calibration.split(8):
            acc.update(first(batch[:, :-1]))
        projection = principal_projection(acc, comp.k)
        comp.set_projection(projection.mean, projection.basis)
        base = hits = total = 0
        for batch in held_out.split(4):
            h = first(batch[:, :-1])
            labels = batch[:, 1:]
            base += int((second(h).argmax(-1) == labels).sum())
            hits += int((second(comp(h)).argmax(-1) == labels).sum())
            total += labels.numel()
    assert base / total > 0.3  # the real model, not a random one
    assert hits / base >= 0.95, f"top-1 kept {hits / base:.3f} ({hits}/{base} of {total})"
