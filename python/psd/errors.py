"""Exceptions: one class per PS_E* code of the C library, all under
psd.Error, each carrying the code, its symbolic name and the library's
message (which names the server, the variable and the values).
python/tests/test_client.py (test_every_library_code_has_its_class) checks
this list against the library's."""
from ._lib import lib


class Error(Exception):
    """A psd call failed. ``code`` is the negative PS_E* number, ``name``
    its symbol ("PS_ESTALE") and ``message`` the library's sentence."""
    code = 0

    def __init__(self, message: str, code: int = 0):
        if code:
            self.code = code
        self.name = lib.ps_err_name(self.code).decode()
        self.message = message
        super().__init__("%s: %s" % (self.name, message))


class InvalidArgument(Error):
    """PS_EINVAL: invalid argument."""
    code = -1


class OutOfMemory(Error):
    """PS_ENOMEM: out of memory."""
    code = -2


class ConnectError(Error):
    """PS_ECONNECT: could not connect to a parameter server."""
    code = -3


class ConnectionLost(Error):
    """PS_ECLOSED: connection to a parameter server lost."""
    code = -4


class ProtocolError(Error):
    """PS_EPROTO: protocol error."""
    code = -5


class VersionMismatch(Error):
    """PS_EVERSION: protocol version mismatch."""
    code = -6


class ConfigMismatch(Error):
    """PS_EMISMATCH: configuration mismatch between peers (the message names the field and both values)."""
    code = -7


class StaleError(Error):
    """PS_ESTALE: stale gradient dropped (not fatal: pull and go on)."""
    code = -8


class DuplicateError(Error):
    """PS_EDUPLICATE: the server already has this worker's gradient for the step (not fatal)."""
    code = -9


class Timeout(Error):
    """PS_ETIMEDOUT: timed out."""
    code = -10


class NotFound(Error):
    """PS_ENOTFOUND: unknown variable, table or slice."""
    code = -11


class ShapeError(Error):
    """PS_ESHAPE: conflicting shape or size."""
    code = -12


class TooBig(Error):
    """PS_ETOOBIG: message or tensor too large."""
    code = -13


class AuthError(Error):
    """PS_EAUTH: authentication failed."""
    code = -14


class Unsupported(Error):
    """PS_EUNSUPPORTED: not supported (by this library or by the server)."""
    code = -15


class StateError(Error):
    """PS_ESTATE: operation not valid in the current state."""
    code = -16


class Busy(Error):
    """PS_EBUSY: resource busy."""
    code = -17


class IOFailure(Error):
    """PS_EIO: input/output error."""
    code = -18


class Shutdown(Error):
    """PS_ESHUTDOWN: the server is shutting down, or a stop saved nothing."""
    code = -19


class InternalError(Error):
    """PS_EINTERNAL: internal error."""
    code = -20


class Stopped(Error):
    """PS_ESTOPPED: the job stopped on request after a checkpoint: call finish() and exit
    with status 75; running the job again resumes it."""
    code = -21


_BY_CODE = {c.code: c for c in Error.__subclasses__()}


def error_for(code: int, message: str) -> Error:
    """The exception for a negative code (psd.Error for an unknown one)."""
    cls = _BY_CODE.get(code)
    return cls(message) if cls else Error(message, code)
