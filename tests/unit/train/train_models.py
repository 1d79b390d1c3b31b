"""Tiny models and in-process pipelines for the training tests."""

from __future__ import annotations

import contextlib
import copy
import itertools
import threading

VOCAB = 128


def build_model(family: str, seed: int = 0, layers: int = 4):
    """A tiny random causal LM of ``family`` (float32, no dropout, untied head)."""
    import torch
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    configs = {
        "llama": lambda: tf.LlamaConfig(**common),
        "gpt2": lambda: tf.GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=layers,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=False,
        ),
        "mixtral": lambda: tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2),
    }
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(configs[family](), attn_implementation="sdpa")
    return model.float().eval()


def token_batches(n: int, batch: int, seq: int, seed: int = 0):
    """``n`` random ``[batch, seq + 1]`` token batches."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, seq + 1), generator=gen) for _ in range(n)]


def stage_copies(model, cuts: list[int]):
    """(stage, name_of) per stage: each stage built over its own deep copy of ``model``;
    ``name_of`` maps a parameter's id to its name in the whole model."""
    from swarmp2p.runtime.torch import build_stage
    from swarmp2p.runtime.torch.model.introspect import introspect

    bounds = [0, *cuts, introspect(model).num_blocks]
    out = []
    for a, b in itertools.pairwise(bounds):
        clone = copy.deepcopy(model)
        names = {id(p): n for n, p in clone.named_parameters()}
        out.append((build_stage(clone, a, b), names))
    return out


def run_threads(targets):
    """Run each callable in its own thread; re-raise the first error; return the results."""
    results, errors = [None] * len(targets), []

    def wrap(i, fn):
        try:
            results[i] = fn()
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=wrap, args=(i, fn), name=f"stage-{i}")
        for i, fn in enumerate(targets)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return results


@contextlib.contextmanager
def curve_rings():
    """``make(n)``: the links of a ring of ``n`` members over real CURVE ZmqLinks, as
    ``[(to_next, from_prev)]`` per member (member i dials member i + 1's bound end); every link
    made is closed after."""
    from swarmp2p.net import SecureContext, SwarmSecret
    from swarmp2p.net.links import ZmqLink

    ctx, secret = SecureContext(), SwarmSecret.generate()
    made = []

    def make(n: int):
        bound = [ZmqLink.bind(ctx, secret, "127.0.0.1", 0) for _ in range(n)]
        dialed = [ZmqLink.dial(ctx, secret, bound[(i + 1) % n].endpoint) for i in range(n)]
        made.extend(bound + dialed)
        return [(dialed[i], bound[i]) for i in range(n)]

    try:
        yield make
    finally:
        for link in made:
            link.close()
        ctx.destroy(linger=0)
