"""The communication settings of a rank's environment, recorded in its `start` event (`comm_env`).

NCCL and torch read these at process-group creation; a report that says which were in effect
answers "was NCCL_P2P_DISABLE set on that run?" after the fact. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping

#: variable-name prefixes that shape collective communication
COMM_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_FR_", "GLOO_", "TORCH_DISTRIBUTED_", "TORCH_GLOO_")
#: single variables that do too
COMM_ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "MASTER_ADDR", "MASTER_PORT")


def comm_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of `environ` that shape collective communication, sorted by name."""
    return {
        name: str(environ[name])
        for name in sorted(environ)
        if name.startswith(COMM_ENV_PREFIXES) or name in COMM_ENV_NAMES
    }
