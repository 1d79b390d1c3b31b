"""Serving a trained model in place, from the shards its training exported: greedy output of
stage servers (threads, and real worker processes) equals one process running the same weights
with the same boundaries; bad shards and mismatched specs are refused by name."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))  # train_models

from ring_helpers import reference_generate, served_ring  # noqa: E402
from tiny_models import build_model as build_wide_model  # noqa: E402
from train_models import build_model, run_threads, token_batches  # noqa: E402

from swarmp2p.net import InProcLink  # noqa: E402
from swarmp2p.plan import stage_schedule  # noqa: E402
from swarmp2p.plan.job import LoraConfig  # noqa: E402
from swarmp2p.plan.worker_spec import StageTraining  # noqa: E402
from swarmp2p.runtime.torch import decoder_config, load_stage_shard  # noqa: E402
from swarmp2p.runtime.torch.model.introspect import introspect  # noqa: E402
from swarmp2p.runtime.torch.model.lora import apply_lora, resolve_targets  # noqa: E402
from swarmp2p.runtime.torch.serve.trained import load_trained_stage  # noqa: E402
from swarmp2p.runtime.torch.train.boundary import (  # noqa: E402
    Channel,
    apply_boundary,
)
from swarmp2p.runtime.torch.train.bundle import build_bundle  # noqa: E402
from swarmp2p.runtime.torch.train.compression import compressor_from_spec  # noqa: E402
from swarmp2p.runtime.torch.train.export import (  # noqa: E402
    export_stage,
    read_manifest,
    reconstruct_from_shards,
)
from swarmp2p.runtime.torch.train.steps import train_stage  # noqa: E402
from swarmp2p.serve import GREEDY  # noqa: E402

pytestmark = pytest.mark.torch

try:  # tqdm's monitor thread (from_pretrained's progress bar) would trip the leak check
    import tqdm

    tqdm.tqdm.monitor_interval = 0
except ImportError:
    pass

PROMPT = [5, 17, 99, 3, 64, 21, 8]
NEW = 10
LEARNED = {"method": "learned_bottleneck", "learned_dim": 16, "code_bits": 8}
LR = 2e-3
"""Enough to move every trained tensor, not enough to collapse the tiny model's greedy text."""
EOS = 2
"""The tiny llamas' end-of-sequence id, at which ``generate`` stops too."""
NF4 = {"method": "nf4", "compute_dtype": "float32"}


# -- building trained shards -------------------------------------------------------------------


def _save_base(folder: Path, *, tied: bool = False, wide: bool = False) -> Path:
    """A tiny llama base (``wide``: hidden 64, for bitsandbytes' CPU 4-bit kernels)."""
    model = build_wide_model("llama", wide=True) if wide else build_model("llama")
    if tied:
        from transformers import AutoModelForCausalLM

        model.config.tie_word_embeddings = True
        model.config.initializer_range = 0.2  # blocks that move the token: not argmax = input
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(model.config, attn_implementation="sdpa")
    model.save_pretrained(folder)
    return folder


def _projections(base, bounds, compression):
    """Boundary index -> the PCA projection of the base's hidden states at that cut (what
    calibration starts a learned bottleneck from), for each learned boundary."""
    from transformers import AutoModelForCausalLM

    from swarmp2p.runtime.torch.train.calibration import CovarianceAccumulator, principal_projection

    model = AutoModelForCausalLM.from_pretrained(base).eval()
    with torch.no_grad():
        states = model(token_batches(1, 8, 31, seed=5)[0], output_hidden_states=True)
    found = {}
    for j, spec in enumerate(compression):
        if isinstance(spec, dict):
            acc = CovarianceAccumulator(decoder_config(model.config).hidden_size)
            acc.update(states.hidden_states[bounds[j][1]])
            found[j] = principal_projection(acc, spec["learned_dim"])
    return found


def _train_and_export(
    base, root, bounds, compression, *, lora=None, quantization=None, dtype="float32"
):
    """Build each stage as ``swarm train`` does (base slice, LoRA, calibrated compressors),
    train 2 steps as threads over in-process links, export each stage's shard; return the
    shard folders and the trained bundles."""
    n = len(bounds)
    projections = _projections(base, bounds, compression)
    links = [InProcLink.pair() for _ in range(n - 1)]
    bundles, fingerprint, targets = [], None, ()
    for i, (a, b) in enumerate(bounds):
        torch.manual_seed(0)  # every stage draws the same LoRA A matrices
        stage = load_stage_shard(
            base, a, b, i == 0, i == n - 1, dtype=dtype, quantization=quantization
        )
        if lora is not None:
            fingerprint = apply_lora(stage, lora)
            targets = resolve_targets(stage, lora)
        hidden = decoder_config(stage.config).hidden_size
        recv = compressor_from_spec(compression[i - 1], hidden, i - 1) if i > 0 else None
        send = compressor_from_spec(compression[i], hidden, i) if i < n - 1 else None
        for comp, j in ((recv, i - 1), (send, i)):
            if comp is not None:
                comp.to(getattr(torch, dtype))  # as stage_runner builds them
            if j in projections and comp is not None:
                comp.set_projection(projections[j].mean, projections[j].basis)
        bundles.append(
            build_bundle(
                stage,
                index=i,
                n_stages=n,
                recv_compressor=recv,
                send_compressor=send,
                finetune_mode="full" if lora is None else "lora",
            )
        )
    settings = StageTraining.of(steps=2, micro_batches=2, lr=LR)
    batches = token_batches(2, 4, 9)

    def run(i):
        return train_stage(
            bundles[i],
            settings,
            stage_schedule("1f1b", i, n, settings.micro_batches),
            prev=Channel(links[i - 1][1], timeout=30) if i > 0 else None,
            next=Channel(links[i][0], timeout=30) if i < n - 1 else None,
            batches=iter(batches) if i == 0 else None,
        )

    run_threads([lambda i=i: run(i) for i in range(n)])
    dirs = []
    for bundle, layers in zip(bundles, bounds):
        folder = root / f"stage-{bundle.index}"
        export_stage(
            bundle,
            folder,
            layers=layers,
            n_layers=bounds[-1][1],
            compression=compression,
            lora=lora,
            lora_targets=targets,
            lora_fingerprint=fingerprint,
            base_is_quantized=quantization is not None,
        )
        dirs.append(folder)
    return dirs, bundles


def _tied_head_file(stage0: Path, out: Path) -> Path:
    """What the node hands a tied model's last stage: the first stage's trained embedding."""
    from safetensors.torch import load_file, save_file

    name = "model.embed_tokens.weight"
    save_file({name: load_file(stage0 / "weights.safetensors")[name]}, out)
    return out


# -- serving them --------------------------------------------------------------------------------


def _load(base, dirs, bounds, **kw):
    tied_head = kw.pop("tied_head", None)
    return [
        load_trained_stage(
            base,
            d,
            layer_start=a,
            layer_end=b,
            is_first=i == 0,
            is_last=i == len(dirs) - 1,
            tied_head=tied_head if i == len(dirs) - 1 else None,
            **kw,
        )
        for i, (d, (a, b)) in enumerate(zip(dirs, bounds))
    ]


def _serve(trained, codes=False):
    """Greedy tokens of the ring of trained stages, and the bytes sent on each boundary."""
    servers = [
        dict(
            stage=t.stage,
            receiver=t.receiver,
            sender=t.sender,
            send_codec=t.send_codec,
            send_compression="none" if t.sender is not None else t.send_compression,
            send_codes=codes,
        )
        for t in trained
    ]
    with served_ring(servers) as ring:
        tokens = ring.generate(PROMPT, max_tokens=NEW, sampling=GREEDY, stop_ids=[EOS], timeout=60)
        return tokens, ring.boundary_bytes()


def _reference_with_boundaries(model, dirs, bounds, compression):
    """``model.generate`` greedy with each boundary applied at its cut in one process: a fixed
    one per token (the serving rule), a learned one as ``up(round(down(x)))`` with ``down`` from
    the sending shard's compressor file and ``up`` from the receiving shard's."""
    n = len(dirs)

    def state(i, side):
        name = "compressor.pt" if i in (0, n - 1) else f"compressor-{side}.pt"
        return torch.load(dirs[i] / name, weights_only=True)

    hidden = decoder_config(model.config).hidden_size
    dtype = next(model.parameters()).dtype
    blocks = introspect(model).blocks
    handles = []
    for j, spec in enumerate(compression):
        if isinstance(spec, dict):
            send = compressor_from_spec(spec, hidden, j).to(dtype)
            send.load_state_dict(state(j, "send"))
            recv = compressor_from_spec(spec, hidden, j).to(dtype)
            recv.load_state_dict(state(j + 1, "recv"))

            def boundary(x, send=send, recv=recv):
                return recv.up(send.sender()(x))
        else:

            def boundary(x, spec=spec):
                return apply_boundary(x, spec)

        def hook(module, args, output, boundary=boundary):
            return boundary(output[0] if isinstance(output, tuple) else output)

        handles.append(blocks[bounds[j][1] - 1].register_forward_hook(hook))
    try:
        return reference_generate(model, PROMPT, NEW)
    finally:
        for handle in handles:
            handle.remove()


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return _save_base(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A tied-embedding llama fully fine-tuned over 2 stages with a learned bottleneck."""
    root = tmp_path_factory.mktemp("tied")
    folder = _save_base(root / "base", tied=True)
    bounds = [(0, 2), (2, 4)]
    dirs, bundles = _train_and_export(folder, root, bounds, [LEARNED])
    head = _tied_head_file(dirs[0], root / "tied-head.safetensors")
    return folder, dirs, bounds, bundles, head


# -- tests ---------------------------------------------------------------------------------------


def test_full_finetune_of_a_tied_model_serves_as_reconstructed_with_codes_or_floats(tied):
    folder, dirs, bounds, bundles, head = tied
    reference = reconstruct_from_shards(folder, dirs).eval()
    want = _reference_with_boundaries(reference, dirs, bounds, [LEARNED])
    assert want != reference_generate(reference, PROMPT, NEW), "the bottleneck changes the text"
    trained = _load(folder, dirs, bounds, tied_head=head)
    assert trained[0].send_compression == "learned" and trained[0].send_codec == "tokint8"
    assert trained[1].receiver is not None and trained[1].sender is None
    served_head = trained[1].stage.head.weight
    # the tied head is stage 0's trained embedding, not the last stage's own copy of it
    assert torch.equal(served_head, bundles[0].stage.embed.weight.detach())
    assert not torch.equal(served_head, bundles[1].stage.head.weight.detach())
    floats, float_bytes = _serve(trained, codes=False)
    codes, code_bytes = _serve(trained, codes=True)
    assert floats == codes == want
    # 16 int8 codes + a float32 scale per token (20 B) against 16 float32s (64 B); each message's
    # headers (about 60% of the float bytes here, a few bytes more or less with the numbers in
    # them) come on top of both
    assert code_bytes[0] < 0.75 * float_bytes[0]


def test_a_tied_last_stage_needs_its_tied_head(tied, tmp_path):
    from safetensors.torch import save_file

    folder, dirs, _, bundles, head = tied
    last = dict(layer_start=2, layer_end=4, is_first=False, is_last=True)
    with pytest.raises(ValueError, match=r"tied-embedding model and holds no output head.*pass "):
        load_trained_stage(folder, dirs[1], **last)
    # a copy of the first stage's whole weights file serves too: the embedding is picked by name
    whole = load_trained_stage(folder, dirs[1], tied_head=dirs[0] / "weights.safetensors", **last)
    assert torch.equal(whole.stage.head.weight, bundles[0].stage.embed.weight.detach())
    two = tmp_path / "two.safetensors"
    save_file({"a": torch.zeros(128, 32), "b": torch.zeros(128, 32)}, two)
    with pytest.raises(ValueError, match=r"must hold one tensor, or .* model.embed_tokens.weight"):
        load_trained_stage(folder, dirs[1], tied_head=two, **last)
    with pytest.raises(ValueError, match=r"tied_head .* only for the last stage"):
        load_trained_stage(
            folder,
            dirs[0],
            layer_start=0,
            layer_end=2,
            is_first=True,
            is_last=False,
            tied_head=head,
        )


def test_lora_merged_with_a_fixed_int8_boundary(base, tmp_path):
    bounds, compression = [(0, 2), (2, 4)], ["fixed_int8"]
    lora = LoraConfig(r=4, alpha=8, dropout=0.0, export="merged")
    dirs, _ = _train_and_export(base, tmp_path, bounds, compression, lora=lora)
    want = _reference_with_boundaries(
        reconstruct_from_shards(base, dirs).eval(), dirs, bounds, compression
    )
    trained = _load(base, dirs, bounds)
    assert trained[0].send_compression == "fixed_int8" and trained[0].sender is None
    assert not any("lora_" in n for t in trained for n, _ in t.stage.named_parameters())
    untrained = load_stage_shard(base, 0, 2, True, False)
    assert not torch.equal(
        trained[0].stage.blocks[0].self_attn.q_proj.weight,
        untrained.blocks[0].self_attn.q_proj.weight,
    ), "merged weights loaded"
    for codes in (False, True):  # per token in the graph, or as tokint8 codes
        assert _serve(trained, codes)[0] == want


def test_lora_adapters_serve_unmerged(base, tmp_path):
    bounds = [(0, 2), (2, 4)]
    lora = LoraConfig(r=4, alpha=8, dropout=0.0, export="adapters")
    dirs, bundles = _train_and_export(base, tmp_path, bounds, ["none"], lora=lora)
    reference = reconstruct_from_shards(base, dirs, merge_adapters=False).eval()
    want = reference_generate(reference.get_base_model(), PROMPT, NEW)  # LoRA layers inside
    trained = _load(base, dirs, bounds)
    for t, bundle in zip(trained, bundles):
        ours = {n: p for n, p in t.stage.named_parameters() if "lora_B" in n}
        assert ours, "the adapters stay unmerged"
        theirs = dict(bundle.stage.named_parameters())
        assert all(torch.equal(p, theirs[n].detach()) for n, p in ours.items())
        assert any(p.abs().sum() > 0 for p in ours.values()), "lora_B trained away from zero"
    assert _serve(trained)[0] == want


@pytest.mark.slow
def test_qlora_nf4_adapters_equal_the_same_nf4_base_with_adapters_in_one_process(tmp_path):
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig as PeftConfig
    from peft import get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from swarmp2p.runtime.torch import normalize_spec
    from swarmp2p.runtime.torch.model.quantization import bnb_config

    base = _save_base(tmp_path / "base", wide=True)
    bounds = [(0, 2), (2, 4)]
    lora = LoraConfig(r=4, alpha=8, dropout=0.0, export="merged")  # exported as adapters
    dirs, _ = _train_and_export(base, tmp_path, bounds, ["none"], lora=lora, quantization=NF4)
    assert not any(read_manifest(d)["weights_included"] for d in dirs)
    reference = AutoModelForCausalLM.from_pretrained(
        base,
        dtype=torch.float32,
        quantization_config=bnb_config(normalize_spec(NF4), ["lm_head"]),
        device_map="cpu",
    )
    config = json.loads((dirs[0] / "adapter" / "adapter_config.json").read_text())
    config.pop("peft_type")
    reference = get_peft_model(reference, PeftConfig(**config))
    union = {}
    for d in dirs:
        union.update(load_file(d / "adapter" / "adapter_model.safetensors"))
    set_peft_model_state_dict(reference, union)
    want = reference_generate(reference.eval().get_base_model(), PROMPT, NEW)
    trained = _load(base, dirs, bounds, quantization=NF4)
    kinds = {type(m).__name__ for t in trained for m in t.stage.modules()}
    assert "Linear4bit" in kinds
    lora_b = [p for t in trained for n, p in t.stage.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b), "unmerged, trained adapters"
    assert _serve(trained)[0] == want


@pytest.mark.parametrize(
    "compression", [[LEARNED, LEARNED], ["fixed_int4", LEARNED]], ids=["learned", "int4-learned"]
)
def test_three_stages_with_the_compressor_halves_on_the_middle_stage(base, tmp_path, compression):
    bounds = [(0, 1), (1, 3), (3, 4)]
    dirs, _ = _train_and_export(base, tmp_path, bounds, compression)
    assert {"compressor-recv.pt", "compressor-send.pt"} <= {p.name for p in dirs[1].iterdir()}
    want = _reference_with_boundaries(
        reconstruct_from_shards(base, dirs).eval(), dirs, bounds, compression
    )
    trained = _load(base, dirs, bounds)
    middle = trained[1]
    assert (middle.receiver is not None) is (compression[0] == LEARNED)
    assert middle.sender is not None and middle.send_compression == "learned"
    assert trained[0].send_compression == ("learned" if compression[0] == LEARNED else "fixed_int4")
    for codes in (False, True):
        assert _serve(trained, codes)[0] == want


def test_a_hybrid_qwen3_5_with_lora_adapters_and_a_learned_bottleneck(tmp_path):
    """Gated DeltaNet and attention blocks, LoRA over both kinds of projection, unmerged."""
    base = tmp_path / "base"
    build_wide_model("qwen3_5").save_pretrained(base)
    bounds, compression = [(0, 2), (2, 4)], [LEARNED]
    lora = LoraConfig(r=4, alpha=8, dropout=0.0, export="adapters")
    dirs, _ = _train_and_export(base, tmp_path, bounds, compression, lora=lora)
    assert "in_proj_qkv" in read_manifest(dirs[0])["lora"]["target_modules"]
    reference = reconstruct_from_shards(base, dirs, merge_adapters=False).eval()
    want = _reference_with_boundaries(reference.get_base_model(), dirs, bounds, compression)
    trained = _load(base, dirs, bounds)
    assert _serve(trained, codes=True)[0] == want


def test_a_bfloat16_shard_serves_in_bfloat16(base, tmp_path):
    """A bfloat16 code is not exactly a tokint8 code (the rounded value is cast to bfloat16),
    so it crosses as its bfloat16 bits either way; both paths give the reference's tokens."""
    bounds = [(0, 2), (2, 4)]
    dirs, _ = _train_and_export(base, tmp_path, bounds, [LEARNED], dtype="bfloat16")
    assert read_manifest(dirs[0])["dtype"] == "bfloat16"
    reference = reconstruct_from_shards(base, dirs).eval().to(torch.bfloat16)
    want = _reference_with_boundaries(reference, dirs, bounds, [LEARNED])
    trained = _load(base, dirs, bounds, dtype="bfloat16")
    assert trained[0].sender[0].weight.dtype == trained[1].receiver.weight.dtype == torch.bfloat16
    floats, float_bytes = _serve(trained, codes=False)
    codes, code_bytes = _serve(trained, codes=True)
    assert floats == codes == want
    # the same bfloat16 payload both ways (message headers aside: session ids grow)
    assert abs(code_bytes[0] - float_bytes[0]) < 0.1 * float_bytes[0]


def test_a_corrupted_shard_file_is_refused(base, tmp_path):
    bounds = [(0, 2), (2, 4)]
    dirs, _ = _train_and_export(base, tmp_path, bounds, [LEARNED])
    path = dirs[1] / "compressor.pt"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"compressor.pt is missing or does not match its sha256"):
        _load(base, dirs, bounds)


def test_a_shard_served_at_another_position_or_on_a_quantized_base_is_refused(base, tmp_path):
    bounds = [(0, 2), (2, 4)]
    dirs, _ = _train_and_export(base, tmp_path, bounds, ["none"])
    kw = dict(is_first=False, is_last=True)
    with pytest.raises(ValueError, match=r"layers \[2, 4\) of 4, but the stage spec asks for "):
        load_trained_stage(base, dirs[1], layer_start=1, layer_end=4, **kw)
    with pytest.raises(ValueError, match=r"stage 0 of 2 .*is_first_stage=False"):
        load_trained_stage(base, dirs[0], layer_start=2, layer_end=4, **kw)
    with pytest.raises(ValueError, match=r"weights_included: true.*cannot be loaded"):
        load_trained_stage(base, dirs[1], layer_start=2, layer_end=4, quantization=NF4, **kw)
    with pytest.raises(ValueError, match=r"trained in float32, the stage spec asks for"):
        load_trained_stage(base, dirs[1], layer_start=2, layer_end=4, dtype="bfloat16", **kw)


def _first_spec(folder, dirs, compression="none"):
    """The spec of the first of two stages (blocks 0-1) serving ``dirs[0]``."""
    from swarmp2p.serve import local_serve_plan, serve_spec

    plan = local_serve_plan(str(folder), bounds=[(0, 2), (2, 4)], compression=[compression])
    return serve_spec(plan, 0, model=str(folder), token="t", shard=str(dirs[0]))


@pytest.mark.slow
def test_serve_worker_processes_serve_trained_shards(tied):
    """Two real ``python -m swarmp2p.runtime.serve_worker`` processes over CURVE links (the
    one ring builder, the one worker wrapper): the tied last stage gets its head file, the
    learned boundary crosses as codes."""
    from swarmp2p.serve import LocalRing

    folder, dirs, bounds, _, head = tied
    reference = reconstruct_from_shards(folder, dirs).eval()
    want = _reference_with_boundaries(reference, dirs, bounds, [LEARNED])
    with LocalRing(
        str(folder),
        bounds=bounds,
        codes=[True],
        threads=1,
        max_context=64,
        shards=[str(d) for d in dirs],
        tied_head=str(head),
    ) as ring:
        got = ring.client.generate(
            PROMPT, max_tokens=NEW, sampling=GREEDY, stop_ids=[EOS], timeout=60
        )
    assert got == want


def test_the_learned_halves_replace_the_named_boundary_and_a_spec_naming_another_is_refused(tied):
    from swarmp2p.net import InProcLink
    from swarmp2p.runtime.serve_worker import _load_trained
    from swarmp2p.runtime.torch.serve.server import StageServer

    folder, dirs, _, _, _ = tied
    spec = _first_spec(folder, dirs, compression="fixed_int8")
    with pytest.raises(ValueError, match=r"asks for 'fixed_int8', but shard .* 'learned'"):
        _load_trained(spec)
    first = _load_trained(_first_spec(folder, dirs))
    a, b = InProcLink.pair()
    kw = dict(stage=first.stage, inbound=b, outbound=a)
    with pytest.raises(ValueError, match="sender: a learned boundary's send half replaces"):
        StageServer(**kw, sender=first.sender, send_compression="fixed_int8")
    with pytest.raises(ValueError, match="receiver: the first stage reads token ids"):
        StageServer(**kw, receiver=first.sender)
    with pytest.raises(ValueError, match="send_codec: 'int9' goes with a sender"):
        StageServer(**kw, sender=first.sender, send_codec="int9")
    server = StageServer(**kw, sender=first.sender, send_codec="tokint8", send_codes=True)
    assert server.codec == "tokint8"
