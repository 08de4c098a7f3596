"""Each row's tokens so far in a ``generate`` call: on the host always, on the device only when something reads ids.

Plain ``generate`` hands its logits processors and stopping criteria the whole ``input_ids`` every step. Rebuilding
that tensor from Python lists for every committed token costs O(length) per token, O(n²) per generation. Here the
host lists are the record (output, streaming, the lookup index read them), and a preallocated device buffer
[B, prompt + max_new_tokens + block] mirrors them only when a processor that reads ids or a custom stopping
criterion is present; views into it are slices, and a round's drafts are written into the free tail of the
buffer so that "prefix + drafts[:k]" is a slice too.

Rows keep the batch's left padding (``view``, what plain batched generate shows its stopping criteria) and know
how much of it there is (``own_view``, what plain generation of the row alone shows its processors).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pad_with_last(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """1-D id tensors (each non-empty) -> [R, max length], each right-padded with its own last id."""
    width = max(x.shape[0] for x in rows)
    return torch.stack([torch.cat([x, x[-1:].expand(width - x.shape[0])]) for x in rows])


class RowTokens:
    """Left-padded prompt + committed tokens per row (host lists), optionally mirrored on the device."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, capacity: int, mirror: bool):
        self.prompt_length = input_ids.shape[1]
        self.host: list[list[int]] = input_ids.tolist()
        self.num_pad: list[int] = (attention_mask.cumsum(-1) == 0).sum(-1).tolist()
        self.lengths = [self.prompt_length] * input_ids.shape[0]
        self.device = input_ids.device
        self.buffer: torch.Tensor | None = None
        if mirror:
            self.buffer = input_ids.new_zeros(input_ids.shape[0], max(capacity, self.prompt_length))
            self.buffer[:, : self.prompt_length] = input_ids

    def __len__(self) -> int:
        return len(self.host)

    def num_generated(self, row: int) -> int:
        return self.lengths[row] - self.prompt_length

    def generated(self, row: int) -> list[int]:
        return self.host[row][self.prompt_length:]

    def append(self, row: int, tokens: Sequence[int]) -> None:
        start = self.lengths[row]
        self.host[row].extend(tokens)
        self.lengths[row] = start + len(tokens)
        if self.buffer is not None and tokens:
            self._fit(self.lengths[row])
            self.buffer[row, start:start + len(tokens)] = torch.tensor(list(tokens), dtype=self.buffer.dtype)

    def truncate(self, row: int, length: int) -> None:
        """Drop the row's tokens after its first ``length`` (the device mirror is read up to ``lengths`` only)."""
        del self.host[row][length:]
        self.lengths[row] = min(self.lengths[row], length)

    def view(self, row: int) -> torch.Tensor:
        """[length] the row as plain batched generate holds it (left padding included)."""
        if self.buffer is None:  # no mirror (nobody reads ids on the hot path): build it, O(length)
            return torch.tensor(self.host[row], dtype=torch.long, device=self.device)
        return self.buffer[row, : self.lengths[row]]

    def own_view(self, row: int) -> torch.Tensor:
        """[length - padding] the row without the batch's left padding."""
        if self.buffer is None:
            return torch.tensor(self.host[row][self.num_pad[row]:], dtype=torch.long, device=self.device)
        return self.buffer[row, self.num_pad[row]: self.lengths[row]]

    def own_view_with(self, row: int, tail: torch.Tensor) -> torch.Tensor:
        """own_view + ``tail`` [k] (this round's drafts so far), written into the buffer's free end: a slice."""
        if self.buffer is None:
            return torch.cat([self.own_view(row), tail])
        end = self.lengths[row]
        k = tail.shape[0]
        if k:
            self._fit(end + k)
            self.buffer[row, end:end + k] = tail
        return self.buffer[row, self.num_pad[row]: end + k]

    def own_ids_with(self, rows: Sequence[int], tail: torch.Tensor,
                     index_cache: dict | None = None) -> tuple[torch.Tensor, list[int]]:
        """Every row's own ids + its ``tail`` [R, k] as one [R, W] tensor, right-padded with the row's last id (a
        duplicate, which processors that read the set of ids — a repetition penalty — cannot tell from nothing),
        and the rows' true lengths. A few ops whatever R: the tails are written into the buffer in one indexed
        write, the rows gathered in one. ``index_cache``: a dict kept by the caller for calls while the rows'
        lengths stay the same (one round), so the row indices go to the device once, not per call."""
        k = tail.shape[1]
        ends = [self.lengths[r] for r in rows]
        lengths = [end + k - self.num_pad[r] for r, end in zip(rows, ends)]
        width = max(lengths)
        if self.buffer is None:
            return pad_with_last([torch.cat([self.own_view(r), tail[i]]) for i, r in enumerate(rows)]), lengths
        self._fit(max(ends) + k)
        cached = index_cache if index_cache is not None else {}
        if "rows" not in cached:
            device = self.buffer.device
            cached["rows"] = torch.tensor(rows, dtype=torch.long, device=device)
            cached["bounds"] = torch.tensor([[self.num_pad[r], end] for r, end in zip(rows, ends)], dtype=torch.long,
                                            device=device)  # [R, 2]: first own slot, first free slot
        index, bounds = cached["rows"], cached["bounds"]
        steps = torch.arange(max(width, k), device=index.device)
        if k:
            self.buffer[index[:, None], bounds[:, 1:] + steps[:k]] = tail.to(self.buffer.dtype)
        slots = torch.minimum(bounds[:, :1] + steps[:width], bounds[:, 1:] + (k - 1))
        return self.buffer.index_select(0, index).gather(1, slots), lengths

    def _fit(self, length: int) -> None:
        if length > self.buffer.shape[1]:  # only if a caller under-estimated the capacity: grow by doubling
            grown = self.buffer.new_zeros(self.buffer.shape[0], max(length, 2 * self.buffer.shape[1]))
            grown[:, : self.buffer.shape[1]] = self.buffer
            self.buffer = grown

    def sequences(self, pad_token_id: int, device: torch.device) -> torch.Tensor:
        """[B, prompt + longest generation] every row right-padded with ``pad_token_id`` (plain generate's output)."""
        width = max(self.lengths)
        return torch.tensor([row + [pad_token_id] * (width - len(row)) for row in self.host], dtype=torch.long,
                            device=device)


__all__ = ["RowTokens"]
