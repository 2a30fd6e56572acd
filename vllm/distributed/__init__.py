"""Process groups and collectives over ``torch.distributed`` (NCCL on CUDA,
gloo on CPU); see :mod:`vllm.distributed.parallel_state`."""

from vllm.distributed.parallel_state import (
    CollectiveError,
    GroupCoordinator,
    destroy_distributed_environment,
    destroy_model_parallel,
    get_dp_group,
    get_ep_group,
    get_tp_group,
    get_world_group,
    init_distributed_environment,
    initialize_model_parallel,
    model_parallel_is_initialized,
)
from vllm.distributed.utils import get_distributed_init_method, get_open_port

__all__ = [
    "CollectiveError",
    "GroupCoordinator",
    "destroy_distributed_environment",
    "destroy_model_parallel",
    "get_distributed_init_method",
    "get_dp_group",
    "get_ep_group",
    "get_open_port",
    "get_tp_group",
    "get_world_group",
    "init_distributed_environment",
    "initialize_model_parallel",
    "model_parallel_is_initialized",
]
