"""The `swarm` command line: parse, call one library function, print."""

from __future__ import annotations

import click

from swarmp2p import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="swarm")
def main() -> None:
    """swarmp2p: train and serve causal LMs across the machines of a LAN."""


if __name__ == "__main__":
    main()
