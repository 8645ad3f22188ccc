#!/usr/bin/env python3
"""Print the N largest Rust functions (by lines, signature to closing brace) under the given
directories. Used for the before/after figures in docs/.

    python3 scripts/largest-functions.py [-n 5] [DIR ...]     # default: src probes/src

Comments and strings are skipped when matching braces; `#[cfg(test)]` modules count too
unless --no-tests is given.
"""
import argparse
import os
import re
import sys

FN = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:const\s+)?(?:async\s+)?(?:unsafe\s+)?(?:extern\s+\"C\"\s+)?fn\s+(\w+)")


def strip(line, state):
    """Return the line with comments and string/char literals blanked; state tracks /* */."""
    out = []
    i = 0
    n = len(line)
    while i < n:
        if state["block"]:
            j = line.find("*/", i)
            if j < 0:
                return "".join(out)
            state["block"] = False
            i = j + 2
            continue
        c = line[i]
        if line.startswith("//", i):
            break
        if line.startswith("/*", i):
            state["block"] = True
            i += 2
            continue
        if c == '"':
            i += 1
            while i < n and line[i] != '"':
                i += 2 if line[i] == "\\" else 1
            i += 1
            continue
        if c == "'" and i + 2 < n and (line[i + 2] == "'" or (line[i + 1] == "\\")):
            j = line.find("'", i + 2)
            i = j + 1 if j > 0 else i + 1
            continue
        out.append(c)
        i += 1
    return "".join(out)


def functions(path, skip_tests):
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    state = {"block": False}
    clean = [strip(l, state) for l in lines]
    found = []
    in_test_until = -1
    for idx, line in enumerate(clean):
        if skip_tests and idx > in_test_until and lines[idx].strip() == "#[cfg(test)]":
            # skip the following item entirely
            depth, started = 0, False
            for k in range(idx + 1, len(clean)):
                depth += clean[k].count("{") - clean[k].count("}")
                started = started or "{" in clean[k]
                if started and depth <= 0:
                    in_test_until = k
                    break
        if idx <= in_test_until:
            continue
        m = FN.match(line)
        if not m:
            continue
        depth, started = 0, False
        for k in range(idx, len(clean)):
            if not started and ";" in clean[k] and "{" not in clean[k]:
                break  # a declaration without a body
            depth += clean[k].count("{") - clean[k].count("}")
            started = started or "{" in clean[k]
            if started and depth <= 0:
                found.append((k - idx + 1, f"{path}:{idx + 1}", m.group(1)))
                break
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=5)
    ap.add_argument("--no-tests", action="store_true", help="skip #[cfg(test)] items")
    ap.add_argument("dirs", nargs="*", default=["src", "probes/src"])
    args = ap.parse_args()
    found = []
    for d in args.dirs:
        for root, _, files in os.walk(d):
            for name in sorted(files):
                if name.endswith(".rs"):
                    found += functions(os.path.join(root, name), args.no_tests)
    found.sort(key=lambda t: (-t[0], t[1]))
    for lines, where, name in found[: args.n]:
        print(f"{lines:5d}  {name}  ({where})")


if __name__ == "__main__":
    sys.exit(main())
