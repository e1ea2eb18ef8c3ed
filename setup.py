"""Builds mpicomm's compiled call path (mpicomm/_native/_callpath.c) where a C compiler and
Python's headers are; the rest of the metadata is in setup.cfg. The extension is optional:
without it mpicomm runs the same call path in Python."""
import hashlib
import os

from setuptools import Extension, setup

SOURCE = os.path.join("mpicomm", "_native", "_callpath.c")


def extension(optional=True):
    """The extension, carrying its source's hash (mpicomm._native refuses a stale build)."""
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, SOURCE), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    return Extension("mpicomm._native._callpath", [SOURCE], extra_compile_args=["-O2"],
                     define_macros=[("MPICOMM_SOURCE", f'"{digest}"')], optional=optional)


if __name__ == "__main__":
    setup(ext_modules=[extension()])
