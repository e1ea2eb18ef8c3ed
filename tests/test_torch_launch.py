"""mpicomm.torch in jobs of their own (each test starts mpirun): init_process_group without
mpicomm.init(), the digits example, the DDP benchmark's CPU smoke run and its JSON."""
import json
import os
import re

import pytest

from conftest import ROOT, clean_mpi_env, mpirun_argv, run_job
from launch_support import SKLEARN, TORCH, require_module

require_module("torch", TORCH)


def _run(args, timeout=300):
    env = clean_mpi_env(dict(MPICOMM_BACKEND="mpi"))
    return run_job(mpirun_argv(2, *args), env, timeout, cwd=ROOT)[0]


INIT_ONLY = """
import os, numpy as np, torch, torch.distributed as dist
import mpicomm, mpicomm.torch as mt
assert not mpicomm.is_initialized()
assert mt.init_process_group() == "gloo"
r, n = dist.get_rank(), dist.get_world_size()
vals = [torch.from_numpy(np.random.default_rng([q, 3]).standard_normal(5)) for q in range(n)]
t = vals[r].clone()
dist.all_reduce(t)
torch.testing.assert_close(t, sum(vals), rtol=1e-12, atol=1e-12)
assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]) == (str(r), str(n), "127.0.0.1")
assert int(os.environ["MASTER_PORT"]) > 0
assert not mpicomm.is_initialized()   # torch.distributed alone
mpicomm.init()                        # and mpicomm after it, in the same job
torch.testing.assert_close(mpicomm.all_reduce(vals[r]), t, rtol=1e-12, atol=1e-12)
print("ok", r, n)
"""


def test_init_process_group_without_mpicomm_init():
    p = _run(["-c", INIT_ONLY], timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(re.findall(r"^ok (\d) 2$", p.stdout, re.M)) == ["0", "1"]


def test_train_torch_reaches_its_accuracy():
    require_module("sklearn", SKLEARN)
    p = _run([os.path.join("scripts", "train_torch.py"), "--epochs", "6", "--min-accuracy", "0.9"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^epoch: \d+ step: \d+, loss is ([0-9.e+-]+)$", p.stdout, re.M)]
    assert len(losses) >= 6 and losses[-1] < losses[0] / 4, losses
    acc = float(re.search(r"held-out accuracy: ([0-9.]+)", p.stdout).group(1))
    assert 0.9 <= acc <= 1.0


def test_bench_ddp_cpu_smoke(tmp_path):
    """The DDP benchmark at 2 ranks, tiny: the small conv net and a tiny GPT-2 (Hugging Face's
    where transformers is installed), the floor, torch DDP, mpicomm and mpicomm's overlapped
    step; the table's columns, the agreement check (the overlapped step equal to the unfused
    one), and every communicating mode's parameters identical on both ranks."""
    out = tmp_path / "ddp.json"
    p = _run([os.path.join("scripts", "bench_ddp.py"), "--model", "small,gpt2", "--tiny", "--steps", "2",
              "--warmup", "1", "--rounds", "2", "--check-steps", "3", "--overlap-step", "--json", str(out)])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["ranks"] == 2 and res["mpicomm_backend"] == "mpi" and res["ddp_backend"] == "gloo"
    for name, batch in (("small", 16), ("gpt2", 2)):
        r = res["models"][name]
        assert set(r["ms_per_step"]) == {"none", "ddp", "mpicomm", "mpicomm_step"}
        assert all(len(v) == 2 and min(v) > 0 for v in r["rounds_ms"].values())
        assert r["check_ok"] is True and r["rel_param_diff_vs_ddp"] <= 1e-4 and r["rel_param_change"] > 0
        assert r["rel_param_diff_step_vs_unfused"] == 0.0
        assert r["same_params_on_every_rank"] == {"ddp": True, "mpicomm": True, "mpicomm_step": True}
        for m in ("ddp", "mpicomm", "mpicomm_step"):
            want = (r["ms_per_step"][m] - r["ms_per_step"]["none"]) / r["ms_per_step"]["none"]
            assert abs(r[f"{m}_exposed_share_of_floor"] - want) < 1e-12
        row = re.search(rf"^\| {name} \| {batch} \| ([^|]+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \| [^|]+ \| yes \|",
                        p.stdout, re.M)
        assert row, p.stdout
        assert re.fullmatch(r"[0-9.]+", row.group(1))   # the floor
        for c in row.groups()[1:]:   # ms (exposed as a share of the floor)
            assert re.fullmatch(r"[0-9.]+ \([+-][0-9.]+ %\)", c), c
    assert ("| model | batch/rank | floor ms | torch DDP ms (exposed, of floor) | mpicomm ms (exposed, of floor) | "
            "mpicomm overlapped step ms (exposed, of floor) | mpicomm/DDP exposed | same params on all ranks | "
            "param diff vs DDP |") in p.stdout


@pytest.mark.parametrize("opt", ["sgd-fused", "adamw"])
def test_bench_ddp_other_optimizers(tmp_path, opt):
    """--optimizer: every mode trains with it (fused SGD, AdamW), the overlapped step's copy
    equals the unfused one's bit for bit, and the table and results name it."""
    out = tmp_path / "ddp.json"
    p = _run([os.path.join("scripts", "bench_ddp.py"), "--model", "small", "--tiny", "--steps", "2", "--warmup", "1",
              "--rounds", "1", "--check-steps", "3", "--overlap-step", "--optimizer", opt, "--phases", "3",
              "--json", str(out)])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["optimizer"] == opt and f"optimizer {opt}," in p.stdout
    r = res["models"]["small"]
    assert r["check_ok"] is True and r["rel_param_change"] > 0 and r["rel_param_diff_vs_ddp"] <= 1e-4
    assert r["rel_param_diff_step_vs_unfused"] == 0.0
    assert r["same_params_on_every_rank"] == {"ddp": True, "mpicomm": True, "mpicomm_step": True}
    # --phases: forward, backward and step of every mode; the overlapped step has no step left
    # after backward, the others do
    ph = r["phases_ms"]
    assert set(ph) == {"none", "ddp", "mpicomm", "mpicomm_step"}
    assert all(t["forward"] > 0 and t["backward"] > 0 for t in ph.values()), ph
    assert all(ph[m]["step"] > ph["mpicomm_step"]["step"] for m in ("none", "ddp", "mpicomm")), ph
    for m, t in ph.items():
        label = {"none": "no communication", "ddp": "torch DDP", "mpicomm": "mpicomm",
                 "mpicomm_step": "mpicomm overlapped step"}[m]
        assert f"# small phases, {label}: forward {t['forward']:.2f}, backward {t['backward']:.2f}, " \
               f"step {t['step']:.2f} ms (3 steps, median)" in p.stdout


def test_bench_ddp_rejects_unknown_names():
    p = _run([os.path.join("scripts", "bench_ddp.py"), "--model", "vgg"], timeout=120)
    assert p.returncode != 0 and "--model vgg: expected some of resnet50, gpt2, small" in p.stderr
    p = _run([os.path.join("scripts", "bench_ddp.py"), "--modes", "none,fsdp"], timeout=120)
    assert p.returncode != 0 and ("--modes none,fsdp: expected some of none, ddp, mpicomm, mpicomm_dense, "
                                  "mpicomm_step") in p.stderr, p.stderr
    p = _run([os.path.join("scripts", "bench_ddp.py"), "--optimizer", "lamb"], timeout=120)
    assert p.returncode != 0 and "--optimizer: invalid choice: 'lamb' (choose from" in p.stderr, p.stderr
