"""Tiny random models of every family the torch runtime supports (helpers for the tests here)."""

from __future__ import annotations

from pathlib import Path

VOCAB = 128
SHARD_SIZE = "40KB"
"""Small enough that every tiny checkpoint spans several files."""


def _common(**extra):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    base.update(extra)
    return base


def _configs():
    import transformers as tf

    return {
        "gpt2": lambda: tf.GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=4,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        "llama": lambda: tf.LlamaConfig(**_common()),
        "mistral": lambda: tf.MistralConfig(**_common(sliding_window=4)),
        "qwen2": lambda: tf.Qwen2Config(
            **_common(use_sliding_window=True, sliding_window=4, max_window_layers=2)
        ),
        "qwen3": lambda: tf.Qwen3Config(**_common(head_dim=8, tie_word_embeddings=True)),
        "gemma3": lambda: tf.Gemma3TextConfig(
            **_common(
                head_dim=8,
                sliding_window=4,
                sliding_window_pattern=2,
                final_logit_softcapping=5.0,
                tie_word_embeddings=True,
            )
        ),
        "phi3": lambda: tf.Phi3Config(**_common(pad_token_id=0)),
        "gpt_neox": lambda: tf.GPTNeoXConfig(
            **_common(rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0)
        ),
        "qwen3_5": lambda: tf.Qwen3_5Config(
            text_config=_common(
                head_dim=8,
                linear_key_head_dim=8,
                linear_value_head_dim=8,
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                full_attention_interval=2,
            ),
            vision_config=dict(
                depth=1,
                hidden_size=16,
                intermediate_size=32,
                num_heads=2,
                out_hidden_size=32,
                patch_size=4,
                num_position_embeddings=16,
            ),
        ),
        "granite": lambda: tf.GraniteConfig(
            **_common(
                embedding_multiplier=3.0,
                logits_scaling=4.0,
                residual_multiplier=0.5,
                attention_multiplier=0.2,
            )
        ),
        "cohere": lambda: tf.CohereConfig(**_common(logit_scale=0.5, tie_word_embeddings=True)),
        "mixtral": lambda: tf.MixtralConfig(**_common(num_local_experts=4, num_experts_per_tok=2)),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(
            **_common(
                head_dim=8,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                mlp_only_layers=[0],
            )
        ),
    }


FAMILIES = (
    "gpt2",
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3",
    "phi3",
    "gpt_neox",
    "qwen3_5",
    "mixtral",
    "qwen3_moe",
    "granite",
    "cohere",
)


WIDE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "n_embd": 64,
    "num_key_value_heads": 4,
    "head_dim": 16,
}
"""Widths for bitsandbytes' CPU 4-bit kernels, which pack rows in blocks of 64 inputs."""


def build_model(family: str, seed: int = 0, wide: bool = False):
    """A tiny random model of ``family`` in float32, eval mode (hidden 64 when ``wide``)."""
    import torch
    import transformers as tf

    config = _configs()[family]()
    if wide:
        for name, value in WIDE.items():
            if hasattr(config, name):
                setattr(config, name, value)
    torch.manual_seed(seed)
    if family == "qwen3_5":
        model = tf.Qwen3_5ForConditionalGeneration(config)
    else:
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def load_whole(folder: Path, dtype=None):
    """The whole model as transformers loads it: the causal-LM reference for parity."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32).eval()


def byte_bpe(corpus, vocab_size: int = 400):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``corpus`` (ids 0-2: <unk>, <s>,
    </s>): any text encodes, as with the byte-level tokenizers of real models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    return tok
