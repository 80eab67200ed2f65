"""Where a kernel's time goes, per source line: ncu's per-instruction warp-stall samples joined with the source line of
each instruction.

    python benchmarks/ncu_lines.py ncu-source.csv[.gz] KERNEL.sass [--top 40] [--parts FILE:FIRST-LAST=NAME ...]

- ncu-source.csv: the per-instruction page of an ncu report (`STEPS=ncu NCU_SOURCE=1` in device_check.sh writes it:
  `ncu -i REPORT --page source --csv --print-source sass`), one kernel.
- KERNEL.sass: the same kernel's SASS from a CPU compile with line info (`SASS_DUMP=DIR python
  benchmarks/compile_times.py ... --sass KERNEL`). Triton and ptxas give the same cubin on the GPU and on a CPU, so
  the instructions match by address offset; the script stops if any opcode differs (then the two compiles differ:
  other sources, constexprs or Triton).

Prints, per source line (the innermost one nvdisasm names: an inlined `tl.sum` is charged to Triton's standard.py),
the share of stall samples and of executed instructions and the three largest stall reasons; with --parts, the same
summed over named line ranges of one file (e.g. vector_local.py:358-374=slice-loop), lines outside every part as
"other". Session 23 (benchmarks/RESULTS.md) read the KDA consumer this way.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import re

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
LINE_INFO = re.compile(r'//## File "(.*?)", line (\d+)')
INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def read_sass(path: str) -> dict[int, tuple[str, tuple[str, int] | None]]:
    """address → (opcode, (file name, line) or None) from an `nvdisasm -c -g` listing."""
    out, where = {}, None
    with open(path) as f:
        for text in f:
            m = LINE_INFO.search(text)
            if m:
                where = (m.group(1).rsplit("/", 1)[-1], int(m.group(2)))
                continue
            m = INSTRUCTION.match(text)
            if m:
                out[int(m.group(1), 16)] = (m.group(2).split(".")[0], where)
    return out


def read_ncu(path: str) -> list[dict[str, str]]:
    """The rows of ncu's source page (the first line names the kernel, the second holds the column names)."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        rows = list(csv.reader(f))
    header = rows[1]
    return [dict(zip(header, r)) for r in rows[2:] if len(r) == len(header)]


def joined(rows, sass):
    """(source line, samples, instructions, {stall reason: samples}) per instruction; ValueError where the two
    listings are not the same binary."""
    base = int(rows[0]["Address"], 16)
    stalls = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    out = []
    for r in rows:
        offset = int(r["Address"], 16) - base
        words = r["Source"].split()
        opcode = (words[1] if words[0].startswith("@") else words[0]).split(".")[0]
        if offset not in sass or sass[offset][0] != opcode:
            raise ValueError(f"instruction at +{offset:#x} is {opcode} in the ncu page and "
                             f"{sass.get(offset, ('nothing',))[0]} in the SASS listing: not the same binary")
        out.append((sass[offset][1], int(r[SAMPLES]), int(r[EXECUTED]), {s[6:]: int(r[s]) for s in stalls}))
    return out


def parse_part(spec: str) -> tuple[str, int, int, str]:
    """'FILE:FIRST-LAST=NAME' → (file, first, last, name)."""
    m = re.fullmatch(r"([^:]+):(\d+)-(\d+)=(.+)", spec)
    if not m:
        raise argparse.ArgumentTypeError(f"--parts: {spec!r} is not FILE:FIRST-LAST=NAME (e.g. "
                                         "vector_local.py:358-374=slice-loop)")
    return m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)


def table(items, key):
    """Rows (name, samples %, instructions %, top reasons) summed by key(source line), largest share first."""
    samples, executed = collections.Counter(), collections.Counter()
    reasons = collections.defaultdict(collections.Counter)
    for where, s, i, by_reason in items:
        k = key(where)
        samples[k] += s
        executed[k] += i
        reasons[k].update(by_reason)
    total_s, total_i = max(1, sum(samples.values())), max(1, sum(executed.values()))
    rows = []
    for k, s in samples.most_common():
        top = ", ".join(f"{r} {n * 100 // max(1, s)}%" for r, n in reasons[k].most_common(3))
        rows.append((k, 100 * s / total_s, 100 * executed[k] / total_i, top))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("csv")
    p.add_argument("sass")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--parts", nargs="*", type=parse_part, default=[])
    args = p.parse_args()
    items = joined(read_ncu(args.csv), read_sass(args.sass))
    if args.parts:
        def part(where):
            for name_file, first, last, name in args.parts:
                if where and where[0] == name_file and first <= where[1] <= last:
                    return name
            return "other"
        rows = table(items, part)
    else:
        rows = table(items, lambda where: f"{where[0]}:{where[1]}" if where else "?")[: args.top]
    print(f"{'samples %':>9} {'instr %':>8}  where  (largest stall reasons)")
    for k, s, i, top in rows:
        print(f"{s:9.1f} {i:8.1f}  {k}  ({top})")


if __name__ == "__main__":
    main()
