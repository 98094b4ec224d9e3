"""The install's errors: what the command prints, with its exit status."""

from __future__ import annotations


class InstallError(Exception):
    """Install or uninstall refused or failed; the message names the path at fault and what to do."""

    exit_status = 1


class InputError(InstallError):
    """A flag or the given conflist is invalid (exit status 2); nothing on the host was touched."""

    exit_status = 2
