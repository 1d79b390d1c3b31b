"""Run every benchmark in bench/ and write docs/benchmarks.md (machine, versions, date, tables).

    python bench/run_all.py                   # full sizes; writes docs/benchmarks.md
    python bench/run_all.py --quick           # tiny sizes (CI: the benchmarks cannot rot);
                                              # writes only with --output
    python bench/run_all.py --quick --jobs 2  # two at a time (quick mode only)
    python bench/run_all.py --only wire --only plan_scale --output /tmp/b.md

Each benchmark prints markdown and, as its last line, one JSON object; a benchmark that exits
non-zero, times out, or whose last line is not a JSON object counts as failed (exit code 1).
In quick mode a benchmark runs with ``--quick``; one without that flag must be listed in
``QUICK_ARGS``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from swarmp2p._atomic import write_atomic

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUTPUT = ROOT / "docs" / "benchmarks.md"
QUICK_ARGS = {"fuzz_wire.py": ["--inputs", "2000"]}
"""Quick-mode arguments of benchmarks that have no ``--quick`` flag."""
START_FIRST = ("train_pipeline.py", "serve.py")
"""The longest quick runs (about 115 s and 55 s here): with ``--jobs``, they start first, so
the short ones fill the other slot instead of one long run starting last."""
GPU_ONLY = ("gpu.py",)
"""Benchmarks of the GPU machine: ``bench/gpu_check.sh`` runs them there (CI its dry run); they
are left out here unless ``--only`` names them, and the section they write into
``docs/benchmarks.md`` (between GPU_MARKERS) is kept when this script rewrites it."""
GPU_MARKERS = ("<!-- gpu:begin -->", "<!-- gpu:end -->")
VERSIONS = ("torch", "transformers", "pyzmq", "numpy", "msgpack", "bitsandbytes", "peft")
TIMEOUT_S = 1800.0


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchResult:
    """One benchmark's run: its markdown (stdout without the JSON line) and JSON result."""

    name: str
    args: tuple[str, ...]
    seconds: float
    returncode: int
    markdown: str
    result: dict | None
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


def discover(bench_dir: Path, only: list[str] | None = None) -> list[Path]:
    """The benchmark scripts in ``bench_dir`` (not this one, not ``_``-prefixed), by name;
    ValueError for an ``only`` name that matches none."""
    scripts = sorted(
        p
        for p in bench_dir.glob("*.py")
        if p.name != Path(__file__).name and not p.name.startswith("_")
    )
    if not only:
        return [p for p in scripts if p.name not in GPU_ONLY]
    names = {p.stem: p for p in scripts}
    missing = [n for n in only if n.removesuffix(".py") not in names]
    if missing:
        raise ValueError(
            f"--only {missing}: no such benchmark in {bench_dir}; known: {sorted(names)}"
        )
    return [names[n.removesuffix(".py")] for n in only]


def quick_args(script: Path) -> list[str]:
    """``--quick`` when the script's source declares it, else its ``QUICK_ARGS`` entry."""
    if script.name in QUICK_ARGS:
        return list(QUICK_ARGS[script.name])
    if '"--quick"' in script.read_text(encoding="utf-8"):
        return ["--quick"]
    raise ValueError(
        f"{script.name} has no --quick flag and no QUICK_ARGS entry in bench/run_all.py; give it "
        "a --quick mode (tiny sizes) or add its quick arguments there"
    )


def parse_output(stdout: str) -> tuple[str, dict | None, str]:
    """(markdown, the last line's JSON object, error): the last non-empty line must be an object."""
    lines = stdout.rstrip().splitlines()
    if not lines:
        return "", None, "printed nothing"
    try:
        result = json.loads(lines[-1])
    except ValueError:
        return stdout.rstrip(), None, f"last line is not JSON: {lines[-1][:120]!r}"
    if not isinstance(result, dict):
        return stdout.rstrip(), None, f"last line is JSON but not an object: {lines[-1][:120]!r}"
    return "\n".join(lines[:-1]).strip(), result, ""


def run_one(script: Path, args: list[str], timeout: float) -> BenchResult:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    start = time.perf_counter()
    try:
        out = subprocess.run(
            [sys.executable, str(script), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return BenchResult(
            name=script.name,
            args=tuple(args),
            seconds=timeout,
            returncode=-1,
            markdown="",
            result=None,
            error=f"timed out after {timeout:g} s",
        )
    seconds = time.perf_counter() - start
    markdown, result, error = parse_output(out.stdout)
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()[-3:]
        error = f"exit code {out.returncode}: " + " / ".join(tail)
    return BenchResult(
        name=script.name,
        args=tuple(args),
        seconds=seconds,
        returncode=out.returncode,
        markdown=markdown,
        result=result,
        error=error,
    )


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, str]:
    """What the numbers were measured on (no torch import: versions from package metadata)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    except (ValueError, OSError):
        ram = 0.0
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 0
    from swarmp2p import __version__

    info = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{_cpu_model()}, {cores} cores, {ram:.0f} GiB RAM",
        "os": f"{platform.system()} {platform.release()} ({platform.machine()})",
        "python": platform.python_version(),
        "swarmp2p": __version__,
    }
    info.update({name: _version(name) for name in VERSIONS})
    return info


def render(results: list[BenchResult], info: dict[str, str], *, quick: bool) -> str:
    """docs/benchmarks.md."""
    lines = ["# Benchmarks", ""]
    lines.append(
        "Written by `python bench/run_all.py"
        + (" --quick" if quick else "")
        + "`. "
        + (
            "QUICK MODE: tiny sizes that check the benchmarks run; the numbers mean nothing. "
            if quick
            else ""
        )
        + "These machines are noisy: compare ratios, not absolute times."
    )
    lines += ["", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in info.items()]
    lines += ["", "| benchmark | arguments | seconds | status |", "|---|---|---|---|"]
    for r in results:
        status = "ok" if r.ok else f"FAILED: {r.error}"
        lines.append(
            f"| `bench/{r.name}` | `{' '.join(r.args) or '-'}` | {r.seconds:.1f} | {status} |"
        )
    for r in results:
        lines += ["", f"## bench/{r.name}", ""]
        if r.error:
            lines += [f"**Failed**: {r.error}", ""]
        if r.markdown:  # its headings go one level below ours
            lines += [_demote(r.markdown), ""]
        if r.result is not None:
            lines += ["```json", json.dumps(r.result, sort_keys=True), "```"]
    return "\n".join(lines).rstrip() + "\n"


def gpu_section(old: str) -> str:
    """The GPU section of an earlier docs/benchmarks.md (markers included), or ''."""
    begin, end = GPU_MARKERS
    if begin not in old or end not in old.split(begin, 1)[1]:
        return ""
    return begin + old.split(begin, 1)[1].split(end, 1)[0] + end


def _demote(markdown: str) -> str:
    return "\n".join("#" + line if line.startswith("#") else line for line in markdown.splitlines())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: check that each runs")
    parser.add_argument(
        "--only", action="append", metavar="NAME", help="run only this one (repeatable)"
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help=f"where to write the markdown (default {DEFAULT_OUTPUT.relative_to(ROOT)};"
        " none in --quick mode)",
    )
    parser.add_argument("--bench-dir", type=Path, default=BENCH_DIR, help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per benchmark")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="with --quick: run N benchmarks at once (their numbers mean nothing "
        "in quick mode; full runs go one at a time)",
    )
    args = parser.parse_args(argv)
    if args.jobs < 1 or (args.jobs > 1 and not args.quick):
        parser.error(
            f"--jobs {args.jobs}: must be 1, or more only with --quick (benchmarks "
            "side by side would skew each other's numbers)"
        )
    try:
        scripts = discover(args.bench_dir, args.only)
        plan = [(s, quick_args(s) if args.quick else []) for s in scripts]
    except ValueError as exc:
        parser.error(str(exc))

    def one(item: tuple[Path, list[str]]) -> BenchResult:
        script, script_args = item
        # one write per line: two benchmarks start at once with --jobs
        sys.stderr.write(f"running bench/{script.name} {' '.join(script_args)}\n")
        sys.stderr.flush()
        return run_one(script, script_args, args.timeout)

    def first(item: tuple[Path, list[str]]) -> int:
        name = item[0].name
        return START_FIRST.index(name) if name in START_FIRST else len(START_FIRST)

    started = sorted(plan, key=first) if args.jobs > 1 else plan
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        done = dict(zip((s for s, _ in started), pool.map(one, started)))
    results = [done[s] for s, _ in plan]  # reported in the plan's order
    output = args.output if args.output is not None else (None if args.quick else DEFAULT_OUTPUT)
    if output is not None:
        text = render(results, machine(), quick=args.quick)
        kept = gpu_section(output.read_text(encoding="utf-8")) if output.is_file() else ""
        write_atomic(output, text + (f"\n{kept}\n" if kept else ""), mode=0o644)
    print("| benchmark | seconds | status |\n|---|---|---|")
    for r in results:
        print(f"| {r.name} | {r.seconds:.1f} | {'ok' if r.ok else 'FAILED: ' + r.error} |")
    failed = [r.name for r in results if not r.ok]
    print()
    print(
        json.dumps(
            {
                "benchmarks": len(results),
                "failed": failed,
                "quick": args.quick,
                "output": str(output) if output else None,
                "seconds": round(sum(r.seconds for r in results), 1),
            }
        )
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
