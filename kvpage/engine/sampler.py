"""The torch sampler: turns logits into tokens, honouring each request's SamplingParams.

Implements ``kvpage.engine.interfaces.Sampler``. Greedy rows take one batched argmax. Sampled
rows get temperature, top-k, top-p and min-p applied as batched tensor ops; a seeded
request draws from a generator seeded by (its seed, its output position), so its samples
depend on nothing else in the batch and the sampler keeps no per-request state.
Until a request has ``min_tokens`` output tokens, its EOS ids (the request's and the
model's, even with ``ignore_eos``) and ``stop_token_ids`` cannot be drawn: their logits are
set to -inf for greedy and sampled rows alike, in one scatter for the batch (vLLM's
``min_tokens``; HF's ``min_new_tokens`` does the same for EOS).
Log-probabilities are of the model's raw distribution (before penalties and filters),
for generated tokens (``logprobs``) and for prompt tokens (``prompt_logprobs``).
A request with ``n > 1`` at its first token also gets its other samples' first tokens
(``SampleResult.forks``), drawn from the same row with each sample's own seed.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from kvpage.kernels import native_cpu
from kvpage.core.request import Request
from kvpage.engine.interfaces import SampleResult
from kvpage.engine.outputs import PromptTokenLogprob

_LOGIT_LIMIT = 1e30  # finite in float32 with room for the softmax's max-subtraction
_SEED_STRIDE = 0x9E3779B1  # spreads (seed, position) pairs over the generator's seed space


class Sampler:
    """``eos_token_ids``: the model's EOS ids, all masked under ``min_tokens`` (a request's
    own ``eos_token_id`` always is)."""

    def __init__(self, seed: int = 0, eos_token_ids: Sequence[int] = ()) -> None:
        self._global = torch.Generator().manual_seed(seed)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)

    @staticmethod
    def _generator(seed: int, position: int) -> torch.Generator:
        return torch.Generator().manual_seed((int(seed) * _SEED_STRIDE + position) & 0xFFFF_FFFF_FFFF)

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> SampleResult:
        """``logits`` is float32 ``[S, V]``; row i belongs to ``requests[i]``."""
        logits = logits.float().cpu()
        invalid, greedy_tokens = _check_rows(logits)
        if invalid:
            logits = torch.nan_to_num(logits)  # drawn, then ignored: the engine fails these rows
        result = self._draw(logits, requests, [r.num_output_tokens for r in requests],
                            greedy_tokens=None if invalid else greedy_tokens)
        result.invalid_rows = invalid
        for row, request in enumerate(requests):
            n = request.sampling_params.n
            if n > 1 and request.num_output_tokens == 0 and row not in invalid:
                children = [request.sampling_params.for_sample(k) for k in range(1, n)]
                result.forks[row] = self._draw(logits[row : row + 1].expand(n - 1, -1), [request] * (n - 1), [0] * (n - 1),
                                               children)
        return result

    def _draw(self, logits: torch.Tensor, requests: Sequence[Request], positions: Sequence[int],
              params_list: Optional[list] = None, greedy_tokens: Optional[torch.Tensor] = None) -> SampleResult:
        """``greedy_tokens``: ``logits``' row argmax when the caller already has it."""
        params_list = params_list or [r.sampling_params for r in requests]
        num_rows = logits.shape[0]
        tokens = torch.argmax(logits, dim=-1) if greedy_tokens is None else greedy_tokens
        sampled_rows = [i for i, p in enumerate(params_list) if not p.greedy]
        adjusted = self._mask_stops_before_min_tokens(self._apply_penalties(logits, requests, params_list), logits,
                                                      requests, params_list, positions)
        if sampled_rows:
            rows = torch.tensor(sampled_rows)
            probs = self._filtered_probs(adjusted[rows], [params_list[i] for i in sampled_rows])
            for j, i in enumerate(sampled_rows):
                seed = params_list[i].seed
                gen = self._global if seed is None else self._generator(seed, positions[i])
                tokens[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
        if adjusted is not logits:
            greedy = [i for i, p in enumerate(params_list) if p.greedy]
            if greedy:
                tokens[greedy] = torch.argmax(adjusted[greedy], dim=-1)
        # Log-probabilities cost a pass over the whole vocabulary: only for rows that ask.
        wanted = [i for i, p in enumerate(params_list) if p.logprobs is not None]
        token_logprobs = np.full(num_rows, np.nan)
        top: list = [None] * num_rows
        if wanted:
            index = torch.tensor(wanted)
            log_probs = torch.log_softmax(logits[index], dim=-1)
            picked = tokens[index]
            token_logprobs[wanted] = log_probs.gather(1, picked.view(-1, 1)).view(-1).double().numpy()
            for row, entry in zip(wanted, self._top_logprobs(log_probs, picked, [params_list[i] for i in wanted])):
                top[row] = entry
        return SampleResult(tokens.numpy().astype(np.int64), top, token_logprobs)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, requests: Sequence[Request], params_list: list) -> torch.Tensor:
        """``logit_bias`` (ids past the vocabulary ignored), then the repetition penalty (over
        prompt and output), then OpenAI's presence and frequency penalties (over the output):
        ``logit -= frequency * count + presence * (count > 0)``. Returns ``logits`` itself
        when no row is biased or penalised, else an adjusted copy."""
        penalised = [i for i, p in enumerate(params_list)
                     if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or p.logit_bias]
        if not penalised:
            return logits
        logits = logits.clone()
        vocab = logits.shape[1]
        for i in penalised:
            params, row = params_list[i], logits[i]
            if params.logit_bias:
                ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
                bias = torch.tensor(list(params.logit_bias.values()), dtype=row.dtype)
                inside = ids < vocab
                row[ids[inside]] += bias[inside]
            if params.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(requests[i].all_token_ids)), dtype=torch.long)
                seen = seen[seen < vocab]
                values = row[seen]
                row[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                        values * params.repetition_penalty)
            if params.presence_penalty or params.frequency_penalty:
                output = torch.tensor(requests[i].output_token_ids, dtype=torch.long)
                counts = torch.bincount(output[output < vocab], minlength=vocab).to(row.dtype)
                row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)
            # An extreme penalty must not overflow: keep the logits finite so they stay drawable.
            row.clamp_(-_LOGIT_LIMIT, _LOGIT_LIMIT)
        return logits

    def _mask_stops_before_min_tokens(self, adjusted: torch.Tensor, logits: torch.Tensor, requests: Sequence[Request],
                                      params_list: list, positions: Sequence[int]) -> torch.Tensor:
        """``adjusted`` with the EOS and stop ids of rows still short of ``min_tokens`` at -inf
        (a copy if ``adjusted`` is ``logits`` itself); the rows' ids are gathered per row, the
        logits written in one indexed assignment."""
        rows: list[int] = []
        cols: list[int] = []
        for i, (request, params, position) in enumerate(zip(requests, params_list, positions)):
            if position < params.min_tokens:
                ids = {*self.eos_token_ids, *params.stop_token_ids}
                if request.eos_token_id is not None:
                    ids.add(int(request.eos_token_id))
                rows += [i] * len(ids)
                cols += ids
        if not rows:
            return adjusted
        if adjusted is logits:
            adjusted = logits.clone()
        index_rows, index_cols = torch.tensor(rows), torch.tensor(cols)
        inside = index_cols < adjusted.shape[1]  # a stop id past the vocabulary is never drawn anyway
        adjusted[index_rows[inside], index_cols[inside]] = float("-inf")
        return adjusted

    @staticmethod
    def prompt_logprobs(logits: torch.Tensor, token_ids: np.ndarray, num_top: Sequence[int]) -> list:
        """Row ``r`` of float ``[R, V]`` ``logits`` predicts prompt token ``token_ids[r]``;
        returns one ``PromptTokenLogprob`` per row (its ``num_top[r]`` most likely tokens too),
        from the model's raw distribution (no penalties, no temperature)."""
        log_probs = torch.log_softmax(logits.float().cpu(), dim=-1)
        targets = torch.as_tensor(np.asarray(token_ids), dtype=torch.long).view(-1, 1)
        chosen = log_probs.gather(1, targets).view(-1)
        ranks = (log_probs > chosen.unsqueeze(1)).sum(dim=-1) + 1
        k = min(max(num_top, default=0), log_probs.shape[1])
        top_values, top_ids = torch.topk(log_probs, k) if k else (None, None)
        out = []
        for r, (token, logprob, rank) in enumerate(zip(targets.view(-1).tolist(), chosen.tolist(), ranks.tolist())):
            top = {} if not num_top[r] else dict(zip(top_ids[r, : num_top[r]].tolist(),
                                                     top_values[r, : num_top[r]].tolist()))
            out.append(PromptTokenLogprob(token, logprob, rank, top))
        return out

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
        temperature = torch.tensor([p.temperature for p in params]).unsqueeze(1)
        logits = logits / temperature
        vocab = logits.shape[1]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params]).clamp(max=vocab)
        top_p = torch.tensor([p.top_p for p in params]).unsqueeze(1)
        min_p = torch.tensor([p.min_p for p in params]).unsqueeze(1)
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        rank = torch.arange(vocab).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(rank >= top_k.unsqueeze(1), float("-inf"))
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Nucleus: keep the smallest prefix whose mass reaches top_p (always the top token).
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = mass_before >= top_p
        drop |= sorted_probs < min_p * sorted_probs[:, :1]
        drop[:, 0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
        return probs / probs.sum(dim=-1, keepdim=True)

    @staticmethod
    def _top_logprobs(log_probs: torch.Tensor, tokens: torch.Tensor, params_list: list) -> list:
        out: list[Optional[dict]] = [None] * len(params_list)
        for i, params in enumerate(params_list):
            k = params.logprobs
            if k is None:
                continue
            entry = {int(tokens[i]): float(log_probs[i, tokens[i]])}
            if k > 0:
                values, ids = torch.topk(log_probs[i], min(k, log_probs.shape[1]))
                entry.update({int(t): float(v) for t, v in zip(ids.tolist(), values.tolist())})
            out[i] = entry
        return out


def _check_rows(logits: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """(invalid rows, row argmax) in one pass over the logits.

    A row is invalid with a NaN or +inf anywhere, or nothing above -inf (models may mask
    part of the vocabulary with -inf, which is fine): exactly the rows whose maximum is not
    finite, since the max propagates NaN. The argmax is the first maximal index, as
    ``torch.argmax``'s, so greedy rows reuse it."""
    row_max, argmax = _row_max_argmax(logits)
    return torch.nonzero(~torch.isfinite(row_max)).flatten().tolist(), argmax


def _row_max_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits.max(dim=-1)``; through the native kernel where it is available, since
    torch's indexed max is much slower than its plain ``amax`` on CPU."""
    lib = native_cpu.library()
    if lib is None or logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[1] == 0 \
            or logits.stride(1) != 1 or logits.shape[1] >= 2**31:
        return logits.max(dim=-1)
    rows = logits.shape[0]
    row_max = torch.empty(rows, dtype=torch.float32)
    argmax = torch.empty(rows, dtype=torch.int64)
    native_cpu.row_argmax(lib, logits.data_ptr(), rows, logits.shape[1], logits.stride(0), row_max.data_ptr(),
                          argmax.data_ptr(), torch.get_num_threads())
    return row_max, argmax
