"""Text in and out of a served model: its tokenizer, its chat template, streamed detokenizing
and stop strings. Reads the model folder's own files (``tokenizer.json``, the chat template in
``chat_template.jinja`` or ``tokenizer_config.json``, the end-of-sequence ids)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

MAX_STOP_STRINGS = 4
"""OpenAI's limit on ``stop``."""


class TextCodec:
    """A model's tokenizer and chat template (``TextCodec.from_folder(folder)``)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template: str | None,
        eos_ids: frozenset[int],
        special: dict[str, str],
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.eos_ids = eos_ids
        """Token ids that end a generation (the model's and its generation config's)."""
        self.special = special
        """bos_token, eos_token, ... as strings, for the chat template."""
        self._template = None

    @classmethod
    def from_folder(cls, folder: str | Path) -> TextCodec:
        from tokenizers import Tokenizer

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{folder} has no tokenizer.json; serving text needs the model's fast tokenizer "
                "(save it with tokenizer.save_pretrained into the model folder)"
            )
        tokenizer = Tokenizer.from_file(str(path))
        config = _read_json(folder / "tokenizer_config.json")
        template = None
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        elif isinstance(config.get("chat_template"), str):
            template = config["chat_template"]
        special = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = config.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                special[name] = value
        eos: set[int] = set()
        for source in ("generation_config.json", "config.json"):
            data = _read_json(folder / source)
            data = data.get("text_config", data) if source == "config.json" else data
            value = data.get("eos_token_id")
            eos.update([value] if isinstance(value, int) else value or [])
        if "eos_token" in special:
            token_id = tokenizer.token_to_id(special["eos_token"])
            if token_id is not None:
                eos.add(token_id)
        return cls(tokenizer, chat_template=template, eos_ids=frozenset(eos), special=special)

    def encode(self, text: str) -> list[int]:
        """Token ids of a completion prompt (with the tokenizer's own special tokens, if any)."""
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The prompt text the chat template makes of ``messages``, ready for the assistant."""
        if self.chat_template is None:
            raise ValueError(
                "this model has no chat template (no chat_template.jinja and none in "
                "tokenizer_config.json); use /v1/completions with your own prompt"
            )
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent)
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=True, **self.special)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        # the template writes the special tokens itself; the tokenizer must not add more
        return self.tokenizer.encode(self.render_chat(messages), add_special_tokens=False).ids


def _raise_template_error(message: str) -> None:
    raise ValueError(f"the chat template refused the messages: {message}")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


class TextStream:
    """Detokenizes generated ids as they come, holding back what could still be a stop string
    or half a character. ``push(ids)`` is a session's ``stop`` rule: it hands each new piece of
    text to ``on_text`` and returns True once a stop string appeared (text before it kept)."""

    def __init__(
        self,
        codec: TextCodec,
        stop: Sequence[str] = (),
        on_text: Callable[[str], None] | None = None,
    ) -> None:
        self.codec = codec
        self.stop_strings = [s for s in stop if s]
        self.on_text = on_text
        self.text = ""
        """Everything handed out so far."""
        self.stopped = False
        self._ids: list[int] = []
        self._full = ""

    def push(self, tokens: Sequence[int]) -> bool:
        """Take the newest of ``tokens``; True when a stop string ends the text."""
        if self.stopped:
            return True
        self._ids.append(tokens[-1])
        full = self.codec.decode(self._ids)
        self._full = full
        if full.endswith("\ufffd"):  # a character split across tokens: wait for the rest
            return False
        cut = min((i for i in (full.find(s) for s in self.stop_strings) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._emit(full[:cut])
            return True
        self._emit(full[: len(full) - self._held_back(full)])
        return False

    def finish(self) -> str:
        """Hand out what was held back (the generation ended); the whole text."""
        if not self.stopped:
            self._emit(self._full.rstrip("\ufffd"))
        return self.text

    def _held_back(self, full: str) -> int:
        """Length of the longest tail of ``full`` that begins some stop string."""
        longest = 0
        for stop in self.stop_strings:
            for n in range(min(len(stop) - 1, len(full)), longest, -1):
                if full.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _emit(self, upto: str) -> None:
        if len(upto) > len(self.text) and upto.startswith(self.text):
            piece = upto[len(self.text) :]
            self.text = upto
            if self.on_text is not None:
                self.on_text(piece)
