"""Expert-parallel dispatch and combine: routed tokens to the ranks that hold their experts, and back.

With expert parallelism EP rank r holds experts ``[r * E / ep, (r + 1) * E / ep)``. Each
rank routes its own tokens; :func:`dispatch` sends every (token, chosen expert) pair to
the expert's rank (one row per pair: the token's hidden state, the expert's local index
and its routing weight) with ``all_to_all_single`` over the EP group, after one exchange
of the per-rank counts. The owner runs its experts on the rows it received (each a
top-1 routing) and :func:`combine` sends the weighted outputs back the same way, where
each token sums its k rows. A rank may send or receive zero rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdeploy.distributed import ep_all_to_all


@dataclass
class DispatchedTokens:
    """The (token, expert) rows this rank received, and what :func:`combine` needs to send them back."""

    hidden: torch.Tensor
    """``[R, H]``: the hidden state of each received row."""
    local_ids: torch.Tensor
    """``[R, 1]``: each row's expert, as an index into this rank's experts."""
    weights: torch.Tensor
    """``[R, 1]``: each row's routing weight (hidden's dtype)."""
    token_of: torch.Tensor
    """``[T * k]``: the sending rank's token of each row it sent, in send order."""
    send_rows: list[int]
    recv_rows: list[int]
    num_tokens: int


def dispatch(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts_per_rank: int,
    ep_size: int,
) -> DispatchedTokens:
    """Send each of this rank's ``T x k`` (token, expert) pairs to the EP rank owning the expert."""
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # by expert, hence by owning rank
    sorted_ids = flat_ids.index_select(0, order)
    dest = torch.div(sorted_ids, experts_per_rank, rounding_mode="floor")
    send_counts = torch.bincount(dest, minlength=ep_size)
    send_rows = send_counts.tolist()
    recv_rows = ep_all_to_all(send_counts, [1] * ep_size, [1] * ep_size).tolist()  # each rank's count for us
    token_of = order // top_k
    meta = torch.stack(  # the local expert index (exact in float32) and the weight, in one exchange
        [
            (sorted_ids - dest * experts_per_rank).float(),
            topk_weights.reshape(-1).index_select(0, order).float(),
        ],
        dim=1,
    )
    recv_hidden = ep_all_to_all(hidden.index_select(0, token_of), send_rows, recv_rows)
    recv_meta = ep_all_to_all(meta, send_rows, recv_rows)
    return DispatchedTokens(
        hidden=recv_hidden,
        local_ids=recv_meta[:, :1].long(),
        weights=recv_meta[:, 1:].to(hidden.dtype),
        token_of=token_of,
        send_rows=send_rows,
        recv_rows=recv_rows,
        num_tokens=num_tokens,
    )


def combine(expert_out: torch.Tensor, sent: DispatchedTokens) -> torch.Tensor:
    """Send the weighted expert outputs ``[R, H]`` back to their tokens' ranks; each token sums its rows."""
    back = ep_all_to_all(expert_out, sent.recv_rows, sent.send_rows)
    out = back.new_zeros((sent.num_tokens, back.shape[1]))
    out.index_add_(0, sent.token_of, back)
    return out
