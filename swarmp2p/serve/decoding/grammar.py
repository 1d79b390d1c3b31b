"""Structured outputs: what a reply must match, as a grammar matched token by token.

``response_format`` ``{"type": "json_object"}`` and ``{"type": "json_schema", "json_schema":
{"schema": ...}}``, and a tool call that ``tool_choice`` forces, become an llguidance grammar
(:func:`grammar_for`). A session's :class:`Matcher` gives, before each step, the bitmask of the
token ids the grammar allows next (:meth:`Matcher.mask`); the stage that samples masks its
logits with it (every other id gets probability 0), and the sampled id advances the matcher.
So the reply is valid by construction, even from a 135M model, and the cost is one mask a token
(llguidance computes one in tens of microseconds for JSON; it is the library vLLM and
llama.cpp offer for the same job).

Why llguidance (not xgrammar): it has no dependency (xgrammar needs torch and transformers,
which the light plane that drives sessions never imports), ships abi3 wheels for every Python
the project supports, compiles JSON schemas lazily (no per-schema warm-up), and handles the
tokenizers of any Hugging Face fast tokenizer from its ``tokenizer.json``.

The grammar is compiled where the request arrives (the issuing node: a bad schema is a 400
there) and its text travels once, in the session's first ``prefill``, to the ring's last stage,
which runs the session's :class:`Matcher` over the model's own tokenizer (read from the model
folder the stage loaded, never sent) and masks every token it samples: no per-token mask crosses
the ring, and no lap waits for the issuing node. A replay after a failover advances a new
matcher over the tokens generated before it. Light plane: no torch.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_SCHEMA_BYTES = 64 * 1024
"""A ``json_schema`` (or all of a request's ``tools``) larger than this is refused (a grammar
costs memory per session)."""
MAX_GRAMMAR_BYTES = 256 * 1024
"""The longest grammar text a ``prefill`` carries (a schema's grammar is about its size)."""
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
"""The common tool-call format of chat templates that take tools (Qwen, SmolLM3, Hermes)."""


JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON as ``json.dumps`` writes it: no run of whitespace for a model to wander into."""


class GrammarError(ValueError):
    """A response format or tool the server cannot turn into a grammar, named."""


@dataclass(frozen=True, slots=True)
class Grammar:
    """A compiled grammar: llguidance's JSON form and what it came from (for messages)."""

    text: str
    what: str


def _checked(text: str, what: str) -> Grammar:
    """The grammar ``text`` once llguidance accepts it and it fits a prefill."""
    if len(text) > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"{what}: the grammar is {len(text)} bytes, above {MAX_GRAMMAR_BYTES}")
    failed, messages = _llg().LLMatcher.validate_grammar_with_warnings(text)
    if failed:
        raise GrammarError(f"{what}: {messages[0] if messages else 'not a valid schema'}")
    return Grammar(text=text, what=what)


def _llg():
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise GrammarError(
            "structured outputs need the llguidance package (pip install llguidance)"
        ) from exc
    return llguidance


def json_grammar(schema: Mapping[str, Any] | None, what: str) -> Grammar:
    """The grammar of JSON text matching ``schema`` (None: any JSON object)."""
    llg = _llg()
    schema = {"type": "object"} if schema is None else dict(schema)
    body = json.dumps(schema)  # property order is the order they are generated in
    if len(body) > MAX_SCHEMA_BYTES:
        raise GrammarError(f"{what}: the schema is {len(body)} bytes, above {MAX_SCHEMA_BYTES}")
    try:
        text = llg.LLMatcher.grammar_from_json_schema(body, defaults=dict(JSON_LAYOUT))
    except ValueError as exc:
        raise GrammarError(f"{what}: {exc}") from None
    return _checked(text, what)


def grammar_for(response_format: Mapping[str, Any] | None) -> Grammar | None:
    """The grammar an OpenAI ``response_format`` asks for; None for ``text`` or none."""
    if not response_format or response_format.get("type", "text") == "text":
        return None
    kind = response_format.get("type")
    if kind == "json_object":
        return json_grammar(None, "response_format json_object")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema", {}), Mapping):
            raise GrammarError(
                "response_format json_schema: json_schema must be an object with a schema object"
            )
        name = spec.get("name") or "schema"
        return json_grammar(spec.get("schema") or {}, f"response_format json_schema {name!r}")
    raise GrammarError(
        f"response_format type {kind!r} is not one of text, json_object, json_schema"
    )


def tag_tokens(tokenizer: Any) -> frozenset[str]:
    """The tool-call tags that ``tokenizer`` (a ``tokenizers.Tokenizer``) has as added tokens,
    as Qwen's and Hermes' have ``<tool_call>``: llguidance reads every added token as a special
    one, matched by its id only, so a grammar must name such a tag as a token, not as text."""
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    return frozenset(tag for tag in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE) if tag in added)


def tool_call_grammar(
    tools: Sequence[Mapping[str, Any]], name: str | None, tokens: Iterable[str] = ()
) -> Grammar:
    """A forced tool call: ``<tool_call>{"name": N, "arguments": {...}}</tool_call>`` with
    the arguments matching the named function's parameters (``name`` None: any of ``tools``,
    as ``tool_choice: "required"`` asks); the tags in ``tokens`` (:func:`tag_tokens`) are
    written as the model's tokens of that name."""
    functions = [t["function"] for t in tools if t.get("type", "function") == "function"]
    chosen = [f for f in functions if name is None or f.get("name") == name]
    if not chosen:
        known = ", ".join(repr(f.get("name")) for f in functions) or "none"
        raise GrammarError(f"tool_choice names function {name!r}, not one of the tools ({known})")
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                "arguments": f.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in chosen
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    what = f"tool_choice {name or 'required'}"
    body = json.dumps({**schema, "x-guidance": JSON_LAYOUT})
    if len(body) > MAX_SCHEMA_BYTES:
        raise GrammarError(
            f"{what}: the tools' schemas are {len(body)} bytes, above {MAX_SCHEMA_BYTES}"
        )
    tokens = frozenset(tokens)
    tag = {t: t if t in tokens else json.dumps(t) for t in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)}
    lark = (
        f'start: {tag[TOOL_CALL_OPEN]} "\\n" call "\\n" {tag[TOOL_CALL_CLOSE]}\n'
        f"call: %json {body}\n"
    )
    try:
        text = _llg().LLMatcher.grammar_from_lark(lark)
    except ValueError as exc:
        raise GrammarError(f"{what}: {exc}") from None
    return _checked(text, what)


_TOKENIZERS: dict[int, Any] = {}


def ll_tokenizer(tokenizer: Any, *, vocab_size: int, eos_ids: Iterable[int]):
    """llguidance's view of a ``tokenizers.Tokenizer`` whose model emits ``vocab_size``
    logits (cached per tokenizer object: building one takes ~1 s for a 50k vocabulary)."""
    key = id(tokenizer)
    got = _TOKENIZERS.get(key)
    if got is not None and got[0] is tokenizer:
        return got[1]
    llg = _llg()
    made = llg.LLTokenizer(
        tokenizer.to_str(), n_vocab=vocab_size, eos_token=sorted(eos_ids) or None
    )
    _TOKENIZERS[key] = (tokenizer, made)
    return made


class Matcher:
    """One session's place in its grammar."""

    def __init__(self, tokenizer: Any, grammar: Grammar) -> None:
        llg = _llg()
        self.grammar = grammar
        self._m = llg.LLMatcher(tokenizer, grammar.text, log_level=0)
        self._check()

    def _check(self) -> None:
        if self._m.is_error():
            raise GrammarError(f"{self.grammar.what}: {self._m.get_error()}")

    def mask(self) -> bytes:
        """The allowed next ids as a little-endian bitmask, 32 ids per 4 bytes (id i is bit
        ``i % 8`` of byte ``i // 8``); the end-of-sequence ids are set once it may end."""
        mask = self._m.compute_bitmask()
        self._check()
        return mask

    def advance(self, token: int) -> None:
        """Take the sampled id; GrammarError if the grammar did not allow it."""
        if not self._m.consume_token(token):
            raise GrammarError(f"{self.grammar.what}: token {token} does not follow the grammar")
        self._check()

    def forced(self) -> list[int]:
        """The ids that spell the bytes the grammar forces next (a key's quotes and colon, a
        closing brace), as the tokenizer would write them: a draft that costs nothing to make
        (not certain: the model may spell the same bytes with other ids)."""
        ids = self._m.compute_ff_tokens()
        self._check()
        return list(ids)

    @property
    def done(self) -> bool:
        """The reply is complete: nothing but an end-of-sequence id may follow."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        """The reply so far is a whole match (an end-of-sequence id may come now)."""
        return self._m.is_accepting()


def allowed(mask: bytes, token: int) -> bool:
    """Whether ``mask`` (:meth:`Matcher.mask`) allows ``token``."""
    return bool(mask[token // 8] >> (token % 8) & 1)


def _call(body: str) -> dict[str, Any] | None:
    """The ``{"name", "arguments"}`` of one block's JSON, arguments as a JSON object's text;
    None when the block is not that (not JSON, no string name, arguments not an object)."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):  # some templates write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": call["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def call_id() -> str:
    """A tool call's id, unique across replies as OpenAI's are (``call_`` and 24 hex digits): a
    client answers each call by its id, and a conversation holds the calls of many replies
    (numbered from ``call_0`` in every reply, two turns' calls shared an id)."""
    return "call_" + secrets.token_hex(12)


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """The reply's text without its ``<tool_call>`` blocks, and the calls they hold as
    OpenAI ``tool_calls`` (``{"id", "type": "function", "function": {"name", "arguments"}}``,
    arguments as a JSON object's text). A block (``<tool_call>`` to the first ``</tool_call>``)
    that is not a JSON object with a string name and object arguments stays text, whole."""
    calls, kept, last = [], [], 0
    for match in TOOL_CALL.finditer(text):
        function = _call(match.group(1))
        if function is None:
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append({"id": call_id(), "type": "function", "function": function})
    kept.append(text[last:])
    return "".join(kept).strip() if calls else text, calls


def _open_prefix(text: str) -> int:
    """How many characters at the end of ``text`` could begin a ``<tool_call>`` block."""
    for keep in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-keep:]):
            return keep
    return 0


class ToolCallStream:
    """A streamed reply split as it comes into content and tool calls (``delta.tool_calls``):
    text that may begin a ``<tool_call>`` block is held back until the block closes (a call, as
    :func:`parse_tool_calls` reads it) or cannot be one (text). O(1) a piece but for a block
    being written, which is held whole."""

    def __init__(self) -> None:
        self._held = ""
        self.calls: list[dict[str, Any]] = []
        """Every call so far, in order."""

    def push(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The content ready after ``text``, and the calls completed by it."""
        held, out, calls = self._held + text, [], []
        while True:
            start = held.find(TOOL_CALL_OPEN)
            if start < 0:
                keep = _open_prefix(held)
                out.append(held[: len(held) - keep])
                held = held[len(held) - keep :]
                break
            end = held.find(TOOL_CALL_CLOSE, start)
            if end < 0:
                out.append(held[:start])
                held = held[start:]
                break
            end += len(TOOL_CALL_CLOSE)
            function = _call(held[start + len(TOOL_CALL_OPEN) : end - len(TOOL_CALL_CLOSE)])
            if function is not None:
                out.append(held[:start])
                call = {"id": call_id(), "type": "function", "function": function}
                self.calls.append(call)
                calls.append(call)
            else:
                out.append(held[:end])
            held = held[end:]
        self._held = held
        return "".join(out), calls

    def finish(self) -> str:
        """What was held back at the end: an unclosed block is text."""
        rest, self._held = self._held, ""
        return rest


__all__ = [
    "MAX_GRAMMAR_BYTES",
    "Grammar",
    "GrammarError",
    "Matcher",
    "ToolCallStream",
    "allowed",
    "grammar_for",
    "json_grammar",
    "ll_tokenizer",
    "parse_tool_calls",
    "tag_tokens",
    "tool_call_grammar",
]
