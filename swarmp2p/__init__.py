"""swarmp2p: pipeline-parallel training and serving of causal LMs across the machines of a LAN."""

try:  # written by setuptools-scm when the package is built (pip, pipx, editable installs)
    from swarmp2p import _version
except ImportError:  # a source tree that was never installed (run through PYTHONPATH)
    _version = None

__version__: str = getattr(_version, "__version__", "0.1.0.dev0")
"""This copy's release version, from git: a tag's ``0.2.0``, or ``0.1.0.dev238+g16cd8d839``
between tags (238 commits, commit 16cd8d839), with ``.dYYYYMMDD`` when built from a checkout
with uncommitted changes; ``0.1.0.dev0`` with no commit when built without git metadata."""
_commit_id = getattr(_version, "commit_id", None)

__commit__: str = (_commit_id or "").removeprefix("g")
"""The git commit this copy was built from (short hash); empty when it is not known."""

PROTOCOL_VERSION = 1
"""Version of the wire protocol and of the plan format; peers refuse a mismatch. It changes only
when the messages or the plan change, never with a release (``__version__``)."""

__all__ = ["PROTOCOL_VERSION", "__commit__", "__version__"]
