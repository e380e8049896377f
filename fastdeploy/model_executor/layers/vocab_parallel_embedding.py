"""Token embedding and LM head with the vocabulary split over the tensor-parallel ranks.

Rank r holds vocabulary rows ``[r * V/N, (r+1) * V/N)`` (``V/N`` rounded up: the last
rank's tail rows past the vocabulary are zero padding, so any vocabulary size splits).
The embedding looks up the tokens this rank holds, zeroes the others and all-reduces;
the LM head computes this rank's logits and all-gathers them, so that every rank has the
full ``[N, V]`` logits for the sampler. At one rank both are the plain operations.
"""

from __future__ import annotations

import torch
from torch import nn

from fastdeploy.distributed import tp_all_gather, tp_all_reduce, tp_rank, tp_size
from fastdeploy.model_executor.layers.linear import Linear
from fastdeploy.model_executor.layers.weight_loading import ShardId, copy_rows, set_weight_loader


def vocab_rows_per_rank(vocab_size: int, size: int) -> int:
    """Vocabulary rows each of ``size`` ranks holds: ``vocab_size / size`` rounded up."""
    return -(-vocab_size // size)


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding(num_embeddings, embedding_dim)`` with the vocabulary rows split over the ranks."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        rows = vocab_rows_per_rank(num_embeddings, self.tp_size)
        self.vocab_start = self.tp_rank * rows
        self.vocab_end = min(self.vocab_start + rows, num_embeddings)
        """This rank's token ids: ``[vocab_start, vocab_end)``."""
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim))
        nn.init.normal_(self.weight)  # (as nn.Embedding; a checkpoint or dummy weights replace it)
        set_weight_loader(self.weight, self.load_vocab_shard, {None: (num_embeddings, embedding_dim)})

    def load_vocab_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        """Copy this rank's rows of the full ``[vocab, hidden]`` tensor (padding rows zeroed)."""
        copy_rows(param.data, loaded, 0, self.vocab_start)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return nn.functional.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill_(outside, 0)
        out = nn.functional.embedding(local_ids, self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return tp_all_reduce(out)


class ParallelLMHead(Linear):
    """The LM head (``hidden → vocab`` logits, no bias) with the vocabulary split over the ranks.

    A :class:`Linear` over this rank's vocabulary rows (prepacked on a CPU, small-M kernel on
    a GPU); :meth:`forward` all-gathers the ranks' logits and drops the padding columns.
    Tie it to the embedding by assigning ``lm_head.weight = embedding.weight``: both hold
    the same rows on each rank and load them alike.
    """

    def __init__(self, vocab_size: int, hidden_size: int):
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.vocab_size = vocab_size
        rows = vocab_rows_per_rank(vocab_size, self.tp_size)
        self.vocab_start = self.tp_rank * rows
        super().__init__(hidden_size, rows, bias=False)
        set_weight_loader(self.weight, self.load_vocab_shard, {None: (vocab_size, hidden_size)})

    def load_vocab_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        """Copy this rank's rows of the full ``[vocab, hidden]`` tensor (padding rows zeroed)."""
        copy_rows(param.data, loaded, 0, self.vocab_start)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[N, hidden]`` → full logits ``[N, vocab]`` on every rank."""
        logits = self.matmul(hidden, None)
        if self.tp_size == 1:
            return logits
        logits = tp_all_gather(logits, dim=-1)
        return logits if logits.shape[-1] == self.vocab_size else logits[..., : self.vocab_size].contiguous()
