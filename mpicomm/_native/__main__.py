"""python -m mpicomm._native: build the compiled call path in place, with the C compiler and
Python's headers (a source tree used through PYTHONPATH; ``pip install`` builds it by
itself). Prints where it wrote it, or why it could not."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig


def main():
    from . import HERE, SOURCES, source_hash

    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    target = os.path.join(HERE, "_callpath" + sysconfig.get_config_var("EXT_SUFFIX"))
    tmp = target + f".{os.getpid()}.tmp"
    argv = cc + ["-O2", "-shared", "-fPIC", "-I" + sysconfig.get_paths()["include"],
                 f'-DMPICOMM_SOURCE="{source_hash()}"'] + [os.path.join(HERE, s) for s in SOURCES] + ["-o", tmp]
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode:
        sys.stderr.write(r.stdout + r.stderr)
        sys.exit(f"could not build mpicomm's compiled call path ({shlex.join(argv)}); "
                 "mpicomm runs its Python call path without it")
    os.replace(tmp, target)   # (a new file: a process that has the old one loaded keeps it)
    print(f"built {target}", file=sys.stderr)


if __name__ == "__main__":
    main()
