"""The decode state of a group of serving sessions at one stage, laid out for batched forwards.

A :class:`SessionBatch` holds an ordered set of sessions (its *rows*) for one stage's blocks:

- an attention block's keys and values as ``[rows, kv_heads, capacity, head_dim]``: a session's
  token at position ``p`` lives at index ``p`` of its row, so a decode step writes one column
  per row in place and attention reads a view of the first ``max(length) + 1`` columns, with a
  mask per row (causal, and the sliding window where the layer type has one) hiding what a
  shorter row does not hold;
- a recurrent (Gated DeltaNet) block's conv and recurrent states as ``[rows, ...]``, updated in
  place by the block's own kernels.

Blocks see it as transformers' cache (``update``, ``get_conv_state``, ...): it stands in for a
``DynamicCache`` during one forward. Why this layout and not transformers' ``DynamicCache`` per
session: a ``DynamicCache`` concatenates the whole cache on every step (a copy of every key and
value per layer per token), and batching per-session caches would copy them all into one
padded batch on every step again. Here a step copies nothing; rows are copied only when a
group's membership changes (:meth:`SessionBatch.gather`), which happens once or twice in a
session's life. Capacity grows by doubling, so appending a token is O(1) amortised.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from swarmp2p.runtime.torch.model.hf_compat import attn_implementation
from swarmp2p.runtime.torch.model.introspect import LINEAR_ATTENTION

KVBlock = dict
"""One cached block of a stage: ``{layer: (keys [kv_heads, block, head_dim], values)}``."""
GROW_TOKENS = 64
"""Smallest capacity step (tokens): a session's first prefill allocates at least this much."""


class SessionBatch:
    """Decode state of an ordered group of sessions (rows) for one stage's blocks."""

    def __init__(self, config, sids: Sequence[int], *, max_context: int) -> None:
        self.config = config
        self.sids: list[int | None] = list(sids)
        """Each row's session; None once the session moved to another batch or ended."""
        self.lengths: list[int] = [0] * len(self.sids)
        """Tokens each row holds."""
        self.max_context = max_context
        self.capacity = 0
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        self.conv_kernel: dict[int, int] = {}
        self._new = 0
        self._view = 0
        self._counts: list[int] | None = None
        self._rows: torch.Tensor | None = None
        self._cols: torch.Tensor | None = None
        self.position_ids: torch.Tensor | None = None
        self._impl = attn_implementation(config)
        self._window = getattr(config, "sliding_window", None)

    @property
    def rows(self) -> int:
        return len(self.sids)

    @property
    def live(self) -> int:
        return sum(s is not None for s in self.sids)

    # --- regrouping -------------------------------------------------------------------------

    @classmethod
    def gather(
        cls, parts: Sequence[tuple[SessionBatch, int]], sids: Sequence[int], *, max_context: int
    ) -> SessionBatch:
        """A new batch whose row i is row ``parts[i][1]`` of batch ``parts[i][0]`` (copied);
        the source rows are marked moved."""
        first = parts[0][0]
        batch = cls(first.config, sids, max_context=max_context)
        batch.lengths = [src.lengths[row] for src, row in parts]
        batch.capacity = min(max_context, _grown(max(batch.lengths) + 1, 0))
        n = len(parts)
        for layer, sample in first.keys.items():
            shape = (n, sample.shape[1], batch.capacity, sample.shape[3])
            batch.keys[layer] = sample.new_zeros(shape)
            batch.values[layer] = first.values[layer].new_zeros(shape)
            for i, (src, row) in enumerate(parts):
                length = batch.lengths[i]
                batch.keys[layer][i, :, :length] = src.keys[layer][row, :, :length]
                batch.values[layer][i, :, :length] = src.values[layer][row, :, :length]
        for layer in first.conv:
            batch.conv[layer] = torch.cat([src.conv[layer][row : row + 1] for src, row in parts])
        for layer in first.recurrent:
            batch.recurrent[layer] = torch.cat(
                [src.recurrent[layer][row : row + 1] for src, row in parts]
            )
        batch.conv_kernel = dict(first.conv_kernel)
        for src, row in parts:
            src.sids[row] = None
        return batch

    # --- one forward --------------------------------------------------------------------------

    def expect(self, counts: Sequence[int]) -> None:
        """The next forward is a prefill padded on the right: row i takes ``counts[i]`` real
        tokens of the forward's width after the ones it holds (none for a fresh row; a cached
        prefix for a row :meth:`load_prefix` filled); the rest is padding, written past the
        row's length, where the mask hides it until the row's own tokens overwrite it."""
        if len(counts) != self.rows:
            raise ValueError(
                f"a padded prefill needs {self.rows} counts, got {list(counts)} for rows holding "
                f"{self.lengths}"
            )
        if any(self.lengths) and (self.conv or self.recurrent):
            raise ValueError("a recurrent block cannot prefill rows that already hold tokens")
        if min(counts) < 1:
            raise ValueError(f"every row of a padded prefill holds a token: {list(counts)}")
        self._counts = list(counts)

    def begin(self, new_tokens: int, device: torch.device) -> None:
        """Prepare a forward of ``new_tokens`` tokens per row (rows > 1 take one token each,
        unless :meth:`expect` announced a padded prefill of fresh rows): room for them, each
        row's position ids, index tensors for the in-place writes."""
        if self._counts is not None and max(self._counts) != new_tokens:
            raise ValueError(
                f"a padded prefill of {self._counts} tokens per row is {max(self._counts)} "
                f"wide, not {new_tokens}"
            )
        if (
            self.rows > 1
            and new_tokens != 1
            and self._counts is None
            and (self.conv or self.recurrent)
        ):
            raise ValueError(
                f"a batch of {self.rows} rows with recurrent blocks steps one token each, not "
                f"{new_tokens}"
            )
        need = max(self.lengths) + new_tokens
        if need > self.max_context:
            raise ValueError(f"{need} tokens is over max_context {self.max_context}")
        if need > self.capacity:
            self._grow(min(self.max_context, _grown(need, self.capacity)))
        self._new = new_tokens
        self._view = need
        starts = torch.tensor(self.lengths, dtype=torch.long, device=device)
        self.position_ids = starts[:, None] + torch.arange(new_tokens, device=device)[None, :]
        if self.rows > 1 and (self._counts is None or any(self.lengths)):
            # each row writes at its own positions (a padded prefill of fresh rows: all at 0)
            self._rows = torch.arange(self.rows, device=device)[:, None].expand(-1, new_tokens)
            self._cols = self.position_ids
        else:
            self._rows = self._cols = None

    def commit(self) -> None:
        """The forward ran: every row holds its new tokens (a padded prefill's rows: their
        real ones)."""
        if self._counts is not None:
            self.lengths = [n + c for n, c in zip(self.lengths, self._counts)]
        else:
            self.lengths = [n + self._new for n in self.lengths]
        self._new = 0
        self._counts = None

    # --- the prefix cache's blocks ------------------------------------------------------------

    def read_blocks(self, row: int, start: int, count: int, block: int) -> list[KVBlock]:
        """Copies of row ``row``'s keys and values for ``count`` blocks of ``block`` tokens
        from token ``start`` on (positions it holds), one :data:`KVBlock` a block."""
        if self.conv or self.recurrent:
            raise ValueError("a recurrent block's state cannot be cached by prefix blocks")
        end = start + count * block
        if end > self.lengths[row]:
            raise ValueError(f"row {row} holds {self.lengths[row]} tokens, not {end}")
        return [
            {
                layer: (
                    self.keys[layer][row, :, a : a + block].clone(),
                    self.values[layer][row, :, a : a + block].clone(),
                )
                for layer in self.keys
            }
            for a in range(start, end, block)
        ]

    def load_prefix(self, row: int, blocks: Sequence[KVBlock]) -> None:
        """Fill empty row ``row`` with cached blocks (in order from token 0): it then holds
        their tokens, and its prefill computes only the rest of its prompt."""
        if self.lengths[row]:
            raise ValueError(f"row {row} already holds {self.lengths[row]} tokens")
        if self.conv or self.recurrent:
            raise ValueError("a recurrent block's state cannot be cached by prefix blocks")
        if not blocks:
            return
        width = next(iter(blocks[0].values()))[0].shape[1]
        need = width * len(blocks)
        if need > self.max_context:
            raise ValueError(f"{need} cached tokens is over max_context {self.max_context}")
        if need > self.capacity:
            self._grow(min(self.max_context, _grown(need + 1, self.capacity)))
        for layer, (k, v) in blocks[0].items():
            if layer not in self.keys:  # a fresh batch: its layers come with the first block
                self.keys[layer] = k.new_zeros((self.rows, k.shape[0], self.capacity, k.shape[2]))
                self.values[layer] = v.new_zeros((self.rows, v.shape[0], self.capacity, v.shape[2]))
        for i, kv in enumerate(blocks):
            at = i * width
            for layer, (k, v) in kv.items():
                self.keys[layer][row, :, at : at + width] = k
                self.values[layer][row, :, at : at + width] = v
        self.lengths[row] = need

    def rollback(self, row: int, length: int) -> None:
        """Row ``row`` holds its first ``length`` tokens only (a speculative step's rejected
        drafts leave it): their keys and values stay where they are, hidden by the masks
        (positions past the row's length) and overwritten by the row's next tokens. Refused
        for a stage with recurrent blocks, whose state has taken the tokens in for good."""
        if self.conv or self.recurrent:
            raise ValueError(
                "a recurrent (linear-attention) block cannot take tokens back: speculative "
                "decoding is off for this model"
            )
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"row {row} holds {self.lengths[row]} tokens, not {length} or more")
        self.lengths[row] = length

    def mask(self, layer_type: str, dtype: torch.dtype) -> torch.Tensor | None:
        """The attention mask of this forward for blocks of ``layer_type``: None where nothing
        needs hiding (one row, and no window cutting in), else ``[rows, 1, new, view]``, boolean
        for SDPA and additive for eager attention."""
        if layer_type == LINEAR_ATTENTION:
            return None
        if layer_type not in ("full_attention", "sliding_attention"):
            raise NotImplementedError(
                f"layer type {layer_type!r}: batched serving knows full and sliding-window "
                "attention only"
            )
        window = self._window if layer_type == "sliding_attention" else None
        positions = self.position_ids  # [rows, new]
        single = self.rows == 1 and (window is None or self._view <= window)
        if single and (self._new == 1 or (self.lengths[0] == 0 and self._impl == "sdpa")):
            return None  # every key visible (decode), or SDPA's own causal path (first chunk)
        keys = torch.arange(self._view, device=positions.device)
        allowed = keys[None, None, :] <= positions[:, :, None]
        if window is not None:
            allowed = allowed & (keys[None, None, :] > positions[:, :, None] - window)
        allowed = allowed[:, None]
        if self._impl == "sdpa":
            return allowed
        if self._impl != "eager":
            raise NotImplementedError(
                f"attention implementation {self._impl!r}: batched serving supports sdpa and eager"
            )
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )

    def _grow(self, capacity: int) -> None:
        for store in (self.keys, self.values):
            for layer, old in store.items():
                grown = old.new_zeros((old.shape[0], old.shape[1], capacity, old.shape[3]))
                grown[:, :, : self.capacity] = old[:, :, : self.capacity]
                store[layer] = grown
        self.capacity = capacity

    # --- transformers' cache interface, as the blocks call it --------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *a, **k):
        """Write this forward's keys and values in place; the keys and values to attend to."""
        if layer_idx not in self.keys:
            shape = (self.rows, key_states.shape[1], self.capacity, key_states.shape[3])
            self.keys[layer_idx] = key_states.new_zeros(shape)
            self.values[layer_idx] = value_states.new_zeros(
                (self.rows, value_states.shape[1], self.capacity, value_states.shape[3])
            )
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self.rows == 1:
            start = self.lengths[0]
            keys[0, :, start : start + self._new] = key_states[0]
            values[0, :, start : start + self._new] = value_states[0]
        elif self._rows is None:  # a padded prefill of fresh rows: every row starts at 0
            keys[:, :, : self._new] = key_states
            values[:, :, : self._new] = value_states
        else:  # new tokens per row (one a decode step, k + 1 a verification), at its positions
            keys[self._rows, :, self._cols] = key_states.transpose(1, 2)
            values[self._rows, :, self._cols] = value_states.transpose(1, 2)
        return keys[:, :, : self._view], values[:, :, : self._view]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths)

    def is_recording_past(self, layer_idx: int | None = None) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """No intermediate recurrent states (transformers >= 5.25 asks): a recurrent row never
        drafts, so it never rolls back inside a step."""
        return 0

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """transformers >= 5.25 counts a fused one-token conv update here; the rows' lengths
        are kept by ``begin``/``commit``, so there is nothing to count."""

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.conv.get(layer_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.recurrent.get(layer_idx)

    def update_conv_state(
        self,
        conv_states: torch.Tensor,
        layer_idx: int,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """Keep the last ``conv_kernel_size`` inputs; the inputs the causal conv must see (the
        kept ones before the new ones; zeros before a session's first token)."""
        if self._counts is not None and len(set(self._counts)) > 1:
            raise ValueError(
                f"a recurrent block cannot prefill rows of {self._counts} tokens padded to one "
                "width (the padding would enter its state)"
            )
        state = self.conv.get(layer_idx)
        if state is None:
            kernel = conv_states.shape[-1] if conv_kernel_size is None else conv_kernel_size
            self.conv_kernel[layer_idx] = kernel
            full = conv_states
            if full.shape[-1] < kernel:
                full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0), value=0)
            self.conv[layer_idx] = full[..., -kernel:].clone()
            return full
        full = torch.cat([state, conv_states], dim=-1)
        state.copy_(full[..., -self.conv_kernel[layer_idx] :])
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs
    ) -> torch.Tensor:
        if isinstance(recurrent_states, (list, tuple)):
            # transformers >= 5.25 passes the intermediate states it was asked to keep; with
            # none kept (get_recurrent_states_to_keep) a list holds the last one only
            recurrent_states = recurrent_states[-1]
        state = self.recurrent.get(layer_idx)
        if state is None:
            self.recurrent[layer_idx] = state = recurrent_states.clone()
        else:
            state.copy_(recurrent_states)
        return state


def _grown(need: int, capacity: int) -> int:
    """Capacity for ``need`` tokens: doubling, in steps of at least GROW_TOKENS."""
    grown = max(GROW_TOKENS, capacity)
    while grown < need:
        grown *= 2
    return grown


class PrefixStore:
    """A stage's cached prompt blocks by name (``serve.decoding.prefix``), as the issuing node's index
    says: it stores, hands out and drops exactly the blocks each prefill names, so every stage
    holds the same ones. ``nbytes`` is what they take."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, KVBlock] = {}
        self.nbytes = 0

    def get(self, names: Sequence[bytes]) -> list[KVBlock]:
        """The blocks ``names`` (a prefill's reuse list), KeyError naming the first missing."""
        missing = [n for n in names if n not in self.blocks]
        if missing:
            raise KeyError(f"prefix block {missing[0].hex()} is not cached on this stage")
        return [self.blocks[n] for n in names]

    def open(self, plan, recurrent: bool) -> list[KVBlock]:
        """Carry out a new session's prefix plan (``serve.decoding.prefix.PrefixPlan``) as it
        arrives: its drops, then the blocks it reuses (KeyError naming one not held here;
        ValueError for a stage with recurrent blocks, whose state no block holds)."""
        self.drop(plan.drop)
        if recurrent and (plan.reuse or plan.keep):
            raise ValueError(
                "prefix: a recurrent (linear-attention) block's state cannot be cached by "
                "prompt blocks; serve this model with --prefix-cache-mb 0"
            )
        return self.get(plan.reuse)

    def keep(self, plan, batch: SessionBatch, row: int, block: int) -> None:
        """Store the blocks ``plan`` keeps, read from row ``row`` of ``batch`` (its prompt
        ran): they follow its reused ones."""
        start = len(plan.reuse) * block
        self.put(plan.keep, batch.read_blocks(row, start, len(plan.keep), block))

    def put(self, names: Sequence[bytes], blocks: Sequence[KVBlock]) -> None:
        for name, kv in zip(names, blocks, strict=True):
            if name not in self.blocks:
                self.blocks[name] = kv
                self.nbytes += _kv_bytes(kv)

    def drop(self, names: Sequence[bytes]) -> None:
        for name in names:
            kv = self.blocks.pop(name, None)
            if kv is not None:
                self.nbytes -= _kv_bytes(kv)

    def clear(self) -> None:
        self.blocks.clear()
        self.nbytes = 0


def _kv_bytes(kv: KVBlock) -> int:
    return sum(k.nbytes + v.nbytes for k, v in kv.values())
