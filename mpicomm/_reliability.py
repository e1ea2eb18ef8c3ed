"""Timeouts, mismatch detection and abort-on-exception (filled in by the reliability work)."""
from .errors import CollectiveTimeoutError


def install(ctx):
    ctx.hooks = None


def uninstall(ctx):
    ctx.hooks = None


def timeout_error(what, timeout):
    name, shape, dtype = what
    return CollectiveTimeoutError(f"{name} (shape {shape}, dtype {dtype}) did not complete within {timeout} s")
