"""Shoal's KV-cache kernels: CUDA C++ (kernels/csrc) and a torch implementation of the same contract.

Call them through `shoal.kernels.ops`; the contract and the block layout are
documented there and in docs/kernels.md. Their settings (`KernelSettings`) are
applied process-wide with `configure`; this package's import stays light (no
torch) so that the config loader can import the settings.
"""

from shoal.kernels.settings import KernelSettings, configure, get_settings

__all__ = ["KernelSettings", "configure", "get_settings"]
