"""Process groups and collectives of the parallel layouts (tensor and expert parallelism).

One worker process per rank; :func:`init_tensor_parallel` joins the ranks into
a ``torch.distributed`` group (NCCL on GPUs, gloo on CPUs), and the parallel
layers call :func:`tp_all_reduce` / :func:`tp_all_gather`, which are no-ops at
one rank, so the same model code runs unchanged at every layout.
"""

from fastdeploy.distributed.parallel_state import (
    ExpertParallelInfo,
    TensorParallelInfo,
    destroy_tensor_parallel,
    divide,
    ep_agree_step,
    ep_all_gather,
    ep_info,
    ep_max_tokens,
    ep_reduce_scatter,
    ep_spans_replicas,
    ep_step_tokens,
    free_port_init_method,
    init_tensor_parallel,
    tp_all_gather,
    tp_all_gather_rows,
    tp_all_reduce,
    tp_broadcast,
    tp_info,
    tp_rank,
    tp_size,
)

__all__ = [
    "ExpertParallelInfo",
    "TensorParallelInfo",
    "destroy_tensor_parallel",
    "divide",
    "ep_agree_step",
    "ep_all_gather",
    "ep_info",
    "ep_max_tokens",
    "ep_reduce_scatter",
    "ep_spans_replicas",
    "ep_step_tokens",
    "free_port_init_method",
    "init_tensor_parallel",
    "tp_all_gather",
    "tp_all_gather_rows",
    "tp_all_reduce",
    "tp_broadcast",
    "tp_info",
    "tp_rank",
    "tp_size",
]
