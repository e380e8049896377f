"""Mixture-of-experts layer: top-k softmax routing over SwiGLU experts whose weights are stacked.

The experts' weights are two parameters, ``gate_up_proj`` ``[num_experts, 2 * I, H]``
(each expert's ``[gate | up]``) and ``down_proj`` ``[num_experts, H, I]``; the checkpoint's
per-expert ``experts.{e}.gate_proj/up_proj/down_proj`` tensors go through per-expert
loaders (shard ids ``"{e}.gate_proj"``, ``"{e}.up_proj"``, ``"{e}.down_proj"``).

Tensor parallelism splits every expert's intermediate dimension ``I``, like the dense MLP:
gate_up is column-parallel (rank r holds ``[gate_r | up_r]``), down is row-parallel, and the
ranks' partial outputs are summed by ONE all-reduce of the combined (routing-weighted) output.

Expert parallelism (``--enable-expert-parallel``) instead gives EP rank r the whole experts
``[r * E / ep, (r + 1) * E / ep)`` (it loads only those); a (token, expert) pair whose expert
another rank holds gets the id -1 here, which every expert path skips. With TP + EP (the EP group
is the TP group, every rank has the same tokens) each rank runs its experts' pairs and ONE
all-reduce sums the ranks' partial outputs, as with TP. When the EP group spans data-parallel
replicas (each has its own tokens), each rank pads its share of the tokens to the most any rank
has in the step (agreed on the host once per step, :func:`~fastdeploy.distributed.ep_agree_step`),
the ranks all-gather them, run their experts' pairs on every rank's tokens, and a reduce-scatter
returns each rank the sums for its own tokens. Fixed sizes and no host reads, so both layouts
run in CUDA graphs.

On CUDA the routing is one Triton kernel (:mod:`fastdeploy.ops.triton_moe_routing`) and the
experts run in the fused Triton kernels (:mod:`fastdeploy.ops.triton_fused_moe`: route-sorted
grouped GEMMs, bf16/fp16 or FP8 w8a8; for a few tokens the two GEMV-like kernels of
:mod:`fastdeploy.ops.triton_moe_gemv`); on a CPU, or with ``FD_DISABLE_CUSTOM_OPS=1``, the torch
forward (:func:`select_experts_torch`, :meth:`FusedMoE.compute_experts_torch`) sorts the
(token, slot) pairs by expert and runs each expert's two matmuls on its contiguous group of tokens. With an FP8
``quant_config`` the experts are block-scaled float8 (:mod:`.fused_moe_fp8`), quantized at load
or read from an FP8 checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch import nn

from fastdeploy import envs
from fastdeploy.distributed import (
    divide,
    ep_all_gather,
    ep_info,
    ep_max_tokens,
    ep_reduce_scatter,
    ep_spans_replicas,
    tp_all_gather_rows,
    tp_all_reduce,
    tp_rank,
    tp_size,
)
from fastdeploy.model_executor.layers.fused_moe_fp8 import EXPERT_PROJECTIONS, Fp8MoEMethod, expert_matmul
from fastdeploy.model_executor.layers.layernorm import RMSNorm
from fastdeploy.model_executor.layers.linear import Linear
from fastdeploy.model_executor.layers.quantization.base import QuantizationConfig
from fastdeploy.model_executor.layers.side_stream import start_beside
from fastdeploy.model_executor.layers.weight_loading import ShardId, copy_rows, set_weight_loader
from fastdeploy.ops.fp8_quant import DEFAULT_BLOCK, FP8_DTYPE
from fastdeploy.ops.layer_ops import silu_and_mul, triton_module

if TYPE_CHECKING:  # (the Triton modules load lazily: CPU installs may lack triton)
    from fastdeploy.ops.triton_moe_align_atomic import PairRanks


def select_experts_torch(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing in torch: ``[T, E]`` logits → (weights ``[T, k]``, expert ids ``[T, k]``).

    The softmax runs in float32 (as in ``transformers``' Qwen and Ernie MoE routers); with
    ``renormalize`` (``norm_topk_prob``) the k weights are rescaled to sum to 1. With a
    ``correction_bias`` ``[E]`` (Ernie-4.5's ``e_score_correction_bias``) the experts are
    chosen by ``probs + bias`` but weighted by their plain probabilities. The weights come
    back in the logits' dtype.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    if correction_bias is None:
        weights, ids = torch.topk(probs, top_k, dim=-1)
    else:
        _, ids = torch.topk(probs + correction_bias.float().reshape(-1), top_k, dim=-1)
        weights = probs.gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-12)
    return weights.to(router_logits.dtype), ids


def _triton_kernels(name: str, x: torch.Tensor):
    """The Triton module ``fastdeploy.ops.<name>`` for CUDA tensors (None on a CPU, without triton,
    or with ``FD_DISABLE_CUSTOM_OPS=1``)."""
    if not x.is_cuda or envs.FD_DISABLE_CUSTOM_OPS:
        return None
    return triton_module(name)


def _routing_kernels(router_logits: torch.Tensor) -> ModuleType | None:
    """The Triton routing module where its top-k kernel takes these logits (``[T, E]`` or split-K
    ``[S, T, E]`` partials with unit column stride, on CUDA), else None."""
    kernels = _triton_kernels("triton_moe_routing", router_logits)
    if kernels is not None and router_logits.dim() in (2, 3) and router_logits.stride(-1) == 1:
        return kernels
    return None


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    correction_bias: torch.Tensor | None = None,
    expert_counts: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    ranked: PairRanks | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing (:func:`select_experts_torch`'s result): one Triton kernel on CUDA
    (:func:`fastdeploy.ops.triton_moe_routing.topk_softmax`), torch elsewhere. ``expert_counts
    [E]`` (int64), when given, gets each expert's chosen pairs added, on the device (no sync).
    ``[S, T, E]`` logits are :meth:`FusedMoE.router_logits`' split-K partials, summed and rounded
    to ``dtype`` (the model's). ``ranked`` (Triton path only: it comes from
    :func:`~fastdeploy.ops.triton_fused_moe.pair_ranks_for`): the pairs' ranks for the expert sort."""
    kernels = _routing_kernels(router_logits)
    if kernels is not None:
        return kernels.topk_softmax(
            router_logits, top_k, renormalize, correction_bias, expert_counts, dtype, ranked
        )
    if ranked is not None:
        raise ValueError("ranked needs the Triton routing kernel (CUDA logits with unit column stride)")
    if router_logits.dim() == 3:
        router_logits = router_logits.sum(0).to(dtype or router_logits.dtype)
    weights, ids = select_experts_torch(router_logits, top_k, renormalize, correction_bias)
    if expert_counts is not None:
        flat_ids = ids.reshape(-1)
        expert_counts.index_add_(0, flat_ids, torch.ones_like(flat_ids))
    return weights, ids


class FusedMoE(nn.Module):
    """``num_experts`` SwiGLU experts of intermediate size ``intermediate_size`` (the full size; each
    tensor-parallel rank holds its slice, or each expert-parallel rank its whole experts),
    combined with the routing weights.

    :meth:`forward` takes the normed hidden states ``[T, H]`` and the router logits ``[T, E]``
    (and the partial output of the block's shared experts) and returns the full ``[T, H]`` on
    every rank.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        quant_config: QuantizationConfig | None = None,
    ):
        """``quant_config``: the model's quantization (an ``Fp8Config``: FP8 block-scaled experts) or None."""
        super().__init__()
        self.quant_config = quant_config
        """The model's quantization (e.g. FP8); the experts' quantized method is defined here."""
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.ep_rank, self.ep_size = ep_info().rank, ep_info().size
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.num_local_experts = num_experts
        """Experts this rank holds: all of them, or ``E / ep`` under expert parallelism."""
        self.first_local_expert = 0
        self.weight_tp_rank = self.tp_rank
        """The TP rank whose slice of each expert's intermediate features this rank holds (0: whole)."""
        if self.ep_size > 1:
            self.num_local_experts = divide(num_experts, self.ep_size, "experts (expert-parallel size)")
            self.first_local_expert = self.ep_rank * self.num_local_experts
            self.local_intermediate, self.weight_tp_rank = intermediate_size, 0
        else:
            self.local_intermediate = divide(intermediate_size, self.tp_size, "expert intermediate features")
        local, num_local = self.local_intermediate, self.num_local_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_local, 2 * local, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_local, hidden_size, local), requires_grad=False)
        up_shape = (intermediate_size, hidden_size)
        gate_up_shapes = {f"{e}.{p}": up_shape for e in range(num_experts) for p in EXPERT_PROJECTIONS[:2]}
        down_shapes = {f"{e}.down_proj": (hidden_size, intermediate_size) for e in range(num_experts)}
        set_weight_loader(self.gate_up_proj, self.load_expert_shard, gate_up_shapes)
        set_weight_loader(self.down_proj, self.load_expert_shard, down_shapes)
        self.register_buffer("routed_tokens", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        """(token, expert) pairs routed to each expert since the last read (:mod:`.moe_load`)."""
        self.fp8 = Fp8MoEMethod.from_config(quant_config)
        if self.fp8 is not None:
            self.fp8.create_weights(self)

    def process_weights_after_loading(self) -> None:
        """Called by the model loader once every weight is loaded: FP8 quantization at load."""
        if self.fp8 is not None:
            self.fp8.process_weights_after_loading(self)

    def expert_scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The FP8 scales of ``gate_up_proj`` / ``down_proj`` (block or per channel), or ``(None, None)`` (not FP8)."""
        if self.gate_up_proj.dtype != FP8_DTYPE:
            return None, None
        return self.fp8.scales(self)

    def local_expert(self, shard_id: ShardId) -> tuple[int | None, str]:
        """``"{expert}.{proj}"`` → (the expert's index among this rank's stacked experts, or None when
        another expert-parallel rank holds it; the projection name)."""
        expert, _, proj = str(shard_id).partition(".")
        index = int(expert) - self.first_local_expert
        return (index if 0 <= index < self.num_local_experts else None), proj

    def load_expert_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        """Copy this rank's slice of one expert's full checkpoint tensor (``shard_id`` =
        ``"{expert}.{gate_proj|up_proj|down_proj}"``) into its place in the stacked weight
        (nothing for an expert another expert-parallel rank holds)."""
        index, proj = self.local_expert(shard_id)
        if proj not in EXPERT_PROJECTIONS:
            raise ValueError(
                f"expert weights load shards '<e>.gate_proj/up_proj/down_proj', not {shard_id!r}"
            )
        if index is None:
            return
        dest = param.data[index]
        local, start = self.local_intermediate, self.weight_tp_rank * self.local_intermediate
        if proj == "down_proj":  # [H, I]: this rank's columns
            copy_rows(dest, loaded, 1, start)
        else:  # gate_proj / up_proj [I, H]: this rank's rows, gate first then up
            region = dest.narrow(0, 0 if proj == "gate_proj" else local, local)
            copy_rows(region, loaded, 0, start)

    def norm_input(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """``(norm(x + residual), the new residual, quantized)``: the block's input before its router.

        Where the experts' grouped GEMM quantizes its input per token (per-channel FP8 experts on a
        GPU, :func:`~fastdeploy.ops.triton_fused_moe.quantizes_per_token`; no expert parallelism),
        one kernel adds, normalizes and quantizes (:func:`~fastdeploy.ops.triton_fp8_quant.add_rms_norm_quant`:
        the norm kernel's bits, one launch and one pass over the rows fewer) and ``quantized`` is its
        ``(fp8 rows, per-token scales)`` for :meth:`forward`; else None."""
        kernels = _triton_kernels("triton_fused_moe", x)
        if (
            kernels is not None
            and self.ep_size == 1
            and type(norm) is RMSNorm
            and x.dim() == 2
            and x.is_contiguous()
            and x.dtype in (torch.bfloat16, torch.float16)
            and (residual is None or residual.is_contiguous())
            and kernels.quantizes_per_token(x, self.gate_up_proj, self.down_proj, self._block())
        ):
            normed = torch.empty_like(x)
            fp8_quant = triton_module("triton_fp8_quant")
            q, scale, residual = fp8_quant.add_rms_norm_quant(x, residual, norm.weight, norm.eps, normed)
            return normed, residual, (q, scale)
        if residual is None:
            return norm(x), x, None
        return *norm(x, residual), None

    def norm_and_router_logits(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module, gate: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor]:
        """``(hidden, residual, quantized, router logits)``: :meth:`norm_input` then
        :meth:`router_logits`. With ``FD_MOE_ROUTER_NORM_FUSION``, where the split router runs (a
        decode step of a few tokens) after an RMSNorm with a residual, one kernel adds, normalizes
        and computes the partial logits
        (:func:`~fastdeploy.ops.triton_moe_routing.norm_router_partials`)."""
        kernels = self._split_router_kernels(gate, x) if envs.FD_MOE_ROUTER_NORM_FUSION else None
        if (
            kernels is not None
            and residual is not None
            and type(norm) is RMSNorm
            and x.is_contiguous()
            and residual.is_contiguous()
            and residual.dtype == x.dtype
            and norm.weight.dtype == x.dtype
        ):
            hidden, residual, partials = kernels.norm_router_partials(
                x, residual, norm.weight, norm.eps, gate.weight
            )
            return hidden, residual, None, partials
        hidden, residual, quantized = self.norm_input(x, residual, norm)
        return hidden, residual, quantized, self.router_logits(gate, hidden)

    def router_logits(self, gate: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """``gate(hidden)``: the router's logits ``[T, E]``. With ``FD_MOE_ROUTER_SPLIT`` on a GPU,
        for a decode step of at most ``ROUTER_SPLIT_MAX_TOKENS`` tokens and a plain (unquantized,
        no bias) router of the hidden states' dtype: split-K partial sums ``[S, T, E]`` instead
        (:func:`~fastdeploy.ops.triton_moe_routing.router_partials`), which :meth:`forward`'s top-k
        kernel adds up as it loads them."""
        kernels = self._split_router_kernels(gate, hidden)
        if kernels is not None:
            return kernels.router_partials(hidden, gate.weight)
        return gate(hidden)

    @staticmethod
    def _split_router_kernels(gate: nn.Module, hidden: torch.Tensor) -> ModuleType | None:
        """The routing kernels' module where the split router takes this step (see
        :meth:`router_logits`), else None."""
        kernels = _triton_kernels("triton_moe_routing", hidden) if envs.FD_MOE_ROUTER_SPLIT else None
        weight = getattr(gate, "weight", None)
        if (
            kernels is not None
            and hidden.dim() == 2
            and 0 < hidden.shape[0] <= kernels.ROUTER_SPLIT_MAX_TOKENS
            and hidden.stride(1) == 1
            and type(gate) is Linear
            and gate.quant_method is None
            and gate.bias is None
            and weight.dtype == hidden.dtype
            and weight.stride(1) == 1
        ):
            return kernels
        return None

    def _block(self) -> tuple[int, int] | None:
        """The experts' scale layout as the kernels take it (None: per-channel FP8)."""
        return self.fp8.block if self.fp8 is not None else DEFAULT_BLOCK

    def forward(
        self,
        hidden: torch.Tensor,
        router_logits: torch.Tensor,
        shared_experts: Callable[[], torch.Tensor] | None = None,
        correction_bias: torch.Tensor | None = None,
        quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Route each token to its top-k experts (``router_logits``: ``[T, E]``, or
        :meth:`router_logits`' partials) and return their weighted sum ``[T, H]``, plus the
        output of ``shared_experts`` (this rank's partial output of the block's shared experts: run
        on a side stream beside the routed experts, :mod:`.side_stream`), summed over the
        tensor-parallel ranks: one all-reduce of routed + shared partials. ``quantized``:
        :meth:`norm_input`'s FP8 rows of ``hidden``."""
        shared = start_beside(shared_experts, hidden.device) if shared_experts is not None else None
        ranked = self.pair_ranks(hidden, router_logits)
        weights, ids = select_experts(
            router_logits,
            self.top_k,
            self.renormalize,
            correction_bias,
            self.routed_tokens,
            hidden.dtype,
            ranked,
        )
        if self.ep_size > 1 and ep_spans_replicas():
            out = self.experts_across_replicas(hidden, weights, ids)
            if shared is not None:
                partial = shared.result()
                out = out + (tp_all_reduce(partial) if self.tp_size > 1 else partial)
            return out
        out = self.compute_experts(hidden, weights, self.local_expert_ids(ids), quantized, ranked)
        if shared is not None:
            out = out + shared.result()
        if self.tp_size > 1:
            out = tp_all_reduce(out)
        return out

    def pair_ranks(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> PairRanks | None:
        """Buffers for the routing kernel to rank the step's pairs for the fused experts' sort
        (:func:`~fastdeploy.ops.triton_fused_moe.pair_ranks_for`): Triton routing and experts, no
        expert parallelism; else None."""
        kernels = _triton_kernels("triton_fused_moe", hidden)
        if kernels is None or self.ep_size > 1 or _routing_kernels(router_logits) is None:
            return None
        return kernels.pair_ranks_for(hidden, self.gate_up_proj, self.down_proj, self._block(), self.top_k)

    def local_expert_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids → indices into this rank's experts, -1 where another expert-parallel
        rank holds the expert (``ids`` itself without expert parallelism)."""
        if self.ep_size == 1:
            return ids
        local = ids - self.first_local_expert
        return torch.where((local >= 0) & (local < self.num_local_experts), local, -1)

    def experts_across_replicas(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """The full routed output ``[T, H]`` when the expert-parallel group spans data-parallel
        replicas: this TP rank's share of its replica's tokens, padded to the step's agreed size,
        all-gathered from every rank; this rank's experts run on all of them; a reduce-scatter
        brings back the sums for its own share; the TP ranks all-gather their shares."""
        num_tokens, top_k = topk_ids.shape
        base, extra = divmod(num_tokens, self.tp_size)
        shares = [base + (r < extra) for r in range(self.tp_size)]
        start, mine = sum(shares[: self.tp_rank]), shares[self.tp_rank]
        rows = -(-ep_max_tokens(num_tokens, hidden.device) // self.tp_size)  # every rank's padded share
        width = hidden.shape[1]
        meta = torch.zeros((rows, 2 * top_k), dtype=torch.float32, device=hidden.device)
        meta[:, :top_k] = -1  # padding rows route nowhere
        meta[:mine, :top_k] = topk_ids[start : start + mine]  # exact in float32
        meta[:mine, top_k:] = topk_weights[start : start + mine]
        # one all-gather: each row is its hidden state and then its routing, the float32 ids and
        # weights carried bit for bit as hidden-dtype columns
        meta_bits = meta.view(hidden.dtype)
        send = hidden.new_empty((rows, width + meta_bits.shape[1]))
        send[:mine, :width] = hidden[start : start + mine]
        send[mine:, :width].zero_()  # (padding rows route nowhere; zeros keep them finite)
        send[:, width:] = meta_bits
        every = ep_all_gather(send)
        every_meta = every[:, width:].contiguous().view(torch.float32)
        ids = self.local_expert_ids(every_meta[:, :top_k].long())
        partial = self.compute_experts(every[:, :width], every_meta[:, top_k:].to(hidden.dtype), ids)
        return tp_all_gather_rows(ep_reduce_scatter(partial)[:mine], shares)

    def compute_experts(
        self,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
        ranked: PairRanks | None = None,
    ) -> torch.Tensor:
        """This rank's partial expert output for routed tokens (before the all-reduce; the ids index
        this rank's experts, ``[0, num_local_experts)``, or are -1: another rank's, skipped): the fused
        Triton kernel on CUDA, :meth:`compute_experts_torch` on a CPU or with
        ``FD_DISABLE_CUSTOM_OPS=1``. Both take the stacked ``gate_up_proj`` / ``down_proj``
        shards (and their FP8 scales) and return the ``[T, H]`` partial sum. ``quantized``: the FP8
        rows of ``hidden`` (:meth:`norm_input`; only made where the kernel takes them); ``ranked``:
        the pairs' ranks the routing kernel took (:meth:`pair_ranks`)."""
        kernels = _triton_kernels("triton_fused_moe", hidden)
        if kernels is None:
            return self.compute_experts_torch(hidden, topk_weights, topk_ids)
        w13_scale, w2_scale = self.expert_scales()
        return kernels.fused_experts(
            hidden, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, w13_scale, w2_scale,
            self._block(), skip_negative_ids=self.ep_size > 1, a_quantized=quantized, ranked=ranked,
        )  # fmt: skip

    def compute_experts_torch(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """Plain torch: the T*k (token, expert) pairs sorted by expert, each expert's tokens
        through ``down(silu(gate) * up)`` in one batch, scaled by their routing weights and
        summed back into their tokens' rows. FP8 experts compute what the kernel computes
        (activations quantized per 1 x ``bk`` group, both operands dequantized)."""
        num_tokens, top_k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)
        keep = torch.nonzero(flat_ids >= 0).squeeze(1)  # -1: an expert another rank holds
        order = keep[torch.argsort(flat_ids[keep], stable=True)]
        token_of = order // top_k  # the token each sorted pair belongs to
        counts = torch.bincount(flat_ids[order], minlength=self.num_local_experts).tolist()
        sorted_hidden = hidden.index_select(0, token_of)
        sorted_weights = topk_weights.reshape(-1).index_select(0, order).unsqueeze(1)
        expert_out = torch.empty_like(sorted_hidden)
        w13_scale, w2_scale = self.expert_scales()
        block = self._block()
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            s13 = None if w13_scale is None else w13_scale[expert]
            s2 = None if w2_scale is None else w2_scale[expert]
            gate_up = expert_matmul(sorted_hidden[rows], self.gate_up_proj[expert], s13, block)
            expert_out[rows] = expert_matmul(silu_and_mul(gate_up), self.down_proj[expert], s2, block)
            start += count
        out = torch.zeros_like(hidden)
        out.index_add_(0, token_of, expert_out * sorted_weights)
        return out
