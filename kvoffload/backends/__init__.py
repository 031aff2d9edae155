"""Concrete block backends."""

from kvoffload.backends.cpu import CPUBackend, CPUBlockStatus

__all__ = ["CPUBackend", "CPUBlockStatus"]
