"""Shoal's KV-cache kernels: CUDA C++ (kernels/csrc) and a torch implementation of the same contract.

Call them through `shoal.kernels.ops`; the contract and the block layout are
documented there and in docs/kernels.md.
"""
