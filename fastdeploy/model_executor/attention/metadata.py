"""The per-step description of a batch that every attention backend reads."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class CommonAttentionMetadata:
    """Backend-independent layout of one step's flattened tokens.

    Requests are laid out one after another in the token dimension: request
    ``i`` owns tokens ``query_start_loc[i]:query_start_loc[i+1]`` which sit at the
    end of its ``seq_lens[i]`` tokens of context (cached tokens come first).
    """

    num_reqs: int
    num_actual_tokens: int
    query_start_loc: torch.Tensor
    """[num_reqs + 1] int32 on the device."""
    seq_lens: torch.Tensor
    """[num_reqs] int32 on the device: context length including this step's tokens."""
    block_table: torch.Tensor
    """[num_reqs, max_blocks] int32 on the device."""
    slot_mapping: torch.Tensor
    """[num_tokens] int64 on the device: flat cache slot of each token (-1 = skip)."""
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray
    max_query_len: int
    max_seq_len: int
    block_size: int
    block_table_cpu: np.ndarray | None = None
    """The host copy of ``block_table`` (backends that plan on the host read it)."""
    num_prompt_tokens_cpu: np.ndarray | None = None
    """[num_reqs] each request's prompt length on the host, or None (unknown): where this step's
    single token is still a prompt token (the last of a prompt after a prefix-cache hit or a
    chunk), backends that compute prompts and decodes with different kernels keep it a prompt
    token, so that its result does not depend on how the prompt was split."""
    attn_mask_offsets: torch.Tensor | None = None
    """[num_tokens] int32 on the device, or None (causal): per query token, the EXCLUSIVE upper
    bound of the key positions (absolute positions within its sequence) it may attend; causal
    is ``position + 1``. Lets the tokens of one image attend to each other bidirectionally while
    text stays causal."""
