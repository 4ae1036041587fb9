"""Turns logits into tokens, honouring each request's SamplingParams.

Greedy rows take one batched argmax. Sampled rows get temperature, top-k, top-p and
min-p applied as batched tensor ops; each seeded request then draws from its own
``torch.Generator`` so its samples do not depend on what else is in the batch.
Log-probabilities are of the model's raw distribution (before penalties and filters).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from .request import Request


_LOGIT_LIMIT = 1e30  # finite in float32 with room for the softmax's max-subtraction


@dataclass(slots=True)
class SampleResult:
    token_ids: np.ndarray  # int64 [S]
    logprobs: list  # per row: None or {token_id: logprob} (top-k plus the sampled token)
    token_logprobs: np.ndarray  # float64 [S], the sampled token's log-probability; NaN unless logprobs was asked


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._global = torch.Generator().manual_seed(seed)
        self._per_request: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self._per_request.pop(request_id, None)

    def _generator(self, request: Request) -> torch.Generator:
        gen = self._per_request.get(request.request_id)
        if gen is None:
            gen = torch.Generator().manual_seed(int(request.sampling_params.seed) & 0xFFFF_FFFF_FFFF)
            self._per_request[request.request_id] = gen
        return gen

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> SampleResult:
        """``logits`` is float32 ``[S, V]``; row i belongs to ``requests[i]``."""
        logits = logits.float().cpu()
        num_rows = logits.shape[0]
        tokens = torch.argmax(logits, dim=-1)
        sampled_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        adjusted = self._apply_penalties(logits, requests)
        if sampled_rows:
            rows = torch.tensor(sampled_rows)
            probs = self._filtered_probs(adjusted[rows], [requests[i].sampling_params for i in sampled_rows])
            for j, i in enumerate(sampled_rows):
                params = requests[i].sampling_params
                gen = self._generator(requests[i]) if params.seed is not None else self._global
                tokens[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
        if adjusted is not logits:
            greedy = [i for i, r in enumerate(requests) if r.sampling_params.greedy]
            if greedy:
                tokens[greedy] = torch.argmax(adjusted[greedy], dim=-1)
        # Log-probabilities cost a pass over the whole vocabulary: only for rows that ask.
        wanted = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        token_logprobs = np.full(num_rows, np.nan)
        top: list = [None] * num_rows
        if wanted:
            index = torch.tensor(wanted)
            log_probs = torch.log_softmax(logits[index], dim=-1)
            picked = tokens[index]
            token_logprobs[wanted] = log_probs.gather(1, picked.view(-1, 1)).view(-1).double().numpy()
            for row, entry in zip(wanted, self._top_logprobs(log_probs, picked, [requests[i] for i in wanted])):
                top[row] = entry
        return SampleResult(tokens.numpy().astype(np.int64), top, token_logprobs)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        penalised = [i for i, r in enumerate(requests) if r.sampling_params.repetition_penalty != 1.0]
        if not penalised:
            return logits
        logits = logits.clone()
        for i in penalised:
            penalty = requests[i].sampling_params.repetition_penalty
            seen = torch.tensor(sorted(set(requests[i].all_token_ids)), dtype=torch.long)
            seen = seen[seen < logits.shape[1]]
            values = logits[i, seen]
            penalised = torch.where(values > 0, values / penalty, values * penalty)
            # An extreme penalty must not overflow: keep the logits finite so they stay drawable.
            logits[i, seen] = penalised.clamp(-_LOGIT_LIMIT, _LOGIT_LIMIT)
        return logits

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
    def _top_logprobs(log_probs: torch.Tensor, tokens: torch.Tensor, requests: Sequence[Request]) -> list:
        out: list[Optional[dict]] = [None] * len(requests)
        for i, request in enumerate(requests):
            k = request.sampling_params.logprobs
            if k is None:
                continue
            entry = {int(tokens[i]): float(log_probs[i, tokens[i]])}
            if k > 0:
                values, ids = torch.topk(log_probs[i], min(k, log_probs.shape[1]))
                entry.update({int(t): float(v) for t, v in zip(ids.tolist(), values.tolist())})
            out[i] = entry
        return out
