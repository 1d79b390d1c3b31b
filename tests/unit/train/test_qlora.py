"""QLoRA: NF4 stages on the CPU with LoRA adapters over 2 stages; the loss falls and the export
holds adapters only."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("bitsandbytes")

from train_models import build_model, run_threads  # noqa: E402

from swarmp2p.net import InProcLink  # noqa: E402
from swarmp2p.plan import stage_schedule  # noqa: E402
from swarmp2p.plan.job import LoraConfig  # noqa: E402
from swarmp2p.plan.worker_spec import StageTraining  # noqa: E402
from swarmp2p.runtime.torch import load_stage_shard  # noqa: E402
from swarmp2p.runtime.torch.model.lora import apply_lora, resolve_targets  # noqa: E402
from swarmp2p.runtime.torch.train.boundary import Channel  # noqa: E402
from swarmp2p.runtime.torch.train.bundle import build_bundle  # noqa: E402
from swarmp2p.runtime.torch.train.compression import NoCompression  # noqa: E402
from swarmp2p.runtime.torch.train.export import export_stage, read_manifest  # noqa: E402
from swarmp2p.runtime.torch.train.steps import train_stage  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

try:
    import tqdm

    tqdm.tqdm.monitor_interval = 0
except ImportError:
    pass


def test_qlora_two_stages_loss_falls_and_exports_adapters_only(tmp_path):
    folder = tmp_path / "base"
    build_model("llama").save_pretrained(folder)
    settings = LoraConfig(r=8, alpha=16, dropout=0.0, export="merged")
    bundles, fingerprints = [], []
    for i, (a, b) in enumerate([(0, 2), (2, 4)]):
        torch.manual_seed(0)
        stage = load_stage_shard(
            folder, a, b, i == 0, i == 1, quantization={"bits": 4, "compute_dtype": "float32"}
        )
        assert any("4bit" in type(m).__name__ for m in stage.modules())
        fingerprints.append(apply_lora(stage, settings))
        bundles.append(
            build_bundle(
                stage,
                index=i,
                n_stages=2,
                finetune_mode="lora",
                recv_compressor=NoCompression() if i else None,
                send_compressor=None if i else NoCompression(),
            )
        )
    assert fingerprints[0] == fingerprints[1]
    # one fixed batch, trained on repeatedly: the adapters must fit it
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 128, (4, 17), generator=gen)
    train = StageTraining.of(steps=12, micro_batches=2, lr=2e-2)
    a, b = InProcLink.pair()

    def run(i):
        return train_stage(
            bundles[i],
            train,
            stage_schedule("1f1b", i, 2, 2),
            prev=Channel(b, timeout=60) if i else None,
            next=None if i else Channel(a, timeout=60),
            batches=iter([batch] * 12) if i == 0 else None,
        )

    metrics = run_threads([lambda: run(0), lambda: run(1)])
    losses = [m.loss for m in metrics[1]]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
    for i, bundle in enumerate(bundles):
        d = tmp_path / f"stage-{i}"
        export_stage(
            bundle,
            d,
            layers=((0, 2), (2, 4))[i],
            n_layers=4,
            lora=settings,
            lora_targets=resolve_targets(bundle.stage, settings),
            lora_fingerprint=fingerprints[i],
            base_is_quantized=True,
        )
        manifest = read_manifest(d)
        assert manifest["weights_included"] is False and manifest["lora"]["export"] == "adapters"
        assert "adapter/adapter_model.safetensors" in manifest["files"]
