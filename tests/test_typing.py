"""The public API's type hints hold: mypy (the test extra installs it) checks the modules
that setup.cfg's [mypy] section names (mpicomm/__init__.py, _collectives, _world, errors,
ops, _objects, _operators) with every function annotated. Serial; about half a minute."""
from __future__ import annotations

import configparser
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PUBLIC = {"mpicomm/__init__.py", "mpicomm/_collectives.py", "mpicomm/_world.py", "mpicomm/errors.py",
          "mpicomm/ops.py"}


def test_the_checked_set_holds_the_public_api():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    files = {f.strip() for f in cfg["mypy"]["files"].split(",") if f.strip()}
    assert PUBLIC <= files
    assert (ROOT / "mpicomm" / "py.typed").exists()


def test_mypy_finds_no_errors(tmp_path):
    env = dict(os.environ, MYPY_CACHE_DIR=str(tmp_path / "mypy-cache"))
    r = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "setup.cfg", "--no-error-summary"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if "No module named mypy" in r.stderr:
        raise AssertionError("mypy is not installed: pip install -e '.[test]' (the test extra has it)")
    assert r.returncode == 0, f"mypy found errors:\n{r.stdout}{r.stderr}"
