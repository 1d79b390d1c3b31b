"""Text in and out of a served model: its tokenizer, its chat template, streamed detokenizing
and stop strings. Reads the model folder's own files (``tokenizer.json``, the chat template in
``chat_template.jinja`` or ``tokenizer_config.json``, the end-of-sequence ids).

The chat template is rendered as transformers' ``apply_chat_template`` renders it, without
importing transformers: the same sandboxed jinja2 environment (``trim_blocks``,
``lstrip_blocks``, ``loopcontrols``, a ``{% generation %}`` tag), the same ``tojson`` (not
HTML-escaped, ``ensure_ascii=False`` by default, ``indent``/``separators``/``sort_keys``),
``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``, and the same variables
(``messages``, ``tools``, ``documents``, ``add_generation_prompt`` and the named special
tokens). A test renders templates byte for byte against ``apply_chat_template``.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

MAX_STOP_STRINGS = 4
"""OpenAI's limit on ``stop``."""
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""The named special tokens transformers hands a chat template (``special_tokens_map``)."""


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
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        """Token ids the tokenizer knows: a prompt's ids must be below it."""
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
        fallback = _read_json(folder / "special_tokens_map.json")
        for name in SPECIAL_TOKEN_NAMES:
            value = config.get(name, fallback.get(name))
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

    def token_text(self, token: int) -> str:
        """One token's own text (special tokens included), as logprobs report it."""
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def render_chat(self, messages: list[dict[str, Any]], **variables: Any) -> str:
        """The prompt text the chat template makes of ``messages``, ready for the assistant
        (``variables`` reach the template too, as ``apply_chat_template``'s kwargs do)."""
        if self.chat_template is None:
            raise ValueError(
                "this model has no chat template (no chat_template.jinja and none in "
                "tokenizer_config.json); use /v1/completions with your own prompt"
            )
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        from jinja2 import TemplateError

        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        context = {
            **self.special,
            **variables,
            "messages": messages,
            "tools": variables.get("tools"),
            "documents": variables.get("documents"),
            "add_generation_prompt": variables.get("add_generation_prompt", True),
        }
        try:
            return self._template.render(**context)
        except TemplateError as e:
            raise ValueError(f"the chat template refused the messages: {e}") from None

    def encode_chat(self, messages: list[dict[str, Any]], **variables: Any) -> list[int]:
        # the template writes the special tokens itself; the tokenizer must not add more
        text = self.render_chat(messages, **variables)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    @property
    def takes_tools(self) -> bool:
        """Whether the chat template renders ``tools`` (it reads the variable at all): one that
        does not would drop a request's tools without a word."""
        if self.chat_template is None:
            return False
        from jinja2 import TemplateSyntaxError, meta

        try:
            parsed = chat_environment().parse(self.chat_template)
        except TemplateSyntaxError:
            return False
        return "tools" in meta.find_undeclared_variables(parsed)


def compile_chat_template(source: str):
    """A chat template compiled in the jinja2 environment transformers renders them in
    (``transformers.utils.chat_template_utils._compile_jinja_template``)."""
    return chat_environment().from_string(source)


def chat_environment():
    """The jinja2 environment transformers renders chat templates in."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body (transformers tracks
        the assistant's tokens with it; nothing here needs that)."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        """``dict(...)`` without attribute access to the real type."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """``namespace(...)`` refusing underscore-prefixed attributes."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    "chat templates cannot store underscore-prefixed attributes on a namespace, "
                    f"got {name!r}"
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


class TextStream:
    """Detokenizes generated ids as they come, holding back what could still be a stop string
    or half a character. ``push(ids)`` is a session's ``stop`` rule: it takes the newest id, adds
    each new piece of text to ``pieces`` (and hands it to ``on_text``) and returns True once a
    stop string appeared (text before it kept).

    The text is what the generated ids add to the prompt's: ``decode(prompt + generated)``
    less ``decode(prompt)``. The decoder starts from the prompt's last ids (``prompt``), so a
    SentencePiece-style first token ("▁world" after "Hello") keeps its space: decoded on its
    own, as the start of a text, the Metaspace decoder drops it ("Helloworld").

    O(1) per token: the tokenizers library's streaming decoder turns one id into its new text
    (it keeps the few ids a character or a word boundary needs), and stop strings are looked
    for only in the held-back tail plus that new text — a stop string that ends in the new text
    began in the held-back tail, since everything before it was handed out as unable to begin
    one."""

    def __init__(
        self,
        codec: TextCodec,
        stop: Sequence[str] = (),
        on_text: Callable[[str], None] | None = None,
        *,
        prompt: Sequence[int] = (),
    ) -> None:
        from tokenizers.decoders import DecodeStream

        self.codec = codec
        self.stop_strings = [s for s in stop if s]
        self.on_text = on_text
        self.pieces: collections.deque[str] = collections.deque()
        """New text not yet taken (``take``); safe to read from another thread."""
        self.stopped = False
        self._decoder = DecodeStream(skip_special_tokens=True)
        for token in _prompt_context(codec, prompt):
            self._step(token)  # the prompt's own text is not handed out
        self._held = ""
        self._out: list[str] = []

    @property
    def text(self) -> str:
        """Everything handed out so far."""
        return "".join(self._out)

    def push(self, tokens: Sequence[int]) -> bool:
        """Take the newest of ``tokens``; True when a stop string ends the text."""
        if self.stopped:
            return True
        new = self._step(tokens[-1])
        if not new:  # a character split across tokens: wait for the rest
            return False
        buf = self._held + new
        cut = min((i for i in (buf.find(s) for s in self.stop_strings) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            self._emit(buf[:cut])
            return True
        hold = _held_back(buf, self.stop_strings)
        self._held = buf[len(buf) - hold :] if hold else ""
        self._emit(buf[: len(buf) - hold])
        return False

    def finish(self) -> str:
        """Hand out what was held back (the generation ended); the whole text."""
        if not self.stopped and self._held:
            self._emit(self._held)
            self._held = ""
        return self.text

    def take(self) -> str:
        """The text handed out since the last ``take``."""
        out = []
        while self.pieces:
            out.append(self.pieces.popleft())
        return "".join(out)

    def _step(self, token: int) -> str | None:
        try:
            return self._decoder.step(self.codec.tokenizer, token)
        except Exception:  # an id the tokenizer cannot decode (beyond its vocabulary) adds nothing
            return None

    def _emit(self, piece: str) -> None:
        if piece:
            self._out.append(piece)
            self.pieces.append(piece)
            if self.on_text is not None:
                self.on_text(piece)


PROMPT_CONTEXT = (4, 24)
"""The fewest and the most prompt ids a TextStream's decoder starts from."""


def _prompt_context(codec: TextCodec, prompt: Sequence[int]) -> list[int]:
    """The shortest tail of ``prompt`` (``PROMPT_CONTEXT`` ids at least, at most) that decodes
    to whole characters: one that began or ended inside a character split across tokens would
    make the first generated ids' text wrong. The tail only gives the decoder its context (is
    the next token's "▁" a space, does a byte finish a character); a few ids are enough, and
    the cost per request stays the same for long prompts."""
    fewest, most = PROMPT_CONTEXT
    prompt = list(prompt)
    for n in range(min(fewest, len(prompt)), min(most, len(prompt)) + 1):
        try:
            whole = "\ufffd" not in codec.decode(prompt[-n:])
        except Exception:  # an id the tokenizer cannot decode: try a longer tail
            whole = False
        if whole:
            return prompt[-n:]
    return prompt[-most:]


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that begins some stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
