"""mpicomm-bench: size parsing, bus-bandwidth factors, the nccl-tests table, JSON and plot,
and short real runs at 2 ranks (all_reduce with --compare, buckets)."""
import json
import os
import subprocess

import pytest

from conftest import clean_mpi_env, mpirun_argv
from launch_support import have_mpirun, spawns_mpirun
from mpicomm.tools import bench

TIMEOUT = 240
needs_mpirun = pytest.mark.skipif(not have_mpirun(), reason="no mpirun on PATH")


@pytest.mark.parametrize("text,value", [
    ("8", 8), ("0", 0), ("1K", 1024), ("64k", 65536), ("1M", 1 << 20), ("1G", 1 << 30),
    ("512KiB", 512 << 10), ("2MB", 2 << 20), ("1.5K", 1536), (" 4M ", 4 << 20)])
def test_parse_size(text, value):
    assert bench.parse_size(text) == value


@pytest.mark.parametrize("text", ["", "abc", "1X", "-8", "1.3", "K"])
def test_parse_size_rejects_with_a_hint(text):
    with pytest.raises(ValueError, match="e.g. 8, 64K, 1M, 1G|whole number"):
        bench.parse_size(text)


def test_size_steps():
    assert bench.size_steps(8, 64) == [8, 16, 32, 64]
    assert bench.size_steps(8, 100, 4) == [8, 32]
    assert bench.size_steps(0, 4) == [0, 1, 2, 4]
    assert bench.size_steps(1 << 20, 3 << 20, step=1 << 20) == [1 << 20, 2 << 20, 3 << 20]
    assert bench.size_steps(8, 8) == [8]
    with pytest.raises(ValueError):
        bench.size_steps(64, 8)
    with pytest.raises(ValueError):
        bench.size_steps(8, 64, 1.0)


def test_bus_factors_are_nccl_tests():
    for n in (2, 4, 8):
        assert bench.bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
        for c in ("all_gather", "reduce_scatter", "all_to_all"):
            assert bench.bus_factor(c, n) == pytest.approx((n - 1) / n)
        assert bench.bus_factor("broadcast", n) == 1.0 and bench.bus_factor("reduce", n) == 1.0
    assert bench.bus_factor("all_reduce", 1) == 0.0
    alg, bus = bench.bandwidths("all_reduce", 1e9, 0.5, 4)
    assert alg == pytest.approx(2.0) and bus == pytest.approx(3.0)


def test_counts_follow_nccl_tests():
    assert bench.counts_for("all_reduce", 1 << 20, 4, 4) == (1 << 18, 1 << 20)
    assert bench.counts_for("all_gather", 1 << 20, 4, 4) == (1 << 16, 1 << 20)  # per-rank count
    assert bench.counts_for("reduce_scatter", 100, 4, 3) == (8, 96)  # rounded down to n chunks
    assert bench.counts_for("all_to_all", 8, 4, 4) == (0, 0)
    assert bench.counts_for("broadcast", 10, 8, 2) == (1, 8)


def test_time_format_is_nccl_tests():
    assert bench.fmt_time(18.554) == "  18.55"
    assert bench.fmt_time(123.45) == "  123.5"
    assert bench.fmt_time(12345.6) == "  12346"
    assert bench.fmt_time(None) == "N/A"


def _row(**kw):
    r = {"coll": "all_reduce", "size": 1048576, "count": 262144, "type": "float", "redop": "sum", "root": -1,
         "oop": bench.variant("all_reduce", 1048576, 150e-6, 2, 0),
         "ip": bench.variant("all_reduce", 1048576, 140e-6, 2, 0),
         "raw_oop": bench.variant("all_reduce", 1048576, 145e-6, 2),
         "raw_ip": bench.variant("all_reduce", 1048576, 140e-6, 2)}
    r.update(kw)
    return r


def test_table_row_has_nccl_tests_columns():
    line = bench.format_row(_row())
    f = line.split()
    assert len(f) == 13  # size count type redop root | time algbw busbw #wrong | x2
    assert f[:5] == ["1048576", "262144", "float", "sum", "-1"]
    assert f[5] == "150.0" and float(f[6]) == pytest.approx(6.99, abs=0.01) and f[8] == "0"
    assert line.startswith("     1048576")  # %12 right-aligned like nccl-tests
    assert len(bench.header()) == 3 and "#wrong" in bench.header()[1]
    assert len(bench.header()[1].split()) - 1 == 13  # "#" plus one name per column


def test_compare_columns_give_raw_time_ratio_and_added_us():
    f = bench.format_row(_row(), compare=True).split()
    assert len(f) == 19
    assert f[13] == "145.0" and float(f[14]) == pytest.approx(145 / 150, abs=0.01) and f[15] == "+5.00"
    assert f[16] == "140.0" and float(f[17]) == pytest.approx(1.0) and f[18] == "+0.00"
    assert bench.ratio(_row()) == pytest.approx(145 / 150)


def test_missing_variants_print_na():
    f = bench.format_row(_row(oop=None, raw_oop=None, coll="broadcast", root=0), compare=True).split()
    assert f[5:9] == ["N/A"] * 4 and f[13:16] == ["N/A"] * 3
    assert bench.primary(_row(oop=None)) == "ip"


def test_summary_lines():
    rows = [_row(size=8, count=2), _row()]
    rows[0]["oop"] = bench.variant("all_reduce", 8, 3e-6, 2, 0)
    rows[0]["raw_oop"] = bench.variant("all_reduce", 8, 2e-6, 2)
    lines = bench.summary_lines(rows, compare=True)
    assert lines[0] == "# Out of bounds values : 0 OK"
    assert lines[1].startswith("# Avg bus bandwidth")
    assert "min 0.967 (at 1048576 B)" in lines[2]
    assert lines[3].startswith("# added per call at 8 B: +1.00 us")
    rows[1]["ip"]["wrong"] = 3
    assert bench.summary_lines(rows, False)[0] == "# Out of bounds values : 3 FAILED"


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [_row(size=s) for s in (8, 1024, 1 << 20)]
    p = tmp_path / "bw.png"
    bench.plot(rows, str(p), "test")
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    b = tmp_path / "b.png"
    bench.plot([{"mode": "per-tensor", "busbw": 1.0, "raw": {"busbw": 1.1}},
                {"mode": "one buffer", "busbw": 3.0, "raw": None}], str(b), "buckets", buckets=True)
    assert b.stat().st_size > 1000


def test_shapes_file_lookup_and_parsing(tmp_path, monkeypatch):
    (tmp_path / bench.SHAPES_FILE).write_text("# comment\n64x3x7x7\n\n64\n1000x2048\n")
    monkeypatch.setenv("MPICOMM_SHARED_DATA", str(tmp_path))
    path = bench.find_shapes_file()
    assert path == os.path.normpath(str(tmp_path / bench.SHAPES_FILE))
    assert bench.read_shapes(path) == [(64, 3, 7, 7), (64,), (1000, 2048)]
    (tmp_path / "bad.txt").write_text("64x?\n")
    with pytest.raises(ValueError, match="bad.txt:1"):
        bench.read_shapes(str(tmp_path / "bad.txt"))
    monkeypatch.setenv("MPICOMM_SHARED_DATA", str(tmp_path / "nowhere"))
    monkeypatch.chdir(tmp_path)
    try:
        bench.find_shapes_file()
    except FileNotFoundError as e:
        assert "MPICOMM_SHARED_DATA" in str(e)


def test_real_resnet50_shapes_when_present():
    try:
        path = bench.find_shapes_file()
    except FileNotFoundError:
        pytest.skip("shared data not present")
    shapes = bench.read_shapes(path)
    import numpy as np

    assert len(shapes) == 161 and sum(int(np.prod(s)) for s in shapes) == 25557032


@pytest.mark.parametrize("argv,msg", [(["-d", "float8"], "invalid -d"), (["-o", "mean2"], "invalid -o"),
                                      (["-b", "1X"], "invalid size"), (["-b", "64", "-e", "8"], "-b"),
                                      (["-d", "int32", "-o", "avg"], "for -d int32")])
def test_bad_arguments_exit_2_before_mpi(argv, msg, capsys):
    assert bench.main(argv) == 2
    assert msg in capsys.readouterr().err


# ---------------------------------------------------------------- real runs at 2 ranks

def _run(args, tmp_path):
    proc = subprocess.run(mpirun_argv(2, "-m", "mpicomm.tools.bench", *args), env=clean_mpi_env(),
                          capture_output=True, text=True, errors="replace", timeout=TIMEOUT, cwd=str(tmp_path))
    return proc.returncode, proc.stdout, proc.stderr


@needs_mpirun
@spawns_mpirun
@pytest.mark.timeout(TIMEOUT + 30)
def test_short_bench_run_at_2_ranks(tmp_path):
    pytest.importorskip("matplotlib")
    js, png = tmp_path / "r.json", tmp_path / "r.png"
    rc, out, err = _run(["-b", "8", "-e", "64K", "-f", "8", "-n", "5", "-w", "1", "--compare",
                         "--json", str(js), "--plot", str(png)], tmp_path)
    assert rc == 0, out + err
    rows = [ln for ln in out.splitlines() if ln and not ln.startswith("#")]
    assert [int(ln.split()[0]) for ln in rows] == [8, 64, 512, 4096, 32768]
    assert all(len(ln.split()) == 19 and ln.split()[8] == "0" for ln in rows)
    assert "# Out of bounds values : 0 OK" in out
    assert "all_reduce 5/5" in err  # progress on rank 0's stderr
    data = json.loads(js.read_text())
    assert data["meta"]["nranks"] == 2 and data["meta"]["backend"] == "mpi"
    assert len(data["rows"]) == 5 and data["rows"][0]["raw_oop"]["time_us"] > 0
    assert png.read_bytes()[:4] == b"\x89PNG"


@needs_mpirun
@spawns_mpirun
@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("coll", ["all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all"])
def test_every_collective_runs_and_checks(coll, tmp_path):
    rc, out, err = _run(["-b", "4", "-e", "4K", "-f", "32", "-n", "3", "-w", "1", "--coll", coll, "--compare",
                         "-r", "1", "-q"], tmp_path)
    assert rc == 0, out + err
    assert "# Out of bounds values : 0 OK" in out
    assert "[mpicomm-bench]" not in err  # -q: no progress


@needs_mpirun
@spawns_mpirun
@pytest.mark.timeout(TIMEOUT + 30)
def test_buckets_run_at_2_ranks(tmp_path):
    shapes = tmp_path / "shapes.txt"
    shapes.write_text("64x3x7x7\n64\n64\n256x64x1x1\n1000x2048\n1000\n")
    rc, out, err = _run(["--coll", "buckets", "--shapes", str(shapes), "-n", "3", "-w", "1", "--compare",
                         "--json", str(tmp_path / "b.json")], tmp_path)
    assert rc == 0, out + err
    modes = [r["mode"] for r in json.loads((tmp_path / "b.json").read_text())["rows"]]
    assert modes[0] == "per-tensor" and modes[-1] == "one buffer"
    assert "per-tensor" in out and "one buffer" in out
