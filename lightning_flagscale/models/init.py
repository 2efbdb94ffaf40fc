"""Layout-independent initialisation helpers for protocol models.

A parameter's initial value must not depend on how the model is split: each parameter draws from its own generator
seeded by the run seed and its canonical name, the full (unsharded) tensor is generated, and each rank copies out
the shard it holds. Every built-in model (and any user model) can build its ``init_weights(seed)`` from these.
"""

from __future__ import annotations

import zlib

from lightning_flagscale.distributed.dtensor import copy_global_into

__all__ = ["canonical_fqn", "copy_global_into", "seed_for"]

# Prefixes that activation checkpointing / torch.compile / FSDP1 insert into FQNs: stripped so that the init seed of
# a parameter does not depend on which wrappers were applied.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_fqn(fqn: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        fqn = fqn.replace(prefix, "")
    return fqn


def seed_for(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)
