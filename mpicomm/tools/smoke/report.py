"""Rank 0's report of a smoke run: the table per collective, one line per failure."""
from __future__ import annotations

from .cases import COLLECTIVES, DTYPES, OPS


def _counts_text(counts):
    cs = sorted(counts)
    return ", ".join(str(c) for c in cs) if len(cs) <= 3 else f"{cs[0]}..{cs[-1]} ({len(cs)})"


def summary_rows(cases, times, failures):
    """One row per collective: (collective, dtypes, ops, counts, cases, seconds, verdict)."""
    failed = {}
    for key, _detail, _rank in failures:
        failed.setdefault(key[0], set()).add(key)
    rows = []
    for coll in COLLECTIVES:
        cs = [c for c in cases if c.coll == coll]
        if not cs:
            continue
        dts = sorted({c.dtype for c in cs if c.dtype}, key=DTYPES.index)
        ops = [o for o in OPS if any(c.op == o for c in cs)]
        verdict = "PASS" if coll not in failed else f"FAIL ({len(failed[coll])} case(s))"
        rows.append((coll, f"{len(dts)} dtypes" if len(dts) > 3 else (",".join(dts) or "-"),
                     ",".join(ops) or "-", _counts_text({c.count for c in cs}) if dts else "-",
                     str(len(cs)), f"{times.get(coll, 0.0):.2f}", verdict))
    return rows


def format_table(rows):
    head = ("collective", "dtypes", "ops", "counts (elements)", "cases", "time (s)", "result")
    w = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = "  ".join("{:<%d}" % x for x in w)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * x for x in w))]
                     + [fmt.format(*r) for r in rows])


def merge_failures(all_failures):
    """[(key, detail, world rank)] -> [(key, [ranks], {rank: detail})], in case order."""
    merged = {}
    for key, detail, rank in all_failures:
        ent = merged.setdefault(key, ({}))
        ent[rank] = detail
    return [(k, sorted(v), v) for k, v in merged.items()]


def failure_line(key, ranks, details):
    coll, dtype, op, count, group, mode = key
    first = details[ranks[0]]
    what = f"{coll}" + (f" dtype={dtype}" if dtype else "") + (f" op={op}" if op != "-" else "")
    return (f"FAIL {what} count={count} group={group} mode={mode}: rank(s) "
            f"{', '.join(map(str, ranks))} disagreed; rank {ranks[0]}: {first}")


def print_report(cases, times, failures, classic, checks, n, wall, verbose):
    """Rank 0: the table per collective, the classic AllGather check's result, one line per
    broken collective, the first failures (all with ``verbose``), and the verdict."""
    print(format_table(summary_rows(cases, times, failures)))
    print("AllGather check: each rank's [[rank]] as float32, gathered:")
    print(classic)
    merged = merge_failures(failures)
    order = {c.key(): i for i, c in enumerate(cases)}  # report in the order the cases ran
    merged.sort(key=lambda m: order.get(m[0], len(order)))
    for coll in COLLECTIVES:  # one line per broken collective, then the first cases
        mc_ = [(k, r) for k, r, _ in merged if k[0] == coll]
        if mc_:
            ranks = sorted({x for _, r in mc_ for x in r})
            dts = sorted({k[1] for k, _ in mc_ if k[1]}, key=DTYPES.index)
            print(f"FAIL {coll}: {len(mc_)} failing case(s); dtypes {','.join(dts) or '-'}; counts "
                  f"{_counts_text({k[3] for k, _ in mc_})}; groups {','.join(sorted({k[4] for k, _ in mc_}))}; "
                  f"ranks that disagreed: {', '.join(map(str, ranks))}")
    limit = None if verbose else 10
    for key, ranks, details in merged[:limit]:
        print(failure_line(key, ranks, details))
    if limit is not None and len(merged) > limit:
        print(f"... and {len(merged) - limit} more failing case(s) (--verbose lists them)")
    if failures:
        colls_bad = sorted({k[0] for k, _, _ in merged}, key=COLLECTIVES.index)
        print(f"FAIL: {len(merged)} failing case(s) in {', '.join(colls_bad)}; "
              f"{checks} checks on {n} rank(s) in {wall:.1f} s")
    else:
        print(f"PASS: {checks} checks on {n} rank(s) in {wall:.1f} s")
