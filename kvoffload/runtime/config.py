"""The engine's configuration: the shape of the simulated model and of both
cache tiers, checked when it is made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvoffload._checks import is_int, is_number
from kvoffload.errors import ConfigError
from kvoffload.event_log import DEFAULT_CAPACITY
from kvoffload.policies import policy_class
from kvoffload.transfer.layout import LAYOUTS, Layout

__all__ = ["MAX_WAITING_REQUESTS", "EngineConfig"]

#: the KV tensors' dtypes, by their torch names
DTYPES = ("float16", "bfloat16", "float32")
#: the longest waiting queue: every request in it is held in memory with its
#: block hashes and hinted (about 5 KB each for the built-in workload)
MAX_WAITING_REQUESTS = 100_000


def _is_device_name(device: object) -> bool:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``: the forms the engine takes."""
    if not isinstance(device, str):
        return False
    if device in ("auto", "cpu", "cuda"):
        return True
    index = device.removeprefix("cuda:")
    return index != device and index.isdigit()


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Shape of the simulated model and of both cache tiers.

    The defaults make a small, fast engine: 2 layers of a tiny model, a GPU
    prefix cache of 512 blocks and a CPU tier of 2048 offloaded blocks.
    """

    policy: str = "lru"
    #: offloaded (CPU) blocks in the CPU tier
    num_cpu_blocks: int = 2048
    #: blocks of the GPU KV cache (its prefix cache reuses the unpinned ones)
    num_gpu_blocks: int = 512
    #: tokens per GPU block
    gpu_block_size: int = 16
    #: tokens per offloaded block; a multiple of ``gpu_block_size``
    offloaded_block_size: int = 64
    num_layers: int = 2
    num_kv_heads: int = 2
    head_size: int = 16
    dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    kv_layout: Layout = "kv_first"
    device: str = "auto"
    #: requests scheduled per engine step
    max_requests_per_step: int = 4
    #: requests that may wait, arrived but not served (at full speed: the
    #: next requests of the workload); at least ``max_requests_per_step``, at
    #: most :data:`MAX_WAITING_REQUESTS`
    max_waiting_requests: int = 64
    event_log_capacity: int = DEFAULT_CAPACITY
    #: trace seconds per wall second (None = as fast as possible)
    speed: float | None = None
    #: fraction of transfer jobs reported failed on purpose (chaos testing)
    inject_failure_rate: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        policy_class(self.policy)
        for name in (
            "num_cpu_blocks",
            "num_gpu_blocks",
            "gpu_block_size",
            "offloaded_block_size",
            "max_requests_per_step",
            "max_waiting_requests",
            "event_log_capacity",
            "num_layers",
            "num_kv_heads",
            "head_size",
        ):
            v = getattr(self, name)
            if not is_int(v) or v <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if self.offloaded_block_size % self.gpu_block_size:
            raise ConfigError(
                f"offloaded_block_size ({self.offloaded_block_size}) must be a multiple of "
                f"gpu_block_size ({self.gpu_block_size})"
            )
        if self.num_gpu_blocks < self.block_factor:
            # a request keeps at least one offloaded block, and all of it
            # must fit on the GPU at once
            raise ConfigError(
                f"num_gpu_blocks ({self.num_gpu_blocks}) must hold one offloaded block "
                f"({self.block_factor} GPU blocks); raise num_gpu_blocks or lower "
                "offloaded_block_size"
            )
        if self.max_waiting_requests > MAX_WAITING_REQUESTS:
            raise ConfigError(
                f"max_waiting_requests must be at most {MAX_WAITING_REQUESTS} (each waiting "
                f"request is held in memory and hinted), got {self.max_waiting_requests}"
            )
        if self.max_waiting_requests < self.max_requests_per_step:
            raise ConfigError(
                f"max_waiting_requests ({self.max_waiting_requests}) must be at least "
                f"max_requests_per_step ({self.max_requests_per_step}): a step serves "
                "waiting requests only"
            )
        if not is_int(self.seed):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        if self.speed is not None and (not is_number(self.speed) or not self.speed > 0):
            raise ConfigError(f"speed must be a number > 0 or None, got {self.speed!r}")
        rate = self.inject_failure_rate
        if not is_number(rate) or not 0.0 <= rate <= 1.0:
            raise ConfigError(f"inject_failure_rate must be a number within [0, 1], got {rate!r}")
        # the names only: whether the device is on this machine is the
        # engine's check (it needs torch, which importing kvoffload must not)
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_layout not in LAYOUTS:
            raise ConfigError(
                f"kv_layout must be 'kv_first' or 'blocks_first', got {self.kv_layout!r}"
            )
        if not _is_device_name(self.device):
            raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda[:n]', got {self.device!r}")

    @property
    def block_factor(self) -> int:
        """GPU blocks per offloaded block."""
        return self.offloaded_block_size // self.gpu_block_size
