"""Builds mpicomm's compiled call path (mpicomm/_native/_callpath.c) where a C compiler and
Python's headers are; the rest of the metadata is in setup.cfg. The extension is optional:
without it mpicomm runs the same call path in Python."""
import hashlib
import os

from setuptools import Extension, setup

NATIVE = os.path.join("mpicomm", "_native")
SOURCES = ["_callpath.c", "dispatch.c", "nccl_run.c", "public.c", "crash.c"]   # (and callpath.h)


def source_hash(here):
    """mpicomm._native.source_hash(): the hash of the sources, carried by the build."""
    h = hashlib.sha256()
    for name in sorted(SOURCES + ["callpath.h"]):
        with open(os.path.join(here, NATIVE, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()[:16]


def extension(optional=True):
    """The extension, carrying its sources' hash (mpicomm._native refuses a stale build)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return Extension("mpicomm._native._callpath", [os.path.join(NATIVE, s) for s in SOURCES],
                     depends=[os.path.join(NATIVE, "callpath.h")], extra_compile_args=["-O2"],
                     define_macros=[("MPICOMM_SOURCE", f'"{source_hash(here)}"')], optional=optional)


if __name__ == "__main__":
    setup(ext_modules=[extension()])
