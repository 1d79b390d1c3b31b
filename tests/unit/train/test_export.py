"""Export and reconstruction: per-stage shards with manifests, merged or adapters, the
reconstructed model's logits equal to the trained pipeline's, mismatched halves refused."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from test_pipeline import run_pipeline  # noqa: E402
from train_models import build_model, token_batches  # noqa: E402

from swarmp2p.plan.job import LoraConfig  # noqa: E402
from swarmp2p.plan.worker_spec import StageTraining  # noqa: E402
from swarmp2p.runtime.torch.model.lora import apply_lora, resolve_targets  # noqa: E402
from swarmp2p.runtime.torch.train.export import export_stage, read_manifest, reconstruct_from_shards  # noqa: E402

pytestmark = pytest.mark.torch

try:  # tqdm's monitor thread (from_pretrained's progress bar) would trip the leak check
    import tqdm

    tqdm.tqdm.monitor_interval = 0
except ImportError:
    pass


def _chain(bundles, ids):
    with torch.no_grad():
        x = ids
        for b, _ in bundles:
            b.stage.eval()
            x = b.stage(b.receive(x) if b.index > 0 else x)
            if not b.is_last:
                x = b.send(x)
    return x


def _export(bundles, root, n, lora=None, targets=(), fingerprint=None, cuts=(2,)):
    bounds = [0, *cuts, 4]
    dirs = []
    for b, _ in bundles:
        d = root / f"stage-{b.index}"
        export_stage(
            b,
            d,
            layers=(bounds[b.index], bounds[b.index + 1]),
            n_layers=4,
            compression=["none"] * (n - 1),
            lora=lora,
            lora_targets=targets,
            lora_fingerprint=fingerprint,
            evaluation={"trained": {"loss": 1.0}},
        )
        dirs.append(d)
    return dirs


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("base")
    model = build_model("llama")
    model.save_pretrained(folder)
    return folder, model


def test_full_finetune_export_reconstructs_the_trained_model(base, tmp_path):
    folder, model = base
    settings = StageTraining.of(steps=2, micro_batches=2, lr=1e-2)
    _, bundles = run_pipeline(model, 3, token_batches(2, 4, 9), settings, "gpipe")
    dirs = _export(bundles, tmp_path, 3, cuts=(1, 3))
    manifest = read_manifest(dirs[1])
    assert manifest["layers"] == [1, 3] and manifest["weights_included"] is True
    assert set(manifest["files"]) == {
        "weights.safetensors",
        "compressor-recv.pt",
        "compressor-send.pt",
    }
    rebuilt = reconstruct_from_shards(folder, dirs).eval()
    ids = token_batches(1, 2, 12, seed=9)[0][:, :-1]
    torch.testing.assert_close(rebuilt(ids).logits, _chain(bundles, ids), atol=1e-5, rtol=0)
    assert not torch.allclose(model(ids).logits, rebuilt(ids).logits, atol=1e-3)  # it trained


@pytest.mark.parametrize("export", ["merged", "adapters"])
def test_lora_export_reconstructs_the_trained_model(base, tmp_path, export):
    folder, _model = base
    settings = LoraConfig(r=4, alpha=8, dropout=0.0, export=export)
    adapted = build_model("llama")
    fingerprint = apply_lora(adapted, settings)
    targets = resolve_targets(adapted, settings)
    _, bundles = run_pipeline(
        adapted,
        2,
        token_batches(2, 4, 9),
        StageTraining.of(steps=2, lr=1e-2, micro_batches=1),
        "1f1b",
        mode="lora",
    )
    dirs = _export(bundles, tmp_path, 2, lora=settings, targets=targets, fingerprint=fingerprint)
    manifest = read_manifest(dirs[0])
    assert manifest["lora_fingerprint"] == fingerprint
    assert manifest["weights_included"] is (export == "merged")
    assert ("adapter/adapter_model.safetensors" in manifest["files"]) is (export == "adapters")
    ids = token_batches(1, 2, 12, seed=9)[0][:, :-1]
    rebuilt = reconstruct_from_shards(folder, dirs, merge_adapters=True).eval()
    torch.testing.assert_close(rebuilt(ids).logits, _chain(bundles, ids), atol=1e-5, rtol=0)
    assert not any("lora_" in n for n, _ in rebuilt.named_parameters())


def test_mismatched_fingerprints_are_refused(base, tmp_path):
    folder, model = base
    _, bundles = run_pipeline(
        model, 2, token_batches(1, 4, 9), StageTraining.of(steps=1, micro_batches=1), "1f1b"
    )
    dirs = _export(bundles, tmp_path, 2)
    manifest_path = dirs[0] / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["lora_fingerprint"] = "6f1c0000aaaa"
    manifest["lora"] = {"export": "merged"}
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(
        ValueError, match=r"\(stage-0=6f1c0000aaaa, stage-1=none\)\. Retrain the stages"
    ):
        reconstruct_from_shards(folder, dirs)


def test_a_corrupted_shard_file_is_refused(base, tmp_path):
    folder, model = base
    _, bundles = run_pipeline(
        model, 2, token_batches(1, 4, 9), StageTraining.of(steps=1, micro_batches=1), "1f1b"
    )
    dirs = _export(bundles, tmp_path, 2)
    with open(dirs[1] / "weights.safetensors", "r+b") as handle:
        handle.seek(-1, 2)
        handle.write(b"\x00")
    with pytest.raises(ValueError, match="does not match its sha256"):
        reconstruct_from_shards(folder, dirs)


def test_a_one_stage_tied_model_exports_its_head_once_and_loads_back(tmp_path):
    """One stage holds both ends of a tied model: the head is its embedding, stored once."""
    import transformers as tf

    from swarmp2p.runtime.torch import build_stage
    from swarmp2p.runtime.torch.serve.trained import _load_weights
    from swarmp2p.runtime.torch.train.bundle import build_bundle

    config = tf.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).float()
    model.save_pretrained(tmp_path / "base")
    bundle = build_bundle(build_stage(model, 0, 2), index=0, n_stages=1)
    with torch.no_grad():
        bundle.stage.embed.weight.add_(0.5)  # "trained": the tied head moves with it
    export_stage(bundle, tmp_path / "stage-0", layers=(0, 2), n_layers=2)
    from safetensors.torch import load_file

    assert "lm_head.weight" not in load_file(tmp_path / "stage-0" / "weights.safetensors")
    rebuilt = reconstruct_from_shards(tmp_path / "base", [tmp_path / "stage-0"]).eval()
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids).logits, bundle.stage.eval()(ids))
    fresh = build_stage(tf.AutoModelForCausalLM.from_config(config).float(), 0, 2)
    _load_weights(fresh, tmp_path / "stage-0", None)
    with torch.no_grad():
        torch.testing.assert_close(fresh.eval()(ids), bundle.stage(ids))
