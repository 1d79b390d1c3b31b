"""``python -m swarmp2p.serve MODEL [--stages N] [--port P]``: serve on this machine alone."""

from __future__ import annotations

import argparse
import os

from swarmp2p.serve.api import API_KEY_ENV
from swarmp2p.serve.local import serve_local


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m swarmp2p.serve", description=__doc__)
    parser.add_argument("model", help='"embedded", a checkpoint folder, or a cached Hub id')
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV))
    parser.add_argument("--max-context", type=int, default=None)
    parser.add_argument("--max-sessions", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per stage")
    options = vars(parser.parse_args())  # each option's dest is serve_local's keyword
    try:
        serve_local(options.pop("model"), **options)
    except ValueError as e:
        parser.exit(2, f"error: {e}\n")


if __name__ == "__main__":
    main()
