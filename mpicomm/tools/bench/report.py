"""What the bench prints and writes: nccl-tests' table, the summary, the buckets and
per-call tables, JSON and the busbw plot."""
from __future__ import annotations

import json

import numpy as np

from .timing import MIB

COLUMNS = {"oop": "out-of-place", "ip": "in-place"}


def fmt_time(us):
    """nccl-tests' time format: 2 decimals below 100 us, 1 below 10 ms, none above."""
    if us is None:
        return "N/A"
    if us >= 10000.0:
        return "%7.0f" % us
    if us >= 100.0:
        return "%7.1f" % us
    return "%7.2f" % us


def header(compare=False):
    """The column header lines, nccl-tests' plus the --compare columns."""
    h1 = "#" + " " * 62 + "out-of-place" + " " * 23 + "in-place"
    h2 = "#       size         count      type   redop    root     time   algbw   busbw #wrong" \
         "     time   algbw   busbw #wrong"
    h3 = "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)       " \
         "     (us)  (GB/s)  (GB/s)       "
    if compare:
        h1 += " " * 17 + "raw out-of-place" + " " * 14 + "raw in-place"
        h2 += "  raw time  ratio  +us/call  raw time  ratio  +us/call"
        h3 += "      (us)                       (us)                 "
    return [h1, h2, h3]


def _variant_cols(v):
    if v is None:
        return "  %7s  %6s  %6s  %5s" % ("N/A", "N/A", "N/A", "N/A")
    wrong = "N/A" if v.get("wrong") is None else str(v["wrong"])
    return "  %7s  %6.2f  %6.2f  %5s" % (fmt_time(v["time_us"]), v["algbw"], v["busbw"], wrong)


def _compare_cols(v, raw):
    if v is None or raw is None:
        return "  %8s  %5s  %8s" % ("N/A", "N/A", "N/A")
    q = raw["time_us"] / v["time_us"] if v["time_us"] > 0 else float("nan")
    return "  %8s  %5.2f  %+8.2f" % (fmt_time(raw["time_us"]).strip(), q, v["time_us"] - raw["time_us"])


def format_row(row, compare=False):
    """One table line: nccl-tests' columns, then raw time, ratio and added us per variant."""
    s = "%12d  %12d  %8s  %6s  %6d" % (row["size"], row["count"], row["type"], row["redop"], row["root"])
    s += _variant_cols(row.get("oop")) + _variant_cols(row.get("ip"))
    if compare:
        s += _compare_cols(row.get("oop"), row.get("raw_oop")) + _compare_cols(row.get("ip"), row.get("raw_ip"))
    return s


def ratio(row, which="oop"):
    """mpicomm busbw / raw busbw for a row (raw time / mpicomm time), or None."""
    v, raw = row.get(which), row.get("raw_" + which)
    if not v or not raw or v["time_us"] <= 0:
        return None
    return raw["time_us"] / v["time_us"]


def primary(row):
    """The variant a row is summarised by: out-of-place, else in-place (broadcast)."""
    return "oop" if row.get("oop") else "ip"


def count_wrong(rows):
    """(wrong elements over every row and column, whether any column was checked)."""
    cols = [r.get(k) or {} for r in rows for k in COLUMNS]
    return sum(v.get("wrong") or 0 for v in cols), any(v.get("wrong") is not None for v in cols)


def worst_ratio(rows, min_size=MIB):
    """(ratio, column, size) of the lowest mpicomm/raw busbw ratio over both columns
    (out-of-place and in-place) of the rows of at least ``min_size`` bytes; None if none."""
    cands = [(q, col, r["size"]) for r in rows if r["size"] >= min_size for col in COLUMNS
             for q in (ratio(r, col),) if q is not None]
    return min(cands, key=lambda t: t[0]) if cands else None


def summary_lines(rows, compare):
    """The lines after the table: wrong values, average busbw, and the compare verdicts."""
    wrong, checked = count_wrong(rows)
    out = [f"# Out of bounds values : {wrong} {'OK' if not wrong else 'FAILED'}"
           + ("" if checked else " (not checked: -c 0)")]
    bws = [r[primary(r)]["busbw"] for r in rows if r.get(primary(r))]
    if bws:
        out.append(f"# Avg bus bandwidth    : {sum(bws) / len(bws):g} ")
    if compare:
        worst = worst_ratio(rows)
        if worst is not None:
            qs = [q for r in rows if r["size"] >= MIB for col in COLUMNS for q in (ratio(r, col),) if q is not None]
            out.append(f"# mpicomm/raw busbw at >= 1 MiB: worst {worst[0]:.3f} ({COLUMNS[worst[1]]} at "
                       f"{worst[2]} B), median {float(np.median(qs)):.3f} (both columns)")
        small = [r for r in rows if r.get(primary(r)) and r.get("raw_" + primary(r))]
        if small:
            r0 = small[0]
            p = primary(r0)
            out.append(f"# added per call at {r0['size']} B: "
                       f"{r0[p]['time_us'] - r0['raw_' + p]['time_us']:+.2f} us "
                       f"(mpicomm {r0[p]['time_us']:.2f} us, raw {r0['raw_' + p]['time_us']:.2f} us)")
    return out


# ---------------------------------------------------------------- --percall

def percall_header(rounds, iters, stat):
    return [f"# per-call cost at the smallest size: us per call, {stat} of {rounds} interleaved rounds "
            f"of {iters} calls (max over ranks)",
            "#     collective         bytes       variant   mpicomm       raw  +us/call   ratio  #wrong"]


def percall_lines(row):
    """One line per variant of a row that has both mpicomm's and raw's time."""
    out = []
    for col in COLUMNS:
        v, raw = row.get(col), row.get("raw_" + col)
        if not v:
            continue
        wrong = "N/A" if v.get("wrong") is None else str(v["wrong"])
        if raw:
            s = "%9.2f  %+8.2f  %6.2f" % (raw["time_us"], v["time_us"] - raw["time_us"], ratio(row, col))
        else:
            s = "%9s  %8s  %6s" % ("N/A", "N/A", "N/A")
        out.append("%16s  %12d  %12s  %8.2f %s  %6s" % (row["coll"], row["size"], COLUMNS[col], v["time_us"],
                                                         s, wrong))
    off = row.get("unchecked")
    if off:
        on = row[row["checked_col"]]["time_us"]
        out.append("%16s  %12d  %12s  %8.2f  check off; the check costs %+.2f us per call" % (
            row["coll"], row["size"], COLUMNS[row["checked_col"]], off["time_us"], on - off["time_us"]))
    return out


# ---------------------------------------------------------------- --coll buckets

def bucket_header(compare):
    h = "#                 mode   calls        bytes   time (ms)   algbw   busbw  of 1 buf"
    if compare:
        h += "   raw (ms)  ratio"
    return h


def bucket_row(row, compare):
    share = "%7.1f%%" % (100 * row["of_one_buffer"]) if row.get("of_one_buffer") is not None else "%8s" % "-"
    s = "%22s  %6s  %11d  %10.3f  %6.2f  %6.2f  %s" % (
        row["mode"], row["calls"] if row["calls"] is not None else "?", row["size"], row["time_us"] / 1e3,
        row["algbw"], row["busbw"], share)
    if compare:
        raw = row.get("raw")
        s += ("  %9.3f  %5.2f" % (raw["time_us"] / 1e3, raw["time_us"] / row["time_us"])) if raw \
            else "  %9s  %5s" % ("N/A", "N/A")
    return s


def bucket_summary(rows):
    """The default buckets (grad views) against per-tensor: how much faster, and their share
    of the one-buffer bus bandwidth."""
    by = {r["mode"]: r for r in rows}
    per, views = by.get("per-tensor"), by.get("buckets (grad_views)")
    if not per or not views or views["time_us"] <= 0:
        return []
    share = views.get("of_one_buffer")
    return [f"# buckets (grad_views) vs per-tensor: {per['time_us'] / views['time_us']:.2f}x faster"
            + (f"; {100 * share:.1f}% of the one-buffer bus bandwidth" if share is not None else "")]


# ---------------------------------------------------------------- files

def write_json(path, meta, rows):
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def pyplot():
    """matplotlib.pyplot (the Agg backend); ModuleNotFoundError naming the ``pip install``
    that brings matplotlib where it cannot be imported."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ModuleNotFoundError(
            f"--plot needs matplotlib, which cannot be imported here ({type(e).__name__}: {e}): "
            "pip install '.[plot]' in mpicomm's source tree (or pip install matplotlib), or leave out --plot "
            "(--json FILE keeps every row)", name="matplotlib") from None
    return plt


def plot(rows, path, title, buckets=False):
    """Draw busbw against size (mpicomm and raw, log-2 size axis) into ``path``."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if buckets:
        names = [r["mode"] for r in rows]
        xs = np.arange(len(rows))
        ax.bar(xs - 0.2, [r["busbw"] for r in rows], 0.4, label="mpicomm")
        ax.bar(xs + 0.2, [(r.get("raw") or {}).get("busbw", 0.0) for r in rows], 0.4, label="raw")
        ax.set_xticks(xs, names, rotation=20, ha="right")
        ax.set_ylabel("bus bandwidth (GB/s)")
    else:
        for which, style in (("oop", "-"), ("ip", "--")):
            for src, marker, label in (("", "o", "mpicomm"), ("raw_", "x", "raw")):
                pts = [(r["size"], r[src + which]["busbw"]) for r in rows
                       if r.get(src + which) and r["size"] > 0]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker=marker,
                            label=f"{label} {COLUMNS[which]}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
