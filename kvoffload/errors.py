"""The exception tree. Every error the library raises on misuse derives from
:class:`KVOffloadError`; "no room" is a normal result (``None``), never an error."""

from __future__ import annotations

__all__ = [
    "BlockStateError",
    "ConfigError",
    "KVOffloadError",
    "PolicyContractError",
    "PolicyError",
    "PolicyFailedError",
    "TransferError",
    "UnknownTicketError",
]


class KVOffloadError(Exception):
    """Base class of every kvoffload error."""


class ConfigError(KVOffloadError, ValueError):
    """A configuration value is missing, malformed or out of range."""


class BlockStateError(KVOffloadError, RuntimeError):
    """A protocol call names a block that is absent or in the wrong state
    (e.g. loading a block whose store is still in flight)."""


class PolicyError(ConfigError):
    """An unknown eviction policy was requested."""


class PolicyFailedError(PolicyError):
    """A registered eviction policy could not be used: its target does not
    import as a policy class, or (at a live switch) its constructor or
    ``seed`` raised. The manager keeps working with the policy it had."""


class PolicyContractError(KVOffloadError, RuntimeError):
    """An eviction policy of one's own answered what its contract forbids
    (victims repeated, too many or too few, protected or still resident; a
    store admitted past its length). The message names the policy and the
    breach. The manager checked before freeing anything; after a breach by
    ``evict`` the policy has already changed the table, and the message says
    the manager is not to be used again (the policy is to be fixed), after
    one by ``admit``, or ``evict`` answering ``None`` at a clear, nothing
    was changed."""


class TransferError(KVOffloadError, RuntimeError):
    """A transfer job could not be submitted or routed."""


class UnknownTicketError(KVOffloadError, KeyError):
    """``unhint`` of a ticket that is not in the hint window: never handed
    out by this manager's ``hint``, or already unhinted."""

    def __str__(self) -> str:  # KeyError's would quote the message
        return str(self.args[0]) if self.args else ""
