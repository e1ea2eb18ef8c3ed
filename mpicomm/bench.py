"""``python -m mpicomm.bench``: the same as ``mpicomm-bench`` (see :mod:`mpicomm.tools.bench`)."""
if __name__ == "__main__":
    import runpy

    runpy.run_module("mpicomm.tools.bench", run_name="__main__", alter_sys=True)
