"""Racecheck's hazard pairs, each site shown as its SASS instruction (offline).

compute-sanitizer racecheck names each site by kernel and offset only. Matching every pair
against the SASS of a local build (same sources, same flags, so the same offsets) says which
shared-memory hand-off it is: P and alpha across WG0 -> WG1's named barrier, the validity
words across the producer's mbarrier, and so on (NOTES, sessions 31, 37 and 48). A site whose
offset the build lacks prints `?`: then the build is not the one the harness ran.

    cuobjdump -sass X.cubin > all.sass
    python3 benchmarks/race_pairs.py harness_racecheck.log all.sass
"""
import argparse
import collections
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sass_text import parse  # noqa: E402

_FUNCTION = re.compile(r"^\s*Function : (\S+)", re.M)
_SITE = re.compile(r"(Read|Write) access at (.+?)\+0x([0-9a-f]+)")
_HAZARDS = re.compile(r"\[(\d+) hazards\]")


def kernel_name(name):
    """One spelling for a kernel in racecheck's and c++filt's texts: `void
    jsm::cuda::decode_kernel<(jsm::KVFormat)0, (int)2, (bool)1>(jsm::cuda::Params)` and
    `void jsm::cuda::decode_kernel<(jsm::KVFormat)0, 2, true>(jsm::cuda::Params)` ->
    `decode_kernel<0, 2, true>`."""
    name = name.replace("(bool)1", "true").replace("(bool)0", "false")
    name = re.sub(r"\((?:jsm::KVFormat|int)\)", "", name)
    name = re.sub(r"\([^()]*\)$", "", name.strip())  # the parameter list
    return re.sub(r"^void |\w+::", "", name)


def demangle(names):
    if not names:
        return []
    done = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
    return done.stdout.splitlines()


def kernels(sass_text, demangled=demangle):
    """{kernel_name: {offset: instruction text}} for every function of cuobjdump's output."""
    starts = list(_FUNCTION.finditer(sass_text))
    names = demangled([m.group(1) for m in starts])
    out = {}
    for m, nxt, name in zip(starts, starts[1:] + [None], names):
        body = sass_text[m.end(): nxt.start() if nxt else len(sass_text)]
        out[kernel_name(name)] = {ins.addr: ins.op for ins in parse(body)}
    return out


def pairs(log_text):
    """Counter of ((kernel, access, offset), (kernel, access, offset)) -> hazards: each report's
    first site against each site listed after it."""
    found = collections.Counter()
    for report in log_text.split("Race reported between")[1:]:
        sites = [(kernel_name(k), access, int(off, 16)) for access, k, off in _SITE.findall(report)]
        for other, hazards in zip(sites[1:], _HAZARDS.findall(report)):
            found[(sites[0], other)] += int(hazards)
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("racecheck_log")
    ap.add_argument("sass", help="cuobjdump -sass of the whole cubin")
    args = ap.parse_args()
    code = kernels(Path(args.sass).read_text())
    found = pairs(Path(args.racecheck_log).read_text())
    missing = 0
    for (a, b), hazards in sorted(found.items()):
        texts = [code.get(k, {}).get(off, "?") for k, _, off in (a, b)]
        missing += texts.count("?")
        other = "" if b[0] == a[0] else b[0] + " "
        print(f"{a[0]} {a[1]}+{a[2]:#x} [{texts[0]}]  vs  {other}{b[1]}+{b[2]:#x} [{texts[1]}]  {hazards}")
    print(f"{len(found)} pairs, {sum(found.values())} hazards; sites not in this build: {missing}")


if __name__ == "__main__":
    main()
