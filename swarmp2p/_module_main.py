"""The child side of ``node.corpus.run_module``: a module the daemon runs as ``python -m``.

``run_main`` runs the module's ``main(argv)`` and exits with its code; an expected error exits 1
with one line naming it on stderr, the line ``run_module`` reports to the daemon.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn


def run_main(
    main: Callable[[list[str]], int], *, errors: tuple[type[BaseException], ...]
) -> NoReturn:
    """``sys.exit(main(sys.argv[1:]))``; one of ``errors`` exits 1 with ``Type: message``."""
    try:
        sys.exit(main(sys.argv[1:]))
    except errors as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
