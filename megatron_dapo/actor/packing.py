"""Row placement for the actor's passes: data-parallel balance, token-budget micro-batches, packed (THD) layout.

Pure torch, no megatron import; deterministic (every rank computes every rank's plan from the same lengths).

    rows of a batch, lengths L_i (prompt + response tokens, `sequence_lengths`)
        --balance_rows(L, dp)--> each DP rank's rows, sums of L as equal as LPT makes them
        --micro_batch_rows(L, rows, budget | rows_per_mb, packed)--> micro-batches (lists of row ids)
        --PackedLayout.build(tokens, L, rows)--> one packed row [1, T] + cu_seqlens (qkv_format "thd")
    actor.shared_prefix instead:
        --prompt_groups (ActorBatch.group_ids) / shared_prefix_micro_batches--> micro-batches of whole groups
        --SharedPrefixLayout.build(tokens, L, P)--> one row [1, T]: per group the prompt once + one branch per row,
                                                   per-token RoPE positions, attention_mask [1, 1, T, T]

Packed layout of a micro-batch with rows r0, r1, r2 (lengths 4, 2, 3), padded to a multiple of 2 (sequence parallel):

    tokens      [a a a a b b c c c _]        cu_seqlens [0, 4, 6, 9, 10]   (the pad is its own sequence)
    position    [0 1 2 3 0 1 0 1 2 0]        max_seqlen 4
    unpack:     row r1 of [b, S_mb] = packed[4:6] then zeros; column 0 of every row is 0 (no prediction)

Cost of a micro-batch (what `max_tokens_per_microbatch` bounds): packed, the sum of its rows' lengths; padded, rows
x the longest row (the micro-batch is cut to that width).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "PackedLayout",
    "RowPlan",
    "SharedPrefixLayout",
    "balance_rows",
    "micro_batch_cost",
    "micro_batch_rows",
    "prompt_groups",
    "prompt_lengths",
    "row_lengths",
    "sequence_lengths",
    "shared_prefix_cost",
    "shared_prefix_micro_batches",
]


EMPTY_ROW_LENGTH = 2
"""Length a row without response tokens counts (a dummy row still forms a valid, empty-loss sequence)."""


def row_lengths(prompt_lengths: list[int], response_lengths: list[int]) -> list[int]:
    """Per row, prompt + response tokens (EMPTY_ROW_LENGTH without response tokens): what `sequence_lengths` gives
    for the built batch, computed before any token is sent (the trainer's RowPlan)."""
    return [p + n if n > 0 else EMPTY_ROW_LENGTH for p, n in zip(prompt_lengths, response_lengths, strict=True)]


def sequence_lengths(response_mask: Tensor) -> Tensor:
    """Tokens each row really holds: up to and including its last response token (prompt + response).

    Rows are right-padded (megatron_dapo.batch), so everything after the last response token is padding. A row
    without response tokens (a dummy row) gets length EMPTY_ROW_LENGTH (`row_lengths`).

    Args:
        response_mask: [B, S] float/bool, 1 on response tokens.
    Returns:
        [B] int64 lengths in [2, S] (S when S < 2).
    """
    b, s = response_mask.shape
    pos = torch.arange(1, s + 1, dtype=torch.int64).expand(b, s)
    last = torch.where(response_mask.bool().cpu(), pos, torch.zeros_like(pos)).amax(dim=1) if s else pos.sum(1)
    return last.clamp(min=min(EMPTY_ROW_LENGTH, s))


def balance_rows(lengths: list[int], parts: int) -> list[list[int]]:
    """Split row ids over `parts` data-parallel ranks, balancing the sum of lengths.

    Longest-processing-time greedy: rows by decreasing length (ties by id), each to the part with the smallest token
    sum so far (ties: fewer rows, then lowest part). Deterministic; every rank computes the same plan.

    Returns:
        `parts` lists of row ids, each sorted ascending (a part may be empty when there are fewer rows than parts).
    """
    if parts < 1:
        raise ValueError(f"balance_rows: parts must be >= 1, got {parts}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    load = [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in order:
        p = min(range(parts), key=lambda k: (load[k], len(out[k]), k))
        out[p].append(i)
        load[p] += lengths[i]
    return [sorted(rows) for rows in out]


@dataclass(frozen=True)
class RowPlan:
    """Which rows of a training batch each data-parallel rank holds, for both actor passes (log-probs and update).

    The batch's B rows are cut into consecutive mini-batches of `mini_batch_size` rows (the update's optimizer
    steps; the last may be smaller); each mini-batch is split over DP ranks by `balance_rows`. DP rank d holds
    `rows_of(d)`: its rows of mini-batch 0, then of mini-batch 1, ... (ascending global ids within each), and it
    runs both passes on exactly those rows, so it needs no other row's tokens. Built from lengths alone, so every
    rank (and the trainer, before any token is sent) computes the same plan.

        B = 8, mini_batch_size = 4, dp = 2:  mini-batch 0 = rows 0-3 -> dp0 {0, 3}  dp1 {1, 2}
                                             mini-batch 1 = rows 4-7 -> dp0 {5, 6}  dp1 {4, 7}
                                             rows_of(0) = [0, 3, 5, 6]; local_mini_batches(0) = [0:2, 2:4]

    Attributes:
        lengths: per global row, prompt + response tokens (`sequence_lengths`).
        parts: parts[m][d] = ascending global row ids of mini-batch m held by DP rank d.
    """

    lengths: tuple[int, ...]
    parts: tuple[tuple[tuple[int, ...], ...], ...]

    @classmethod
    def build(cls, lengths: list[int], dp_size: int, mini_batch_size: int) -> RowPlan:
        """Plan B = len(lengths) rows over `dp_size` ranks in mini-batches of `mini_batch_size` rows (>= 1)."""
        if mini_batch_size < 1:
            raise ValueError(f"RowPlan.build: mini_batch_size must be >= 1, got {mini_batch_size}")
        lengths = [int(x) for x in lengths]
        parts = []
        for start in range(0, len(lengths), mini_batch_size):
            chunk = lengths[start : start + mini_batch_size]
            parts.append(tuple(tuple(start + i for i in rows) for rows in balance_rows(chunk, dp_size)))
        return cls(lengths=tuple(lengths), parts=tuple(parts))

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    @property
    def dp_size(self) -> int:
        return len(self.parts[0]) if self.parts else 1

    def rows_of(self, dp_rank: int) -> list[int]:
        """Global row ids DP rank `dp_rank` holds, in its local order."""
        return [r for mini in self.parts for r in mini[dp_rank]]

    def local_mini_batches(self, dp_rank: int) -> list[slice]:
        """Per mini-batch, the slice of this rank's local rows (`rows_of(dp_rank)`) that belongs to it."""
        out, start = [], 0
        for mini in self.parts:
            out.append(slice(start, start + len(mini[dp_rank])))
            start += len(mini[dp_rank])
        return out

    def tokens_of(self, dp_rank: int) -> int:
        """Sum of the lengths of `rows_of(dp_rank)` (the balance the plan achieves)."""
        return sum(self.lengths[r] for r in self.rows_of(dp_rank))


def micro_batch_cost(lengths: list[int], rows: list[int], packed: bool) -> int:
    """Tokens a micro-batch computes: the sum of lengths (packed) or rows x the longest (padded)."""
    if not rows:
        return 0
    return sum(lengths[i] for i in rows) if packed else len(rows) * max(lengths[i] for i in rows)


def micro_batch_rows(
    lengths: list[int], rows: list[int], *, max_tokens: int = 0, rows_per_micro_batch: int = 1, packed: bool = True
) -> list[list[int]]:
    """Cut one rank's rows into micro-batches.

    max_tokens > 0 (token budget): first-fit decreasing by length; a row joins the first micro-batch whose cost
    (`micro_batch_cost`) stays <= max_tokens with it, else opens a new one (a row longer than the budget is a
    micro-batch alone). max_tokens == 0: rows by decreasing length in chunks of `rows_per_micro_batch` (similar
    lengths together, so padded micro-batches waste little).

    Returns:
        non-empty lists of row ids (each sorted by decreasing length, ties by id), in a deterministic order; [] when
        `rows` is empty.
    """
    order = sorted(rows, key=lambda i: (-lengths[i], i))
    if max_tokens <= 0:
        size = max(1, rows_per_micro_batch)
        return [order[k : k + size] for k in range(0, len(order), size)]
    bins: list[list[int]] = []
    for i in order:
        for b in bins:
            if micro_batch_cost(lengths, [*b, i], packed) <= max_tokens:
                b.append(i)
                break
        else:
            bins.append([i])
    return bins


class _PackedRow:
    """What both packed layouts share: `tokens` [1, T], `index` / `valid` [b, S_mb] and the gather back to rows."""

    tokens: Tensor
    index: Tensor
    valid: Tensor

    @property
    def num_tokens(self) -> int:
        """T, the packed length (real tokens plus the alignment pad)."""
        return int(self.tokens.shape[1])

    def to(self, device: torch.device | str):
        """A copy with every tensor field on `device` (other fields unchanged)."""
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return dataclasses.replace(self, **{k: v.to(device) for k, v in moved.items() if isinstance(v, Tensor)})

    def unpack(self, values: Tensor) -> Tensor:
        """Packed per-token values [1, T] (aligned with `tokens`: position q predicted from q - 1) -> [b, S_mb], 0
        wherever `valid` is False (column 0 of every row, past each row's length, and wherever the prediction would
        come from another sequence or branch). Differentiable (a gather)."""
        flat = values.reshape(-1)
        return torch.where(self.valid, flat[self.index], flat.new_zeros(()))


@dataclass
class PackedLayout(_PackedRow):
    """One micro-batch packed into a single row (Megatron `PackedSeqParams(qkv_format="thd")`).

    Attributes:
        tokens: [1, T] int64, the rows' real tokens back to back, then `T - cu_seqlens[n]` pad tokens (id 0).
        position_ids: [1, T] int64, position within its own sequence (RoPE restarts per sequence).
        cu_seqlens: [n + 1 (+1 with padding)] int32, sequence boundaries; a trailing pad forms its own sequence.
        max_seqlen: longest sequence in the pack.
        index: [b, S_mb] int64, packed position of (row, column) (0 where invalid).
        valid: [b, S_mb] bool, column 1 <= j < length of the row: positions whose prediction is inside the row.
    """

    tokens: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor
    max_seqlen: int
    index: Tensor
    valid: Tensor

    @classmethod
    def build(cls, tokens: Tensor, lengths: Tensor, multiple: int = 1) -> PackedLayout:
        """Pack the rows of `tokens` [b, S_mb] (int64) with `lengths` [b] (int64, <= S_mb); the packed length is
        rounded up to `multiple` (tensor-parallel size under sequence parallel)."""
        b, s = tokens.shape
        lengths = lengths.to(torch.int64).cpu()
        starts = torch.cumsum(lengths, 0) - lengths
        total = int(lengths.sum())
        padded = -(-total // multiple) * multiple
        seqlens = lengths.tolist() + ([padded - total] if padded > total else [])
        cu = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(seqlens, dtype=torch.int64), 0).to(torch.int32)
        cols = torch.arange(s, dtype=torch.int64).expand(b, s)
        inside = cols < lengths.unsqueeze(1)
        index = torch.where(inside, starts.unsqueeze(1) + cols, torch.zeros_like(cols))
        packed = torch.zeros(padded, dtype=torch.int64)
        packed[index[inside]] = tokens.cpu()[inside]
        position = torch.cat([torch.arange(n, dtype=torch.int64) for n in seqlens]) if seqlens else packed
        return cls(
            tokens=packed.unsqueeze(0),
            position_ids=position.unsqueeze(0),
            cu_seqlens=cu,
            max_seqlen=max(seqlens) if seqlens else 0,
            index=index,
            valid=inside & (cols >= 1),
        )


# ---------------------------------------------------------------------------------------------------------------
# shared prompt prefix (actor.shared_prefix)
# ---------------------------------------------------------------------------------------------------------------
def prompt_lengths(response_mask: Tensor, lengths: Tensor | list[int]) -> list[int]:
    """Per row, P = the column of its first response token (its prompt is tokens[:P]); a row without response tokens
    counts as all prompt (P = its length). Clamped to [1, length]: column 0 is never predicted.

    Args:
        response_mask: [B, S] float/bool, 1 on response tokens.
        lengths: [B] the rows' `sequence_lengths`.
    Returns:
        B ints.
    """
    mask = response_mask.bool().cpu()
    has = mask.any(dim=1).tolist()
    first = mask.to(torch.int8).argmax(dim=1).tolist()
    out = []
    for f, h, n in zip(first, has, [int(x) for x in lengths], strict=True):
        out.append(min(max(f if h else n, 1), n))
    return out


def prompt_groups(group_ids: Tensor, rows: list[int]) -> list[list[int]]:
    """`rows` grouped by group id (the responses of one prompt), groups in order of first appearance.

    Args:
        group_ids: [B] int64, ActorBatch.group_ids (rows of one prompt group share an id and their prompt).
        rows: the row ids to group.
    Returns:
        lists of row ids (each in the order of `rows`) covering `rows` exactly once.
    """
    ids = group_ids.tolist()
    found: dict[int, list[int]] = {}
    for r in rows:
        found.setdefault(ids[r], []).append(r)
    return list(found.values())


def shared_prefix_cost(lengths: list[int], prompts: list[int], rows: list[int]) -> int:
    """Tokens a set of rows with one prompt computes in `SharedPrefixLayout`: the prefix (P - 1 tokens) once, plus
    per row its branch (the last prompt token and the response: length - P + 1)."""
    if not rows:
        return 0
    return prompts[rows[0]] - 1 + sum(lengths[r] - prompts[r] + 1 for r in rows)


def shared_prefix_micro_batches(
    lengths: list[int],
    prompts: list[int],
    groups: list[list[int]],
    *,
    max_tokens: int = 0,
    rows_per_micro_batch: int = 1,
) -> list[list[int]]:
    """Cut one rank's rows into micro-batches that keep each prompt group together, so it can share its prefix.

    Budget per micro-batch: max_tokens > 0, its `shared_prefix_cost` summed over the groups in it; else
    `rows_per_micro_batch` rows. A group over the budget alone is first split into chunks (rows by decreasing
    length, a chunk closes when the next row would exceed the budget; each chunk then computes its own copy of the
    prefix; a row over the budget alone is a chunk alone). Groups and chunks are then binned first-fit decreasing
    by cost. Sharing happens only among the rows one data-parallel rank holds: RowPlan balances rows by length over
    DP and may put rows of one group on different ranks, which stays exact and just shares less.

    Args:
        lengths, prompts: per row of the rank, `sequence_lengths` and `prompt_lengths`.
        groups: `prompt_groups` of the rank's rows.
    Returns:
        non-empty lists of row ids, deterministic; [] when there are no rows.
    """
    by_rows = max_tokens <= 0
    budget = max(1, rows_per_micro_batch) if by_rows else max_tokens

    def cost(rows: list[int]) -> int:
        return len(rows) if by_rows else shared_prefix_cost(lengths, prompts, rows)

    items: list[list[int]] = []
    for group in groups:
        order = sorted(group, key=lambda i: (-lengths[i], i))
        chunk: list[int] = []
        for r in order:
            if chunk and cost([*chunk, r]) > budget:
                items.append(chunk)
                chunk = []
            chunk.append(r)
        if chunk:
            items.append(chunk)
    items.sort(key=lambda c: (-cost(c), c[0]))
    bins: list[list[list[int]]] = []
    loads: list[int] = []
    for item in items:
        c = cost(item)
        for k, b in enumerate(bins):
            if loads[k] + c <= budget:
                b.append(item)
                loads[k] += c
                break
        else:
            bins.append([item])
            loads.append(c)
    return [[r for item in b for r in item] for b in bins]


@dataclass
class SharedPrefixLayout(_PackedRow):
    """One micro-batch packed into a single row with each prompt computed once (actor.shared_prefix).

    Rows with the same prompt (P tokens) form a group, packed as the prefix prompt[:P-1] followed by one branch per
    row, [prompt[P-1], response...]. Duplicating the last prompt token into every branch keeps the packed convention
    of `PackedLayout`: the value at packed position q is the prediction of token q from q - 1, and every response
    token's predecessor lies in its own branch. Groups follow each other, then the alignment pad.

        rows r0, r1 with prompt [a b c] and responses [x y], [z]; row r2 alone with prompt [d e], response [w]:
        tokens     [a b | c x y | c z | d | e w | _]
        position   [0 1 | 2 3 4 | 2 3 | 0 | 1 2 | 0]      (prefix 0..P-2, each branch P-1, P, ...)
        r0 -> packed [0, 1, 2, 3, 4]; r1 -> [0, 1, 5, 6]; valid False at column 0 and at column P - 1 (its packed
        predecessor is not the row's), so the prompt's last token gets no value (response_mask is 0 there anyway).

    Attention (`attention_mask`): a prefix token sees the prefix causally; a branch token sees the whole prefix of
    its group and its own branch causally; nothing crosses groups. Positions feed RoPE per token (the micro-batch
    runs as one BSHD row, not THD, whose RoPE restarts per sequence and cannot take offsets).

    Attributes:
        tokens: [1, T] int64 packed tokens (pad id 0).
        position_ids: [1, T] int64 RoPE positions.
        segment: [T] int64, group id per packed token (the pad is its own segment).
        branch: [T] int64, -1 on prefix and pad tokens, else the branch id (unique over the micro-batch).
        index: [b, S_mb] int64, packed position of (row, column) (0 where invalid).
        valid: [b, S_mb] bool.
        num_real: packed tokens without the alignment pad.
    """

    tokens: Tensor
    position_ids: Tensor
    segment: Tensor
    branch: Tensor
    index: Tensor
    valid: Tensor
    num_real: int

    @classmethod
    def build(
        cls, tokens: Tensor, lengths: Tensor, prompts: list[int], group_ids: Tensor, multiple: int = 1
    ) -> SharedPrefixLayout:
        """Lay out the rows of `tokens` [b, S_mb] (int64) with `lengths` [b] (<= S_mb), prompt lengths `prompts`
        (b ints) and `group_ids` [b] (rows of one id share their prompt, computed once). The packed length is
        rounded up to `multiple`."""
        b, s = tokens.shape
        cpu = tokens.cpu()
        lens = [int(x) for x in lengths]
        if len(prompts) != b or any(not 1 <= p <= n for p, n in zip(prompts, lens, strict=True)):
            raise ValueError(f"SharedPrefixLayout.build: prompts {prompts} must be b={b} ints in [1, length {lens}]")
        packed: list[Tensor] = []
        pos: list[Tensor] = []
        seg: list[int] = []
        br: list[int] = []
        index = torch.zeros(b, s, dtype=torch.int64)
        start = 0
        for gid, group in enumerate(prompt_groups(group_ids, list(range(b)))):
            p = prompts[group[0]]
            prefix = start
            packed.append(cpu[group[0], : p - 1])
            pos.append(torch.arange(p - 1, dtype=torch.int64))
            seg += [gid] * (p - 1)
            br += [-1] * (p - 1)
            start += p - 1
            for r in group:
                n = lens[r] - p + 1
                packed.append(cpu[r, p - 1 : lens[r]])
                pos.append(torch.arange(p - 1, lens[r], dtype=torch.int64))
                seg += [gid] * n
                br += [r] * n
                index[r, : p - 1] = torch.arange(prefix, prefix + p - 1)
                index[r, p - 1 : lens[r]] = torch.arange(start, start + n)
                start += n
        total = start
        padded = -(-total // multiple) * multiple
        if padded > total:
            packed.append(torch.zeros(padded - total, dtype=torch.int64))
            pos.append(torch.zeros(padded - total, dtype=torch.int64))
            seg += [len(set(seg))] * (padded - total)
            br += [-1] * (padded - total)
        cols = torch.arange(s, dtype=torch.int64).expand(b, s)
        lens_t = torch.tensor(lens, dtype=torch.int64).unsqueeze(1)
        last_prompt = torch.tensor(prompts, dtype=torch.int64).unsqueeze(1) - 1
        valid = (cols >= 1) & (cols < lens_t) & (cols != last_prompt)
        return cls(
            tokens=torch.cat(packed).unsqueeze(0) if packed else torch.zeros(1, 0, dtype=torch.int64),
            position_ids=torch.cat(pos).unsqueeze(0) if pos else torch.zeros(1, 0, dtype=torch.int64),
            segment=torch.tensor(seg, dtype=torch.int64),
            branch=torch.tensor(br, dtype=torch.int64),
            index=torch.where(valid | (cols < lens_t), index, torch.zeros_like(index)),
            valid=valid,
            num_real=total,
        )

    def attention_mask(self) -> Tensor:
        """[1, 1, T, T] bool, True = masked out (megatron's convention): query q may see key k iff same segment,
        k <= q, and k is a prefix token or in q's branch."""
        q = torch.arange(self.num_tokens, device=self.segment.device)
        same = self.segment.unsqueeze(1) == self.segment.unsqueeze(0)
        causal = q.unsqueeze(1) >= q.unsqueeze(0)
        branch_ok = (self.branch.unsqueeze(0) < 0) | (self.branch.unsqueeze(1) == self.branch.unsqueeze(0))
        return ~(same & causal & branch_ok).view(1, 1, self.num_tokens, self.num_tokens)
