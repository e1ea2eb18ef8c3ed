"""``python -m mpicomm.smoke``: the same as ``mpicomm-smoke`` (see :mod:`mpicomm.tools.smoke`)."""
if __name__ == "__main__":
    import runpy

    runpy.run_module("mpicomm.tools.smoke", run_name="__main__", alter_sys=True)
