"""mpicomm-bench: size parsing, bus-bandwidth factors, the nccl-tests table and its summary,
the --fresh pools, the per-call and buckets tables, JSON and plot, and short real runs at
2 ranks (all_reduce with --compare and --fresh, every collective, --percall, buckets)."""
import configparser
import fnmatch
import json
import os
import statistics
import sys
import types

import numpy as np
import pytest

from conftest import clean_mpi_env, mpirun_argv, run_job
from launch_support import MATPLOTLIB, have_mpirun, require_module, spawns_mpirun
from mpicomm.tools.bench import buckets, cases, cli, report, timing
from mpicomm.tools.bench.arrays import NumpyFamily

TIMEOUT = 240
needs_mpirun = pytest.mark.skipif(not have_mpirun(), reason="no mpirun on PATH")


@pytest.mark.parametrize("text,value", [
    ("8", 8), ("0", 0), ("1K", 1024), ("64k", 65536), ("1M", 1 << 20), ("1G", 1 << 30),
    ("512KiB", 512 << 10), ("2MB", 2 << 20), ("1.5K", 1536), (" 4M ", 4 << 20)])
def test_parse_size(text, value):
    assert cli.parse_size(text) == value


@pytest.mark.parametrize("text", ["", "abc", "1X", "-8", "1.3", "K"])
def test_parse_size_rejects_with_a_hint(text):
    with pytest.raises(ValueError, match="e.g. 8, 64K, 1M, 1G|whole number"):
        cli.parse_size(text)


def test_size_steps():
    assert cli.size_steps(8, 64) == [8, 16, 32, 64]
    assert cli.size_steps(8, 100, 4) == [8, 32]
    assert cli.size_steps(0, 4) == [0, 1, 2, 4]
    assert cli.size_steps(1 << 20, 3 << 20, step=1 << 20) == [1 << 20, 2 << 20, 3 << 20]
    assert cli.size_steps(8, 8) == [8]
    with pytest.raises(ValueError):
        cli.size_steps(64, 8)
    with pytest.raises(ValueError):
        cli.size_steps(8, 64, 1.0)


def test_percall_size_is_at_least_one_element_per_rank():
    assert cli.percall_size("all_reduce", 8, 4, 4) == 8
    assert cli.percall_size("broadcast", 0, 8, 2) == 8
    assert cli.percall_size("all_gather", 8, 4, 2) == 8      # one float32 per rank at 2 ranks
    assert cli.percall_size("reduce_scatter", 8, 4, 4) == 16  # ... and at 4
    assert cli.percall_size("all_gather", 64, 4, 4) == 64


def test_bus_factors_are_nccl_tests():
    for n in (2, 4, 8):
        assert timing.bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
        for c in ("all_gather", "reduce_scatter", "all_to_all"):
            assert timing.bus_factor(c, n) == pytest.approx((n - 1) / n)
        assert timing.bus_factor("broadcast", n) == 1.0 and timing.bus_factor("reduce", n) == 1.0
    assert timing.bus_factor("all_reduce", 1) == 0.0
    alg, bus = timing.bandwidths("all_reduce", 1e9, 0.5, 4)
    assert alg == pytest.approx(2.0) and bus == pytest.approx(3.0)


def test_uneven_layouts_of_the_v_collectives():
    for n in (1, 2, 3, 4):
        for total in (0, 1, 7, 1000):
            c = cases.uneven_counts(total, n)
            assert sum(c) == total and all(v >= 0 for v in c) and len(c) == n
        S = cases.uneven_splits(10, n)
        assert [len(r) for r in S] == [n] * n and {v for r in S for v in r} <= {5, 10, 15}
    assert cases.uneven_counts(60, 3) == [10, 20, 30]
    assert timing.bus_factor("sendrecv", 4) == 1.0 and timing.bus_factor("all_gatherv", 4) == pytest.approx(0.75)
    assert cases.counts_for("all_to_allv", 1 << 20, 4, 4) == (1 << 16, 1 << 20)


def test_counts_follow_nccl_tests():
    assert cases.counts_for("all_reduce", 1 << 20, 4, 4) == (1 << 18, 1 << 20)
    assert cases.counts_for("all_gather", 1 << 20, 4, 4) == (1 << 16, 1 << 20)  # per-rank count
    assert cases.counts_for("reduce_scatter", 100, 4, 3) == (8, 96)  # rounded down to n chunks
    assert cases.counts_for("all_to_all", 8, 4, 4) == (0, 0)
    assert cases.counts_for("broadcast", 10, 8, 2) == (1, 8)


def test_time_format_is_nccl_tests():
    assert report.fmt_time(18.554) == "  18.55"
    assert report.fmt_time(123.45) == "  123.5"
    assert report.fmt_time(12345.6) == "  12346"
    assert report.fmt_time(None) == "N/A"


def _row(size=1048576, oop=150e-6, ip=140e-6, raw_oop=145e-6, raw_ip=140e-6, **kw):
    """A made-up all_reduce row at 2 ranks: times in seconds (None: no such column)."""
    v = timing.variant
    r = {"coll": "all_reduce", "size": size, "count": size // 4, "type": "float", "redop": "sum", "root": -1,
         "oop": v("all_reduce", size, oop, 2, 0) if oop else None,
         "ip": v("all_reduce", size, ip, 2, 0) if ip else None,
         "raw_oop": v("all_reduce", size, raw_oop, 2) if raw_oop else None,
         "raw_ip": v("all_reduce", size, raw_ip, 2) if raw_ip else None}
    r.update(kw)
    return r


def test_table_row_has_nccl_tests_columns():
    line = report.format_row(_row())
    f = line.split()
    assert len(f) == 13  # size count type redop root | time algbw busbw #wrong | x2
    assert f[:5] == ["1048576", "262144", "float", "sum", "-1"]
    assert f[5] == "150.0" and float(f[6]) == pytest.approx(1048576 / 150e-6 / 1e9, abs=0.01) and f[8] == "0"
    assert line.startswith("     1048576")  # %12 right-aligned like nccl-tests
    assert len(report.header()) == 3 and "#wrong" in report.header()[1]
    assert len(report.header()[1].split()) - 1 == 13  # "#" plus one name per column


def test_compare_columns_give_raw_time_ratio_and_added_us():
    f = report.format_row(_row(), compare=True).split()
    assert len(f) == 19
    assert f[13] == "145.0" and float(f[14]) == pytest.approx(145 / 150, abs=0.01) and f[15] == "+5.00"
    assert f[16] == "140.0" and float(f[17]) == pytest.approx(1.0) and f[18] == "+0.00"
    assert report.ratio(_row()) == pytest.approx(145 / 150)
    assert report.ratio(_row(), "ip") == pytest.approx(1.0)


def test_missing_variants_print_na():
    f = report.format_row(_row(oop=None, raw_oop=None, coll="broadcast", root=0), compare=True).split()
    assert f[5:9] == ["N/A"] * 4 and f[13:16] == ["N/A"] * 3
    assert report.primary(_row(oop=None)) == "ip"


def test_summary_lines():
    rows = [_row(size=8, oop=3e-6, raw_oop=2e-6, ip=3e-6, raw_ip=3e-6), _row()]
    lines = report.summary_lines(rows, compare=True)
    assert lines[0] == "# Out of bounds values : 0 OK"
    busbw = [8 / 3e-6 / 1e9, 1048576 / 150e-6 / 1e9]  # out-of-place, x 2(n-1)/n = 1 at 2 ranks
    assert lines[1] == f"# Avg bus bandwidth    : {sum(busbw) / 2:g} "
    # at >= 1 MiB: out-of-place 145/150, in-place 140/140
    assert lines[2] == (f"# mpicomm/raw busbw at >= 1 MiB: worst {145 / 150:.3f} (out-of-place at 1048576 B), "
                        f"median {statistics.median([145 / 150, 1.0]):.3f} (both columns)")
    assert lines[3] == "# added per call at 8 B: +1.00 us (mpicomm 3.00 us, raw 2.00 us)"
    rows[1]["ip"]["wrong"] = 3
    assert report.summary_lines(rows, False)[0] == "# Out of bounds values : 3 FAILED"
    unchecked = [_row()]
    unchecked[0]["oop"]["wrong"] = unchecked[0]["ip"]["wrong"] = None
    assert report.summary_lines(unchecked, False)[0].endswith("(not checked: -c 0)")


def test_summary_names_the_worse_in_place_column():
    # out-of-place is as fast as raw everywhere; in-place is slower at 4 MiB; a still worse
    # ratio at 8 B is below the summarised sizes and must not count
    rows = [_row(size=8, oop=2e-6, raw_oop=2e-6, ip=10e-6, raw_ip=1e-6),
            _row(size=1 << 20, oop=150e-6, raw_oop=150e-6, ip=150e-6, raw_ip=135e-6),
            _row(size=4 << 20, oop=600e-6, raw_oop=610e-6, ip=800e-6, raw_ip=520e-6)]
    ratios = {("oop", 1 << 20): 1.0, ("ip", 1 << 20): 135 / 150, ("oop", 4 << 20): 610 / 600,
              ("ip", 4 << 20): 520 / 800}
    (col, size), worst = min(ratios.items(), key=lambda kv: kv[1])
    assert (col, size) == ("ip", 4 << 20)
    q, c, s = report.worst_ratio(rows)
    assert (c, s) == (col, size) and q == pytest.approx(worst)
    line = report.summary_lines(rows, compare=True)[2]
    assert line == (f"# mpicomm/raw busbw at >= 1 MiB: worst {worst:.3f} (in-place at {4 << 20} B), "
                    f"median {statistics.median(ratios.values()):.3f} (both columns)")
    # the out-of-place-only view of the first version would have said 1.000
    assert worst < min(v for (k, _), v in ratios.items() if k == "oop")
    assert report.worst_ratio(rows[:1]) is None  # nothing at >= 1 MiB


def test_percall_lines():
    row = _row(size=8, oop=3.5e-6, raw_oop=1.25e-6, ip=None, raw_ip=None)
    (line,) = report.percall_lines(row)
    assert line.split() == ["all_reduce", "8", "out-of-place", "3.50", "1.25", "+2.25",
                            f"{1.25 / 3.5:.2f}", "0"]
    two = report.percall_lines(_row(size=8, oop=3e-6, raw_oop=1e-6, ip=2e-6, raw_ip=None))
    assert [ln.split()[2] for ln in two] == ["out-of-place", "in-place"]
    assert two[1].split()[4:7] == ["N/A"] * 3


def test_bucket_rows_and_summary():
    per = {"mode": "per-tensor", "calls": 161, "size": 1000, "time_us": 4000.0, "algbw": 1.0, "busbw": 1.0,
           "raw": {"time_us": 3000.0}, "of_one_buffer": 0.25}
    views = {"mode": "buckets (grad_views)", "calls": 5, "size": 1000, "time_us": 1000.0, "algbw": 3.9,
             "busbw": 3.9, "raw": None, "of_one_buffer": 0.975}
    f = report.bucket_row(per, compare=True).split()
    assert f == ["per-tensor", "161", "1000", "4.000", "1.00", "1.00", "25.0%", "3.000", "0.75"]
    assert report.bucket_row(views, compare=True).split()[-2:] == ["N/A", "N/A"]
    assert report.bucket_summary([per, views]) == [
        "# buckets (grad_views) vs per-tensor: 4.00x faster; 97.5% of the one-buffer bus bandwidth"]
    assert report.bucket_summary([per]) == []


def test_plot_writes_a_png(tmp_path):
    require_module("matplotlib", MATPLOTLIB)
    rows = [_row(size=s) for s in (8, 1024, 1 << 20)]
    p = tmp_path / "bw.png"
    report.plot(rows, str(p), "test")
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    b = tmp_path / "b.png"
    report.plot([{"mode": "per-tensor", "busbw": 1.0, "raw": {"busbw": 1.1}},
                 {"mode": "one buffer", "busbw": 3.0, "raw": None}], str(b), "buckets", buckets=True)
    assert b.stat().st_size > 1000


# ---------------------------------------------------------------- --fresh, without MPI

class _FakeMpicomm:
    """mpicomm's all_reduce & broadcast at one rank (the result is the input), recording the
    arrays of every call; ``skip``: the ids of outputs it leaves unwritten."""

    def __init__(self, skip=()):
        self.calls, self.skip = [], set(skip)

    def all_reduce(self, x, op, out):
        self.calls.append((id(x), id(out)))
        if id(out) not in self.skip and out is not x:
            np.copyto(out, x)

    def broadcast(self, x, root):
        self.calls.append((id(x), id(x)))


def _bench(mc, pool):
    return types.SimpleNamespace(mc=mc, family=NumpyFamily(), n=1, rank=0, dt=np.dtype(np.float32), op="sum",
                                 root=0, pool=pool, backend="mpi", raw=None, synchronize=lambda: None)


def test_fresh_pool_gives_every_call_other_arrays():
    mc = _FakeMpicomm()
    case = cases.Case(_bench(mc, pool=3), "all_reduce", 10)
    for _ in range(7):
        case.oop()
    pairs = mc.calls
    assert len(set(pairs[:3])) == 3                         # three distinct (x, out) pairs ...
    assert pairs == [pairs[i % 3] for i in range(7)]        # ... used in turn
    assert len({i for p in pairs[:3] for i in p}) == 6      # no array shared between pairs
    mc.calls.clear()
    for _ in range(4):
        case.ip()
    assert [x == o for x, o in mc.calls] == [True] * 4      # in place: out is x
    assert len(set(mc.calls[:3])) == 3 and mc.calls[3] == mc.calls[0]
    same = cases.Case(_bench(_FakeMpicomm(), pool=1), "all_reduce", 10)
    same.oop(), same.oop()
    assert len(set(same.b.mc.calls)) == 1                   # without --fresh: the same arrays


def test_fresh_check_covers_every_pool_entry():
    mc = _FakeMpicomm()
    case = cases.Case(_bench(mc, pool=3), "all_reduce", 1000)
    assert case.check_oop() == 0 and case.check_ip() == 0
    # an mpicomm that never writes the third pool entry's output: exactly that entry's
    # nonzero expected elements are wrong (the output stays zero)
    from mpicomm.tools.smoke import make_data

    broken = case._outs[2]
    mc.skip.add(id(broken))
    broken[:] = 0
    expected = make_data("sum", np.dtype(np.float32), 0, 1000)  # one rank: the sum is its data
    assert case.check_oop() == int(np.count_nonzero(expected))


def test_rotate():
    seen = []
    f = cases.rotate([lambda: seen.append("a"), lambda: seen.append("b")])
    for _ in range(5):
        f()
    assert seen == ["a", "b", "a", "b", "a"]
    g = lambda: None  # noqa: E731
    assert cases.rotate([g]) is g and cases.rotate([g, None]) is None and cases.rotate([]) is None


# ---------------------------------------------------------------- shapes file

def test_shapes_file_parsing(tmp_path):
    (tmp_path / "s.txt").write_text("# comment\n64x3x7x7\n\n64  # bias\n1000x2048\n")
    assert buckets.read_shapes(str(tmp_path / "s.txt")) == [(64, 3, 7, 7), (64,), (1000, 2048)]
    (tmp_path / "bad.txt").write_text("64\n64x?\n")
    with pytest.raises(ValueError, match=r"bad.txt:2: invalid shape '64x\?' \(expected e.g. 64x3x7x7\)"):
        buckets.read_shapes(str(tmp_path / "bad.txt"))


def test_shapes_file_default_is_the_packaged_resnet50_set(monkeypatch):
    monkeypatch.delenv(buckets.SHAPES_ENV, raising=False)
    path = buckets.find_shapes_file()
    assert path == buckets.PACKAGED_SHAPES
    assert path == os.path.join(os.path.dirname(buckets.__file__), "data", "resnet50_grad_shapes.txt")
    shapes = buckets.read_shapes(path)
    # ResNet-50 (torchvision): 161 parameter tensors, 25,557,032 parameters
    assert len(shapes) == 161 and sum(int(np.prod(s)) for s in shapes) == 25557032
    assert shapes[0] == (64, 3, 7, 7) and shapes[-2:] == [(1000, 2048), (1000,)]
    monkeypatch.setenv(buckets.SHAPES_ENV, "")  # empty counts as unset
    assert buckets.find_shapes_file() == buckets.PACKAGED_SHAPES


def test_shapes_file_order_explicit_then_environment(tmp_path, monkeypatch):
    env, explicit = tmp_path / "env.txt", tmp_path / "explicit.txt"
    env.write_text("8\n")
    explicit.write_text("16\n")
    monkeypatch.setenv(buckets.SHAPES_ENV, str(env))
    assert buckets.find_shapes_file() == str(env)
    assert buckets.find_shapes_file(str(explicit)) == str(explicit)
    monkeypatch.delenv(buckets.SHAPES_ENV)
    assert buckets.find_shapes_file(str(explicit)) == str(explicit)


def test_shapes_file_not_found_says_which_and_how(tmp_path, monkeypatch):
    how = "pass --shapes FILE or set MPICOMM_GRAD_SHAPES=FILE (one shape per line, e.g. 64x3x7x7)"
    missing = str(tmp_path / "missing.txt")
    monkeypatch.delenv(buckets.SHAPES_ENV, raising=False)
    with pytest.raises(FileNotFoundError) as e:
        buckets.find_shapes_file(missing)
    assert str(e.value) == f"--shapes {missing}: no such file; {how}"
    # a path in the environment that does not exist is an error, not a quiet fallback
    monkeypatch.setenv(buckets.SHAPES_ENV, missing)
    with pytest.raises(FileNotFoundError) as e:
        buckets.find_shapes_file()
    assert str(e.value) == f"MPICOMM_GRAD_SHAPES={missing}: no such file; {how}"
    # a directory is not a shapes file
    with pytest.raises(FileNotFoundError, match="no such file"):
        buckets.find_shapes_file(str(tmp_path))
    # an install without its package data
    monkeypatch.delenv(buckets.SHAPES_ENV)
    monkeypatch.setattr(buckets, "PACKAGED_SHAPES", missing)
    with pytest.raises(FileNotFoundError) as e:
        buckets.find_shapes_file()
    assert str(e.value) == f"{missing} (shipped with mpicomm: reinstall it): no such file; {how}"


def test_shapes_file_is_package_data():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "setup.cfg"))
    patterns = cfg["options.package_data"]["mpicomm.tools.bench"].split()
    rel = os.path.relpath(buckets.PACKAGED_SHAPES, os.path.dirname(buckets.__file__))
    assert any(fnmatch.fnmatch(rel, p) for p in patterns), (rel, patterns)


# ---------------------------------------------------------------- arguments

@pytest.mark.parametrize("argv,msg", [
    (["-d", "float8"], "invalid -d"), (["-o", "mean2"], "invalid -o"),
    (["-b", "1X"], "invalid size"), (["-b", "64", "-e", "8"], "-b"),
    (["-d", "int32", "-o", "avg"], "for -d int32"),
    (["--fresh-pool", "0"], "invalid --fresh-pool 0"),
    (["--percall", "--coll", "buckets"], "not with --coll buckets"),
    (["--percall", "--plot", "x.png"], "not with --percall"),
    (["--shm-threshold", "12Q"], "invalid --shm-threshold '12Q'"),
    (["--bucket-cap-mb", "big"], "invalid --bucket-cap-mb 'big'"),
    (["--coll", "buckets", "-d", "half"], "the gradient set is float32"),
    (["--array", "cupy", "-d", "bf16"], "CuPy has no bfloat16")])
def test_bad_arguments_exit_2_before_mpi(argv, msg, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))  # importable, whether installed or not
    assert cli.main(argv) == 2
    assert msg in capsys.readouterr().err


def test_array_torch_without_torch_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    assert cli.main(["--array", "torch"]) == 2
    err = capsys.readouterr().err
    assert "--array torch needs torch" in err and "pip install torch" in err


def test_percall_defaults():
    args = cli._parser().parse_args(["--percall"])
    cli._validate(args)
    assert args.colls == ["all_reduce", "all_gather", "reduce_scatter", "broadcast"]
    assert (args.iters, args.warmup, args.rounds, args.stat, args.compare) == (20000, 1000, 10, "median", True)
    args = cli._parser().parse_args(["--percall", "--coll", "broadcast", "-n", "7", "--stat", "min"])
    cli._validate(args)
    assert (args.colls, args.iters, args.stat) == (["broadcast"], 7, "min")
    args = cli._parser().parse_args([])
    cli._validate(args)
    assert (args.colls, args.iters, args.warmup, args.rounds, args.stat, args.pool) == \
        (["all_reduce"], 20, 5, 4, "mean", 1)
    args = cli._parser().parse_args(["--fresh-pool", "3"])
    cli._validate(args)
    assert args.fresh and args.pool == 3


def test_trial_run_caps_sizes_rounds_and_iterations(monkeypatch):
    """MPICOMM_BENCH_TRIAL=1 (how the test suite runs the documented commands): sizes up to
    64 KiB, one round, at most 3 iterations; without it the arguments stand as given."""
    argv = ["-b", "256K", "-e", "256M", "-f", "2", "-n", "0", "--rounds", "8", "--target-time", "0.5"]
    monkeypatch.delenv("MPICOMM_BENCH_TRIAL", raising=False)
    args = cli._parser().parse_args(argv)
    cli._validate(args)
    assert (args.sizes[0], args.sizes[-1], args.rounds, args.target_time) == (256 << 10, 256 << 20, 8, 0.5)
    monkeypatch.setenv("MPICOMM_BENCH_TRIAL", "1")
    args = cli._parser().parse_args(argv)
    cli._validate(args)
    assert (args.sizes, args.rounds, args.iters, args.target_time) == ([64 << 10], 1, 0, 0.01)
    args = cli._parser().parse_args(["-b", "8", "-e", "1M", "-f", "8", "-n", "50", "-w", "9"])
    cli._validate(args)
    assert (args.sizes, args.iters, args.warmup) == ([8, 64, 512, 4096, 32768], 3, 1)


# ---------------------------------------------------------------- real runs at 2 ranks

def _run(args, tmp_path, env=None):
    proc, _ = run_job(mpirun_argv(2, "-m", "mpicomm.tools.bench", *args), clean_mpi_env(env), TIMEOUT,
                      cwd=str(tmp_path))
    return proc.returncode, proc.stdout, proc.stderr


def _table(out):
    return [ln.split() for ln in out.splitlines() if ln and not ln.startswith("#")]


@needs_mpirun
@spawns_mpirun
@pytest.mark.timeout(TIMEOUT + 30)
def test_short_bench_run_at_2_ranks(tmp_path):
    require_module("matplotlib", MATPLOTLIB)
    js, png = tmp_path / "r.json", tmp_path / "r.png"
    rc, out, err = _run(["-b", "8", "-e", "64K", "-f", "8", "-n", "5", "-w", "1", "--compare",
                         "--json", str(js), "--plot", str(png)], tmp_path)
    assert rc == 0, out + err
    rows = _table(out)
    assert [int(f[0]) for f in rows] == [8, 64, 512, 4096, 32768]
    assert all(len(f) == 19 and f[8] == "0" and f[12] == "0" for f in rows)
    assert "# Out of bounds values : 0 OK" in out
    assert "all_reduce 5/5" in err  # progress on rank 0's stderr
    data = json.loads(js.read_text())
    assert data["meta"]["nranks"] == 2 and data["meta"]["backend"] == "mpi" and not data["meta"]["fresh"]
    assert len(data["rows"]) == 5 and data["rows"][0]["raw_oop"]["time_us"] > 0
    assert png.read_bytes()[:4] == b"\x89PNG"


@needs_mpirun
@spawns_mpirun
@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("coll", ["all_reduce", "all_gather", "broadcast", "reduce"])
def test_fresh_run_checks_every_row(coll, tmp_path):
    js = tmp_path / "f.json"
    rc, out, err = _run(["-b", "8", "-e", "64K", "-f", "8", "-n", "6", "-w", "1", "-c", "1", "--coll", coll,
                         "-r", "1", "--fresh", "--fresh-pool", "3", "--compare", "-q", "--json", str(js)], tmp_path)
    assert rc == 0, out + err
    assert "new arrays every call (pool of 3)" in out
    rows = _table(out)
    # 8 B .. 64 KiB by 8; for all_gather at 2 ranks, 8 B is one float32 per rank
    assert [int(f[0]) for f in rows] == [8, 64, 512, 4096, 32768]
    have_oop = coll != "broadcast"   # broadcast is in place only
    have_ip = True                   # all_gather in place: the input is this rank's part of out
    for f in rows:
        assert len(f) == 19
        assert (f[8] == "0") == have_oop and (f[8] == "N/A") == (not have_oop)
        assert (f[12] == "0") == have_ip and (f[12] == "N/A") == (not have_ip)
    assert "# Out of bounds values : 0 OK" in out
    data = json.loads(js.read_text())
    assert data["meta"]["fresh"] is True and data["meta"]["fresh_pool"] == 3
    assert all((r["raw_oop"] or r["raw_ip"])["time_us"] > 0 for r in data["rows"])


@needs_mpirun
@spawns_mpirun
@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("coll", ["all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all",
                                  "all_gatherv", "all_to_allv", "gather", "scatter", "sendrecv"])
def test_every_collective_runs_and_checks(coll, tmp_path):
    rc, out, err = _run(["-b", "4", "-e", "4K", "-f", "32", "-n", "3", "-w", "1", "--coll", coll, "--compare",
                         "-r", "1", "-q"], tmp_path)
    assert rc == 0, out + err
    assert "# Out of bounds values : 0 OK" in out
    assert "[mpicomm-bench]" not in err  # -q: no progress
    if coll in timing.VCOLLS:   # out of place against the raw call (mpi4py's Allgatherv, ...), checked
        for f in _table(out):
            # (the raw time: its ratio columns round to 0.00 on a crowded machine at 0 B)
            assert f[8] == "0" and f[12] == "N/A" and float(f[13]) > 0


@needs_mpirun
@spawns_mpirun
@pytest.mark.timeout(TIMEOUT + 30)
def test_avg_runs_against_raw_sum_and_divide(tmp_path):
    rc, out, err = _run(["-b", "1K", "-e", "4K", "-f", "4", "-n", "3", "-w", "1", "-o", "avg", "--compare",
                         "--fresh", "-q"], tmp_path)
    assert rc == 0, out + err
    rows = _table(out)
    assert [int(f[0]) for f in rows] == [1024, 4096] and all(f[3] == "avg" and f[8] == "0" for f in rows)
    assert all(f[13] != "N/A" for f in rows)  # the raw baseline ran


@needs_mpirun
@spawns_mpirun
@pytest.mark.timeout(TIMEOUT + 30)
def test_percall_run_at_2_ranks(tmp_path):
    js = tmp_path / "p.json"
    rc, out, err = _run(["--percall", "-n", "200", "-w", "20", "--rounds", "4", "-q", "--json", str(js)], tmp_path)
    assert rc == 0, out + err
    lines = _table(out)
    # all_reduce, all_gather and reduce_scatter both ways, broadcast in place
    assert [(f[0], f[1], f[2]) for f in lines] == [
        ("all_reduce", "8", "out-of-place"), ("all_reduce", "8", "in-place"), ("all_gather", "8", "out-of-place"),
        ("all_gather", "8", "in-place"), ("reduce_scatter", "8", "out-of-place"),
        ("reduce_scatter", "8", "in-place"), ("broadcast", "8", "in-place")]
    for f in lines:
        mpicomm_us, raw_us, added = float(f[3]), float(f[4]), float(f[5])
        # three printed values, each rounded to 0.01
        assert mpicomm_us > 0 and raw_us > 0 and added == pytest.approx(mpicomm_us - raw_us, abs=0.016)
        assert f[7] == "0"
    assert "median of 4 interleaved rounds of 200 calls" in out
    data = json.loads(js.read_text())
    assert data["meta"]["percall"] and [r["coll"] for r in data["rows"]] == list(cli.PERCALL_COLLS)


@needs_mpirun
@spawns_mpirun
@pytest.mark.timeout(TIMEOUT + 30)
def test_shm_threshold_reaches_mpicomm_and_is_reported(tmp_path):
    rc, out, err = _run(["--shm-threshold", "off", "-b", "1K", "-e", "1K", "-n", "3", "-w", "1", "-q"], tmp_path)
    assert rc == 0, out + err
    assert "# MPICOMM_SHM_THRESHOLD=off" in out and "# Out of bounds values : 0 OK" in out


@needs_mpirun
@spawns_mpirun
@pytest.mark.timeout(TIMEOUT + 30)
def test_buckets_run_at_2_ranks(tmp_path):
    shapes = tmp_path / "shapes.txt"
    shapes.write_text("64x3x7x7\n64\n64\n256x64x1x1\n1000x2048\n1000\n")
    rc, out, err = _run(["--coll", "buckets", "--shapes", str(shapes), "-n", "3", "-w", "1", "--compare",
                         "--bucket-cap-mb", "25,0", "--json", str(tmp_path / "b.json")], tmp_path)
    assert rc == 0, out + err
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    modes = {r["mode"]: r for r in rows}
    assert rows[0]["mode"] == "per-tensor" and rows[-1]["mode"] == "one buffer"
    assert modes["per-tensor"]["calls"] == 6 and modes["one buffer"]["calls"] == 1
    if "buckets (grad_views)" in modes:  # DistributedGradReducer importable
        assert modes["buckets 0 MiB (views)"]["calls"] == 6    # cap 0: one all_reduce per tensor
        assert modes["buckets (grad_views)"]["calls"] == 1     # 8.3 MB < 25 MiB: one bucket
        assert "# buckets (grad_views) vs per-tensor:" in out
    one = modes["one buffer"]["busbw"]
    assert all(r["of_one_buffer"] == pytest.approx(r["busbw"] / one) for r in rows)
    assert "per-tensor" in out and "one buffer" in out


@needs_mpirun
@spawns_mpirun
@pytest.mark.timeout(TIMEOUT + 30)
def test_buckets_without_shapes_file_fails_alike_on_every_rank(tmp_path):
    rc, out, err = _run(["--coll", "buckets", "--shapes", str(tmp_path / "none.txt"), "-q"], tmp_path)
    assert rc == 2
    assert f"--shapes {tmp_path / 'none.txt'}: no such file" in err


# ---------------------------------------------------------------- in process, at every rank count

@pytest.mark.mpi
@pytest.mark.parametrize("coll", ["all_reduce", "reduce_scatter", "all_to_all"])
def test_fresh_in_process(comm, coll, capsys):
    n = comm.get_group_size()
    rc = cli.main(["-b", "64", "-e", "4K", "-f", "8", "-n", "3", "-w", "1", "--coll", coll, "--fresh",
                   "--fresh-pool", "2", "--compare", "-q"])
    assert rc == 0  # every rank's check passed (the status is agreed over ranks)
    if comm.get_rank() == 0:
        out = capsys.readouterr().out
        chunk = 4 * (n if coll != "all_reduce" else 1)  # float32; chunked: n pieces per rank
        assert [int(f[0]) for f in _table(out)] == [req // chunk * chunk for req in (64, 512, 4096)]
        assert "# Out of bounds values : 0 OK" in out
