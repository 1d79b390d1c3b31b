"""`swarm serve`."""

from __future__ import annotations

import json
import os

import click

from swarmp2p.cli import (
    _STATE_DIR_OPTION,
    _api_key_options,
    _fail,
    _read_api_key,
    _state_dir,
    main,
)

# --- swarm serve: a model across the swarm behind the OpenAI-compatible API ----------------


@main.command("serve")
@click.argument("model", required=False)
@click.option(
    "--stop",
    "stop_model",
    default=None,
    metavar="NAME",
    help="Stop serving NAME: the name the API answers to (--name when it was served, else "
    "MODEL as given).",
)
@click.option(
    "--stages", type=click.IntRange(min=0), default=0, help="Stages (0: one per usable device)."
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8080,
    show_default=True,
    help="Port of the OpenAI-compatible API on this node (0: any free port).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Where the API listens.")
@click.option(
    "--max-sessions",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Concurrent generations; each stage reserves a KV cache for every one.",
)
@click.option(
    "--max-context",
    type=click.IntRange(min=0),
    default=0,
    help="Tokens of prompt and answer per session (0: the model's maximum).",
)
@click.option(
    "--prefix-cache-mb",
    type=click.IntRange(min=0),
    default=None,
    help="MiB of cached prompt blocks each stage keeps, so a new session whose prompt starts "
    "like an earlier one's (a system prompt) prefills only the rest; priced in the plan "
    "(0: off; default: up to 64, as much as the devices have room for beside the sessions; an "
    "explicit size that does not fit fails the plan).",
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16", "float16"]),
    default=None,
    help="Default: the best dtype every stage's device runs (bfloat16 on compute 8.0+, float16 "
    "on 7.x, float32 below and on CPUs), or the dtype a trained model was trained in.",
)
@click.option("--quantization", default=None, help='Quantized base, JSON: {"bits": 4}.')
@click.option(
    "--speculate",
    type=click.Choice(["auto", "ngram", "draft", "none"]),
    default="auto",
    show_default=True,
    help="Speculative decoding: tokens are drafted and the ring verifies them in one lap "
    "(greedy output unchanged, sampling's distribution unchanged); ngram drafts 10 by prompt "
    "lookup on the issuing node, draft drafts 10 with the --draft model on stage 0, auto uses "
    "the draft model when one is given (else prompt lookup), adapts the draft length to the "
    "acceptance and the drafter's cost and stops drafting where it does not pay.",
)
@click.option(
    "--draft",
    default=None,
    metavar="DRAFT",
    help='A draft model for speculative decoding (a folder or "embedded"; the same tokenizer '
    "as MODEL, or it is refused naming both): stage 0 holds it beside its blocks (priced in "
    "the plan) and drafts with it greedily.",
)
@click.option("--name", default=None, help="The model name the API answers to (default MODEL).")
@_api_key_options("Require an API key from API clients (Authorization: Bearer)")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_STATE_DIR_OPTION
def serve_command(
    model, stop_model, state_dir, as_json, quantization, api_key, api_key_file, **options
) -> None:
    """Serve MODEL (a model from `swarm models`, a folder, a cached Hub id, or "embedded")
    across the swarm.

    The leader plans the stages as it plans training (dtype by compute capability, memory
    priced with the KV cache of --max-sessions sessions of --max-context tokens), every stage's
    node checks the plan and loads its blocks, and this node answers the OpenAI-compatible API
    until `swarm serve --stop NAME`. A trained model serves in place: each stage loads its
    trained shard on the node that holds it. "embedded" is converted on first use.
    """
    from swarmp2p.client import jobs as job_commands
    from swarmp2p.node.api import ApiError
    from swarmp2p.plan.serve import parse_serve_request

    sd = _state_dir(state_dir)
    try:
        if stop_model is not None:
            done = job_commands.serve_stop(sd, stop_model)
            click.echo(
                json.dumps(done, indent=2) if as_json else f"stopped serving {done['model']}"
            )
            return
        if not model:
            raise click.UsageError("name a MODEL to serve, or --stop NAME")
        if quantization is not None:
            try:
                quantization = json.loads(quantization)
            except ValueError as exc:
                raise click.BadParameter(f"not JSON: {exc}", param_hint="--quantization") from None
        options["api_key"] = _read_api_key(api_key, api_key_file)
        # the daemon runs in another folder: it reads a relative MODEL folder from this one
        request = parse_serve_request(
            {"model": model, "quantization": quantization, "cwd": os.getcwd(), **options}
        )
        view = job_commands.serve(sd, request.to_dict())
    except (ApiError, ValueError) as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(view, indent=2))
        return
    where = ", ".join(
        f"{s['node']} [{s['layers'][0]}-{s['layers'][1] - 1}]" for s in view["stages"]
    )
    click.echo(
        f"serving {view['model']} at {view['url']}/v1 on {len(view['stages'])} stage(s) "
        f"({view.get('dtype')}): {where}"
    )
