"""`swarm generate` and `swarm chat`: thin clients of the API."""

from __future__ import annotations

import sys

import click

from swarmp2p.cli import (
    _STATE_DIR_OPTION,
    _api_key_options,
    _echo_json,
    _read_api_key,
    _state_dir,
    main,
)

DEFAULT_URL = "http://127.0.0.1:8080"

# --- swarm generate / swarm chat: thin clients of the OpenAI-compatible API (serve) ----------


def _api_options(fn):
    fn = _api_key_options("The API key the server was started with")(fn)
    fn = click.option(
        "--url",
        envvar="SWARM_API_URL",
        show_envvar=True,
        default=None,
        help="Where the API answers (default: where the local daemon serves MODEL, with its "
        "API key, or, served by another member, through the swarm's links to it; without a "
        f"daemon, {DEFAULT_URL}, as `python -m swarmp2p.serve` listens).",
    )(fn)
    return _STATE_DIR_OPTION(fn)


def _endpoint(
    model: str, url: str | None, api_key: str | None, api_key_file: str | None, state_dir
):
    """The API's base URL (or the relay to it) and key: ``--url`` as given, else the local
    daemon's answer for MODEL: its own API (a key given with --api-key -, --api-key-file or
    $SWARM_API_KEY wins over the key it served with), or, served by another member, the relay
    through the swarm's links (``client/relay.py``); else DEFAULT_URL when no daemon runs. A
    model served nowhere in the swarm is an error naming what is served."""
    api_key = _read_api_key(api_key, api_key_file)
    if url:
        return url, api_key
    from swarmp2p.client import jobs as job_commands
    from swarmp2p.node.api import ApiError, NoDaemon

    try:
        found = job_commands.serve_endpoint(_state_dir(state_dir), model)
    except NoDaemon:
        return DEFAULT_URL, api_key
    except ApiError as e:
        raise click.ClickException(str(e)) from None
    if found.get("node"):
        from swarmp2p.client.relay import relay_post

        return relay_post(_state_dir(state_dir), model), None
    return found["url"], api_key if api_key is not None else found["api_key"]


def _sampling_options(max_tokens: int, what: str):
    """--max-tokens (default ``max_tokens``, help ``what``) and --temperature."""

    def add(fn):
        fn = click.option(
            "--temperature",
            type=click.FloatRange(0, 2),
            default=0.7,
            show_default=True,
            help="Sampling temperature (0: greedy).",
        )(fn)
        return click.option(
            "--max-tokens",
            type=click.IntRange(min=1),
            default=max_tokens,
            show_default=True,
            help=what,
        )(fn)

    return add


@main.command("generate")
@click.argument("model")
@click.argument("prompt")
@_sampling_options(max_tokens=128, what="Tokens to generate at most.")
@click.option("--stream/--no-stream", default=False, help="Print tokens as they come.")
@click.option("--json", "as_json", is_flag=True, help='Print {"model", "prompt", "text", "usage"}.')
@_api_options
def generate_command(
    model: str,
    prompt: str,
    max_tokens: int,
    temperature: float,
    stream: bool,
    as_json: bool,
    url: str | None,
    api_key,
    api_key_file,
    state_dir,
) -> None:
    """Complete PROMPT with MODEL through the swarm's API (`swarm serve` answers it)."""
    from swarmp2p.serve.client import ApiClientError, complete_text, stream_text

    url, api_key = _endpoint(model, url, api_key, api_key_file, state_dir)
    if stream and as_json:
        raise click.UsageError("--json prints one object at the end: leave --stream out")
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}
    try:
        if as_json:
            text, usage = complete_text(url, "/v1/completions", body, api_key=api_key)
            _echo_json({"model": model, "prompt": prompt, "text": text, "usage": usage})
        elif stream:
            for piece in stream_text(url, "/v1/completions", body, api_key=api_key):
                click.echo(piece, nl=False)
            click.echo()
        else:
            click.echo(complete_text(url, "/v1/completions", body, api_key=api_key)[0])
    except ApiClientError as e:
        raise click.ClickException(str(e)) from None


@main.command("chat")
@click.argument("model")
@click.option("--system", default=None, help="A system message to start the conversation.")
@_sampling_options(max_tokens=512, what="Tokens of each answer at most.")
@_api_options
def chat_command(
    model: str,
    system: str | None,
    max_tokens: int,
    temperature: float,
    url: str | None,
    api_key,
    api_key_file,
    state_dir,
) -> None:
    """Chat with MODEL through the swarm's API (empty line or end of input quits)."""
    from swarmp2p.serve.client import ApiClientError, stream_text

    url, api_key = _endpoint(model, url, api_key, api_key_file, state_dir)
    messages = [{"role": "system", "content": system}] if system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            click.echo("> ", nl=False)
        line = sys.stdin.readline()
        if not line.strip():
            return
        messages.append({"role": "user", "content": line.rstrip("\n")})
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
        }
        pieces = []
        try:
            for piece in stream_text(url, "/v1/chat/completions", body, api_key=api_key):
                pieces.append(piece)
                click.echo(piece, nl=False)
        except ApiClientError as e:
            raise click.ClickException(str(e)) from None
        click.echo()
        messages.append({"role": "assistant", "content": "".join(pieces)})
