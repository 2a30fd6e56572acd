"""Persistent MoE execution resources in a vLLM-shaped tree.

This is an own implementation of one subsystem of an LLM inference engine
(workspace and persistent resources for MoE execution), laid out like vLLM so
that names are found where a vLLM reader expects them. It is not vLLM.
"""

from typing import Any

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Lazy: `import vllm` stays cheap for the kernels and their tests.
    if name == "LLM":
        from vllm.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from vllm.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'vllm' has no attribute {name!r}")
