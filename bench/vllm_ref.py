"""vLLM 0.11.2's own offloading managers and worker, loaded from its wheel, to compare against.

kvoffload claims vLLM's API and semantics with its defects fixed, and
benchmarks itself against vLLM's managers. This module makes both checkable
against the real thing without installing vLLM (and the CUDA torch it pulls
in): it extracts the pure-Python manager modules from a vLLM 0.11.2 wheel
into a private directory and imports them. Their heavy imports are
replaced by one-line modules: ``vllm.v1.core.kv_cache_utils`` defines the
same ``BlockHash`` ``NewType``, and ``vllm.logger.init_logger`` is
``logging.getLogger``. Nothing of vLLM's is copied
into this repository.

Where the wheel comes from, first match wins:

* ``KVOFFLOAD_VLLM_WHEEL``: a path to ``vllm-0.11.2-*.whl`` (``skip``: none);
* ``.cache/vllm/`` in the repository, where ``scripts/fetch-vllm`` puts it
  (``pip download vllm==0.11.2 --no-deps``, about 370 MB).

    from vllm_ref import load_vllm
    vllm = load_vllm()            # raises VLLMUnavailable with the reason
    m = vllm.LRUOffloadingManager(vllm.CPUBackend(16, 8))
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VERSION = "0.11.2"
REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache" / "vllm"
#: the wheel members that hold the managers and what they import
MODULES = (
    "vllm/v1/kv_offload/__init__.py",
    "vllm/v1/kv_offload/abstract.py",
    "vllm/v1/kv_offload/backend.py",
    "vllm/v1/kv_offload/mediums.py",
    "vllm/v1/kv_offload/lru_manager.py",
    "vllm/v1/kv_offload/arc_manager.py",
    "vllm/v1/kv_offload/backends/__init__.py",
    "vllm/v1/kv_offload/backends/cpu.py",
    "vllm/v1/kv_offload/worker/__init__.py",
    "vllm/v1/kv_offload/worker/worker.py",
)
#: stand-ins for the packages above them and for the one heavy import
SHIMS = {
    "vllm/__init__.py": f'__version__ = "{VERSION}"  # kv_offload only, see bench/vllm_ref.py\n',
    "vllm/v1/__init__.py": "",
    "vllm/v1/core/__init__.py": "",
    "vllm/v1/core/kv_cache_utils.py": (
        'from typing import NewType\n\nBlockHash = NewType("BlockHash", bytes)\n'
    ),
    "vllm/logger.py": "from logging import getLogger as init_logger  # noqa: F401\n",
}


class VLLMUnavailable(RuntimeError):
    """No vLLM 0.11.2 wheel was found or it could not be loaded."""


@dataclass(frozen=True)
class VLLM:
    """The vLLM classes a comparison needs."""

    source: str
    CPUBackend: Any
    LRUOffloadingManager: Any
    ARCOffloadingManager: Any
    CPULoadStoreSpec: Any
    GPULoadStoreSpec: Any
    OffloadingHandler: Any
    OffloadingWorker: Any


def find_wheel() -> Path:
    """The vLLM 0.11.2 wheel to load, or :class:`VLLMUnavailable` saying
    where it was looked for."""
    env = os.environ.get("KVOFFLOAD_VLLM_WHEEL")
    if env == "skip":
        raise VLLMUnavailable("KVOFFLOAD_VLLM_WHEEL=skip")
    if env:
        path = Path(env)
        if not path.is_file():
            raise VLLMUnavailable(f"KVOFFLOAD_VLLM_WHEEL={env} is not a file")
        return path
    found = sorted(CACHE.glob(f"vllm-{VERSION}-*.whl"))
    if not found:
        raise VLLMUnavailable(
            f"no vllm-{VERSION} wheel in {CACHE} and KVOFFLOAD_VLLM_WHEEL is unset "
            "(scripts/fetch-vllm downloads it)"
        )
    return found[-1]


_loaded: VLLM | None = None


def load_vllm() -> VLLM:
    """vLLM's ``CPUBackend`` and managers, imported once per process."""
    global _loaded
    if _loaded is not None:
        return _loaded
    if "vllm" in sys.modules:
        raise VLLMUnavailable("a module named vllm is already imported in this process")
    wheel = find_wheel()
    root = Path(tempfile.mkdtemp(prefix="kvoffload-vllm-ref-"))
    try:
        with zipfile.ZipFile(wheel) as z:
            for member in MODULES:
                z.extract(member, root)
    except (zipfile.BadZipFile, KeyError) as e:
        raise VLLMUnavailable(f"{wheel} is not a vLLM {VERSION} wheel: {e}") from e
    for name, text in SHIMS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    sys.path.insert(0, str(root))
    try:
        cpu = importlib.import_module("vllm.v1.kv_offload.backends.cpu")
        lru = importlib.import_module("vllm.v1.kv_offload.lru_manager")
        arc = importlib.import_module("vllm.v1.kv_offload.arc_manager")
        mediums = importlib.import_module("vllm.v1.kv_offload.mediums")
        worker = importlib.import_module("vllm.v1.kv_offload.worker.worker")
    finally:
        sys.path.remove(str(root))
    _loaded = VLLM(
        source=wheel.name,
        CPUBackend=cpu.CPUBackend,
        LRUOffloadingManager=lru.LRUOffloadingManager,
        ARCOffloadingManager=arc.ARCOffloadingManager,
        CPULoadStoreSpec=mediums.CPULoadStoreSpec,
        GPULoadStoreSpec=mediums.GPULoadStoreSpec,
        OffloadingHandler=worker.OffloadingHandler,
        OffloadingWorker=worker.OffloadingWorker,
    )
    return _loaded
