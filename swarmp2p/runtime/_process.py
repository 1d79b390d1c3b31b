"""The edges of a stage worker process (training or serving), light: what it leaves out of its
imports and how it ends. Measured on the 2-core CPU box: both are CPU that every job start and
end paid at every stage, beside the stages still working."""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def keep_bitsandbytes_out(quantization: object) -> None:
    """For a process whose stage is not quantized: ``import bitsandbytes`` fails as if it were
    not installed, so peft (a LoRA stage, an export) does not import it. Its import compiles
    kernels with torch.compile (torch's inductor stack: 1.4 s of CPU) and loads its native
    library; peft and transformers check it with ``importlib.util.find_spec``, which answers
    None for it here. Call it before transformers or peft is imported (in a worker's main)."""
    if quantization is None:
        sys.modules.setdefault("bitsandbytes", None)  # type: ignore[arg-type]


def exit_now(code: int) -> NoReturn:
    """End the process with ``code`` once its output is flushed, without the interpreter's
    teardown: with torch and transformers loaded that teardown is 0.5-1.7 s of CPU and frees
    nothing the process's exit does not. Everything a worker writes is closed and atomic
    (renamed into place) before it returns its code."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            pass
    os._exit(code)


__all__ = ["exit_now", "keep_bitsandbytes_out"]
