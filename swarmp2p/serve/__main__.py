"""``python -m swarmp2p.serve MODEL [--stages N] [--port P]``: serve on this machine alone."""

from __future__ import annotations

import argparse
import os

from swarmp2p.net.security import read_secret
from swarmp2p.serve.api import API_KEY_ENV
from swarmp2p.serve.local import serve_local


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m swarmp2p.serve", description=__doc__)
    parser.add_argument("model", help='"embedded", a checkpoint folder, or a cached Hub id')
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument(
        "--api-key",
        default=None,
        metavar="-",
        help=f"require an API key, read from stdin ('-'); also from ${API_KEY_ENV} or "
        "--api-key-file, never in the command line, where `ps` shows it",
    )
    parser.add_argument("--api-key-file", default=None, help="the API key's file (mode 0600)")
    parser.add_argument("--max-context", type=int, default=None)
    parser.add_argument("--max-sessions", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per stage")
    options = vars(parser.parse_args())  # each option's dest is serve_local's keyword
    try:
        options["api_key"] = read_secret(
            "the API key",
            option=options["api_key"],
            file=options.pop("api_key_file"),
            env=os.environ,
            flag="--api-key",
            file_flag="--api-key-file",
            env_name=API_KEY_ENV,
        )
        serve_local(options.pop("model"), **options)
    except (ValueError, PermissionError) as e:
        parser.exit(2, f"error: {e}\n")


if __name__ == "__main__":
    main()
