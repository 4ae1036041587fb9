"""The per-step metadata object: everything a model runner needs for one forward pass.

The scheduler emits one ``StepMetadata`` per step. Sequences are ordered decodes first
(query length 1), then prefills and prefill chunks, and all tokens of the step are
flattened into one ragged batch of ``num_tokens`` rows::

    rows:  | seq 0 | seq 1 | ... | seq B-1 |
           ^query_start_loc[0]=0         ^query_start_loc[B]=num_tokens

For sequence ``i`` the new tokens sit at positions
``[num_computed_tokens[i], seq_lens[i])`` and attend causally to positions ``[0, seq_lens[i])``.
Built with numpy: no Python loop runs per token.

Rows that need logits (``logits_indices``), for a sequence of ``P`` prompt tokens::

    positions:  0   1   ...   P-2 | P-1        | P ...
    logits:     prompt rows       | sampled row | sampled rows (decodes)
    predict:    token 1 ... P-1   | 1st output  | next outputs

Sampled rows come first (``S`` of them, in ``sample_seq_indices`` order). Prompt rows
follow (``R``), only for requests asking ``prompt_logprobs`` and only while their prompt
is being computed; each chunk contributes the rows of its own positions.
"""
from __future__ import annotations

import dataclasses
import itertools
import operator
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from kvpage.core.request import Request


@dataclass(slots=True)
class StepMetadata:
    """Flat arrays for one step. Shapes: T = num_tokens, B = num_seqs, S = rows sampled,
    R = prompt rows (rows whose logits give prompt-token log-probabilities).

    Attributes:
        input_ids: int64 [T] token ids to feed.
        positions: int64 [T] absolute position of each token in its sequence.
        slot_mapping: int64 [T] flat KV slot (``block_id * block_size + offset``) each
            token's K/V is written to.
        query_start_loc: int32 [B + 1] cumulative query lengths (cu_seqlens_q).
        seq_lens: int32 [B] context length of each sequence after this step (tokens).
        num_computed_tokens: int32 [B] context already in the cache before this step.
        block_tables: int32 [B, max_blocks] block ids per sequence; entries past
            ``ceil(seq_lens[i] / block_size)`` are padding (0) and must not be read.
        logits_indices: int64 [S + R] rows of the flat batch whose logits the runner returns,
            in this order: first the S sampled rows (the last row of every sequence that
            reaches its end this step), then the R prompt rows.
        sample_seq_indices: int64 [S] the sequence each sampled row belongs to.
        prompt_logits_seq_indices: int64 [R] the sequence each prompt row belongs to.
        prompt_logits_token_ids: int64 [R] the prompt token each prompt row's logits predict
            (the token at the row's position + 1).
        block_copies: int64 [K, 2] (src, dst) block copies (copy-on-write) to perform
            before this step's KV writes.
        block_size: tokens per block.
        num_decodes: the first ``num_decodes`` sequences have query length 1.
        request_ids: [B] request id of each sequence.
        state_slots: int64 [B] each sequence's recurrent-state slot (``state_slots``), or
            -1 (an attention-only model).
        state_copies: int64 [C, 2] (src, dst) state-slot copies (forks) to perform, in
            order, before this step's forward.
        group_block_tables, group_slot_mappings: with several KV groups (a hybrid model),
            the block tables and slot mappings of groups 1.. (group 0's are
            ``block_tables`` and ``slot_mapping``). In a sliding-window group, the entries
            of blocks behind the window are padding (0) as well; kernels never read them.
        prompt_lens: int64 [B] each sequence's prompt length (tokens before its first
            output), for computations that depend on it (the sparse-attention indexer's
            score rows are as long as HF's: the prompt for prompt tokens).
    """

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    num_computed_tokens: np.ndarray
    block_tables: np.ndarray
    logits_indices: np.ndarray
    sample_seq_indices: np.ndarray
    block_copies: np.ndarray
    block_size: int
    num_decodes: int
    request_ids: list = field(default_factory=list)
    prompt_logits_seq_indices: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    prompt_logits_token_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    group_block_tables: tuple = ()
    group_slot_mappings: tuple = ()
    state_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    state_copies: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), dtype=np.int64))
    prompt_lens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def num_groups(self) -> int:
        return 1 + len(self.group_block_tables)

    def for_group(self, group: int) -> "StepMetadata":
        """This step as KV group ``group``'s layers see it: its block tables and slot mapping."""
        if group == 0:
            return self
        return dataclasses.replace(self, block_tables=self.group_block_tables[group - 1],
                                   slot_mapping=self.group_slot_mappings[group - 1],
                                   group_block_tables=(), group_slot_mappings=())

    def select(self, seqs: np.ndarray) -> tuple["StepMetadata", np.ndarray]:
        """The step restricted to sequences ``seqs`` (ascending), and the step's rows they
        cover, in order. The part's ``logits_indices`` are all its rows; it owes no block
        or state copies (the whole step performs those once)."""
        seqs = np.asarray(seqs, dtype=np.int64)
        starts = self.query_start_loc[seqs].astype(np.int64)
        lens = self.query_start_loc[seqs + 1].astype(np.int64) - starts
        qsl = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(lens, out=qsl[1:])
        rows = np.repeat(starts - qsl[:-1], lens) + np.arange(int(qsl[-1]))
        part = dataclasses.replace(
            self, input_ids=self.input_ids[rows], positions=self.positions[rows],
            slot_mapping=self.slot_mapping[rows], query_start_loc=qsl.astype(np.int32),
            seq_lens=self.seq_lens[seqs], num_computed_tokens=self.num_computed_tokens[seqs],
            block_tables=self.block_tables[seqs], logits_indices=np.arange(len(rows), dtype=np.int64),
            sample_seq_indices=np.zeros(0, dtype=np.int64), block_copies=np.zeros((0, 2), dtype=np.int64),
            num_decodes=leading_decodes(lens), request_ids=[self.request_ids[i] for i in seqs.tolist()],
            prompt_logits_seq_indices=np.zeros(0, dtype=np.int64),
            prompt_logits_token_ids=np.zeros(0, dtype=np.int64),
            group_block_tables=tuple(t[seqs] for t in self.group_block_tables),
            group_slot_mappings=tuple(m[rows] for m in self.group_slot_mappings),
            state_slots=self.state_slots[seqs] if len(self.state_slots) else self.state_slots,
            state_copies=np.zeros((0, 2), dtype=np.int64),
            prompt_lens=self.prompt_lens[seqs] if len(self.prompt_lens) else self.prompt_lens)
        return part, rows

    @property
    def num_sampled_rows(self) -> int:
        """S: the leading rows of the runner's logits, one per ``sample_seq_indices`` entry."""
        return int(self.sample_seq_indices.shape[0])

    @property
    def num_prompt_logits_rows(self) -> int:
        """R: the trailing rows of the runner's logits, for prompt log-probabilities."""
        return int(self.prompt_logits_seq_indices.shape[0])

    @property
    def prompt_logits_positions(self) -> np.ndarray:
        """int64 [R] the prompt position of each prompt row's target token."""
        return self.positions[self.logits_indices[self.num_sampled_rows:]] + 1

    @property
    def num_tokens(self) -> int:
        """T: the step's tokens, over all sequences."""
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        """N: the step's sequences."""
        return int(self.seq_lens.shape[0])

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)

    # The one definition of each size that attention backends read (tokens).
    @property
    def max_query_len(self) -> int:
        """Longest query of any sequence in the step."""
        return _max_or_zero(self.query_lens)

    @property
    def max_prefill_query_len(self) -> int:
        """Longest query among the sequences after the leading decodes (0 if none)."""
        return _max_or_zero(self.query_lens[self.num_decodes:])

    @property
    def max_seq_len(self) -> int:
        """Longest context (after this step) of any sequence."""
        return _max_or_zero(self.seq_lens)

    @property
    def max_decode_seq_len(self) -> int:
        """Longest context among the leading decodes (0 if none)."""
        return _max_or_zero(self.seq_lens[: self.num_decodes])

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes


def build_step_metadata(
    requests: Sequence[Request],
    num_new_tokens: Sequence[int],
    block_size: int,
    block_copies: Sequence[tuple[int, int]] = (),
    num_groups: int = 1,
    state_copies: Sequence[tuple[int, int]] = (),
) -> StepMetadata:
    """Flatten the scheduled ``requests`` (each feeding ``num_new_tokens[i]`` tokens), with
    the block tables of ``num_groups`` KV groups.

    ``requests[i].num_computed_tokens`` must still be the value *before* this step, and
    its block table must already cover ``num_computed_tokens + num_new_tokens[i]`` slots;
    otherwise (or for a count below 1) this raises ``ValueError``.
    """
    num_seqs = len(requests)
    query_lens = np.asarray(num_new_tokens, dtype=np.int64).reshape(num_seqs)
    computed = _per_seq(requests, "num_computed_tokens")
    seq_lens = computed + query_lens
    covered = np.fromiter((len(r.block_tables[0]) for r in requests), dtype=np.int64, count=num_seqs) * block_size
    short = (query_lens < 1) | (covered < seq_lens)
    if short.any():
        bad = int(np.flatnonzero(short)[0])
        raise ValueError(f"request {requests[bad].request_id!r}: {int(query_lens[bad])} new tokens after "
                         f"{int(computed[bad])} need at least one token and slots for {int(seq_lens[bad])} tokens; "
                         f"its blocks hold {int(covered[bad])} (allocate_slots first)")
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
    num_tokens = int(query_start_loc[-1])
    positions = np.arange(num_tokens, dtype=np.int64) - query_start_loc[seq_of_token] + computed[seq_of_token]
    tables, slots = _tables_and_slots(requests, num_groups, seq_of_token, positions, block_size)
    samples = np.flatnonzero(seq_lens == _per_seq(requests, "num_tokens"))
    prompt_rows, prompt_seqs, prompt_targets = _prompt_logit_rows(requests, computed, seq_lens, query_start_loc)
    return StepMetadata(
        input_ids=_input_ids(requests, computed, query_lens, num_tokens),
        positions=positions,
        slot_mapping=slots[0],
        query_start_loc=query_start_loc.astype(np.int32),
        seq_lens=seq_lens.astype(np.int32),
        num_computed_tokens=computed.astype(np.int32),
        block_tables=tables[0],
        logits_indices=np.concatenate([query_start_loc[samples + 1] - 1, prompt_rows]),
        sample_seq_indices=samples,
        block_copies=np.asarray(block_copies, dtype=np.int64).reshape(-1, 2),
        block_size=block_size,
        num_decodes=leading_decodes(query_lens),
        request_ids=[r.request_id for r in requests],
        prompt_logits_seq_indices=prompt_seqs,
        prompt_logits_token_ids=prompt_targets,
        group_block_tables=tuple(tables[1:]),
        group_slot_mappings=tuple(slots[1:]),
        state_slots=np.fromiter((-1 if r.state_slot is None else r.state_slot for r in requests), dtype=np.int64,
                                count=num_seqs),
        state_copies=np.asarray(state_copies, dtype=np.int64).reshape(-1, 2),
        prompt_lens=_per_seq(requests, "num_prompt_tokens"),
    )


def _per_seq(requests: Sequence[Request], attribute: str) -> np.ndarray:
    """int64 [B] one integer attribute of every request (a property such as ``num_tokens`` too)."""
    get = operator.attrgetter(attribute)
    return np.fromiter(map(get, requests), dtype=np.int64, count=len(requests))


def _input_ids(requests: Sequence[Request], computed: np.ndarray, query_lens: np.ndarray,
               num_tokens: int) -> np.ndarray:
    """int64 [T] the tokens each sequence feeds: ``all_token_ids[computed : computed + n]``."""
    ids: list[int] = []
    # A decode contributes one int (no slice object), a prefill one slice: per sequence, not per token.
    for r, c, n in zip(requests, computed.tolist(), query_lens.tolist()):
        if n == 1:
            ids.append(r.all_token_ids[c])
        else:
            ids += r.all_token_ids[c : c + n]
    return np.array(ids, dtype=np.int64).reshape(num_tokens)


def _tables_and_slots(requests: Sequence[Request], num_groups: int, seq_of_token: np.ndarray,
                      positions: np.ndarray, block_size: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per KV group: int32 [B, max_blocks] block tables and int64 [T] slot mapping
    (``block_id * block_size + offset`` of each token's position)."""
    block_of_token, offset_of_token = positions // block_size, positions % block_size
    tables, slots = [], []
    for group in range(num_groups):
        table = _padded_block_tables(requests, group)
        tables.append(table)
        slots.append(table[seq_of_token, block_of_token].astype(np.int64) * block_size + offset_of_token)
    return tables, slots


def _padded_block_tables(requests: Sequence[Request], group: int = 0) -> np.ndarray:
    """int32 [B, max_blocks] block ids of KV group ``group``, zero-padded: per-block work only
    (never per token)."""
    num_seqs = len(requests)
    blocks_per_seq = np.fromiter((len(r.block_tables[group]) for r in requests), dtype=np.int64, count=num_seqs)
    max_blocks = int(blocks_per_seq.max()) if num_seqs else 0
    block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
    flat_blocks = np.fromiter(
        itertools.chain.from_iterable(r.block_tables[group] for r in requests), dtype=np.int32,
        count=int(blocks_per_seq.sum())
    )
    block_tables[np.arange(max_blocks) < blocks_per_seq[:, None]] = flat_blocks
    return block_tables


def _prompt_logit_rows(requests: Sequence[Request], computed: np.ndarray, seq_lens: np.ndarray,
                       query_start_loc: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(flat rows, sequence, target token) of every prompt row of the step (see the module doc).

    Sequence ``i`` asking prompt log-probabilities, before its first output token, feeds
    positions ``[computed[i], seq_lens[i])``; those below ``P - 1`` predict a prompt token.
    """
    rows, seqs, targets = [], [], []
    for i, request in enumerate(requests):
        if request.sampling_params.prompt_logprobs is None or request.num_output_tokens:
            continue
        start, stop = int(computed[i]), min(int(seq_lens[i]), request.num_prompt_tokens - 1)
        if stop > start:
            rows.append(np.arange(stop - start, dtype=np.int64) + int(query_start_loc[i]))
            seqs.append(np.full(stop - start, i, dtype=np.int64))
            targets.append(np.asarray(request.all_token_ids[start + 1 : stop + 1], dtype=np.int64))
    if not rows:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    return np.concatenate(rows), np.concatenate(seqs), np.concatenate(targets)


def _max_or_zero(values: np.ndarray) -> int:
    """The largest of ``values``, 0 when there are none."""
    return int(values.max()) if values.size else 0


def leading_decodes(query_lens: np.ndarray) -> int:
    """Length of the leading run of query-length-1 sequences (decodes come first).

    A length-1 prefill chunk after the first longer query is not a decode: backends run
    only this leading run on their decode path. The one place this is computed.
    """
    longer = np.flatnonzero(query_lens != 1)
    return int(longer[0]) if longer.size else int(query_lens.shape[0])
