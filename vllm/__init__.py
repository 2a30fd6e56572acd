"""Persistent MoE execution resources in a vLLM-shaped tree.

This is an own implementation of one subsystem of an LLM inference engine
(workspace and persistent resources for MoE execution), laid out like vLLM so
that names are found where a vLLM reader expects them. It is not vLLM.
"""
