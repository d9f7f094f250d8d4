"""The root of Shoal's exceptions.

Every error Shoal raises on purpose derives from `ShoalError`, grouped in families
that callers branch on (never on message strings):

    ShoalError
      ConfigError            shared/config.py: a setting, file or flag is invalid
      InvalidModelKey, InvalidModelToken        shared/subjects.py
      BusError, CasConflict  shared/bus.py: NATS refused or kept losing a race
      ServiceCallError       shared/micro.py: a micro-service call failed (Unavailable, Timeout, Error)
      RequestError           shared/micro.py: a handler's answer with an error code
      UnknownModelMemory     shared/placement: nothing is known of a model's size
      ModelInspectionError   services/node_agent/model_files.py
      ModelLoadError         services/worker/loader.py (KVPoolTooSmall, KernelBuildError...)
      RequestRejected        services/worker/generation.py: the engine cannot run a request
      ApiError               services/gateway/errors.py: an HTTP error answered to a client
      KVContractError        kernels/contract.py: a KV op's arguments break its contract

Families that used to be ValueError or RuntimeError still are (they derive from both),
so callers written against the standard types keep working.
"""

from __future__ import annotations


class ShoalError(Exception):
    """Base of every exception Shoal raises on purpose."""
