"""Domain errors of the CSI core, each carrying the gRPC status code name it maps to.

The pure core raises these and imports no grpc; :mod:`csi.grpcerrors` turns them into statuses at the edge::

    CsiError (code)
    ├── NotFound            NOT_FOUND
    ├── AlreadyExists       ALREADY_EXISTS        same name, other parameters
    ├── InvalidArgument     INVALID_ARGUMENT      a missing or bad field (the message names it)
    ├── ResourceExhausted   RESOURCE_EXHAUSTED    no space, topology this node cannot meet, capacity unmeetable
    ├── Aborted             ABORTED               another operation on the same volume/name is in flight
    ├── FailedPrecondition  FAILED_PRECONDITION   e.g. deleting a volume that is still staged or published
    ├── OutOfRange          OUT_OF_RANGE          expansion beyond what the backend can give
    ├── Unimplemented       UNIMPLEMENTED
    └── Internal            INTERNAL              a command failed (message names the command and its stderr)
"""

from __future__ import annotations

from nodeplug.commands import CommandError


class CsiError(Exception):
    """Base of every domain error; ``code`` is a ``grpc.StatusCode`` member name."""

    code: str = "UNKNOWN"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFound(CsiError):
    code = "NOT_FOUND"


class AlreadyExists(CsiError):
    code = "ALREADY_EXISTS"


class InvalidArgument(CsiError):
    code = "INVALID_ARGUMENT"


class ResourceExhausted(CsiError):
    code = "RESOURCE_EXHAUSTED"


class Aborted(CsiError):
    code = "ABORTED"


class FailedPrecondition(CsiError):
    code = "FAILED_PRECONDITION"


class OutOfRange(CsiError):
    code = "OUT_OF_RANGE"


class Unimplemented(CsiError):
    code = "UNIMPLEMENTED"


class Internal(CsiError):
    code = "INTERNAL"

    @classmethod
    def from_command(cls, err: CommandError, doing: str = "") -> Internal:
        """Wrap a failed external command; the message keeps the command line and its stderr."""
        return cls(f"{doing}: {err}" if doing else str(err))
