"""A stage worker process's edges (``runtime/_process.py``): an unquantized stage's LoRA runs
without bitsandbytes (in a fresh interpreter), a quantized one may import it, and the exit
keeps the code and every byte written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120
    )


LORA = """
import json, sys
from swarmp2p.runtime._process import keep_bitsandbytes_out
keep_bitsandbytes_out(json.loads(sys.argv[1]))
import torch
from peft import LoraConfig, inject_adapter_in_model
from transformers.utils import is_bitsandbytes_available
model = inject_adapter_in_model(LoraConfig(r=2, target_modules=["0"]), torch.nn.Sequential(torch.nn.Linear(4, 4)))
y = model(torch.ones(1, 4))
print(json.dumps({"bnb": sys.modules.get("bitsandbytes") is not None,
                  "available": is_bitsandbytes_available(), "lora": type(model[0]).__module__}))
"""


@pytest.mark.torch
@pytest.mark.slow  # a fresh interpreter imports torch, transformers and peft: 4-9 s
def test_an_unquantized_stage_leaves_bitsandbytes_out_and_its_lora_still_works():
    pytest.importorskip("peft")
    out = _python(LORA, "null")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["lora"].startswith("peft.tuners.lora")  # peft's LoRA layer, without bnb
    assert result == {**result, "bnb": False, "available": False}


def test_a_quantized_stage_keeps_bitsandbytes(monkeypatch):
    from swarmp2p.runtime._process import keep_bitsandbytes_out

    monkeypatch.delitem(sys.modules, "bitsandbytes", raising=False)
    keep_bitsandbytes_out({"bits": 4})
    assert "bitsandbytes" not in sys.modules  # importable as installed


def test_exit_now_keeps_the_code_and_what_was_written_unflushed():
    code = (
        "import sys; from swarmp2p.runtime._process import exit_now\n"
        "sys.stdout.write('no newline, still buffered'); sys.stderr.write('err')\n"
        "exit_now(3)\n"
        "print('never')"
    )
    out = _python(code)
    assert (out.returncode, out.stdout, out.stderr) == (3, "no newline, still buffered", "err")
