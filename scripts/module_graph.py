#!/usr/bin/env python3
"""Prints which top-level modules of src/ use which (through `crate::` paths), and any cycle.

A path `crate::m::...` is an edge to module `m`; a path through a crate-root re-export
(`crate::Tensor`, `crate::DType`) is an edge to the module that defines the item. Comments are
ignored; `#[cfg(test)]` code counts like any other. Exits 1 when a cycle exists outside
`--allow a,b` (a pair of modules allowed to use each other).

    python3 scripts/module_graph.py [--allow tensor,autograd]
"""

import re
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(re.sub(r"//.*", "", line) for line in text.splitlines())


def top_module(path):
    rel = path.relative_to(SRC).parts
    return rel[0][:-3] if len(rel) == 1 else rel[0]


def defining_modules(files):
    """Item name -> the top-level module that defines it (for root re-exports)."""
    defs = {}
    item = re.compile(
        r"^\s*pub(?:\([^)]*\))?\s+(?:enum|struct|trait|fn|type|const|static)\s+([A-Za-z_]\w*)",
        re.M,
    )
    for f, text in files.items():
        for name in item.findall(text):
            defs.setdefault(name, set()).add(top_module(f))
    return defs


def crate_paths(text):
    """Every path starting with `crate::`, with `use` groups expanded to their first segment."""
    out = []
    for m in re.finditer(r"\bcrate::(\{[^;]*?\}|[A-Za-z_]\w*)", text):
        seg = m.group(1)
        if seg.startswith("{"):
            # `crate::{a::b, C, d::{..}}`: the first segment of each top-level entry.
            depth, cur, firsts = 0, "", []
            for ch in seg[1:-1]:
                if ch == "{":
                    depth += 1
                elif ch == "}":
                    depth -= 1
                elif ch == "," and depth == 0:
                    firsts.append(cur)
                    cur = ""
                    continue
                cur += ch
            firsts.append(cur)
            out += [re.split(r"::|\s", s.strip())[0] for s in firsts if s.strip()]
        else:
            out.append(seg)
    return out


def main():
    allow = set()
    if "--allow" in sys.argv:
        allow = {tuple(sorted(p.split(","))) for p in sys.argv[sys.argv.index("--allow") + 1 :]}
    files = {f: strip_comments(f.read_text()) for f in sorted(SRC.rglob("*.rs"))}
    modules = sorted({top_module(f) for f in files} - {"lib"})
    defs = defining_modules(files)
    graph = {m: set() for m in modules}
    for f, text in files.items():
        src = top_module(f)
        if src == "lib":
            continue
        for seg in crate_paths(text):
            targets = {seg} if seg in graph else defs.get(seg, set())
            if len(targets) > 1:
                print(f"warning: {seg} is defined in {sorted(targets)}", file=sys.stderr)
            graph[src] |= {t for t in targets if t != src}
    for m in modules:
        print(f"{m:>11} -> {', '.join(sorted(graph[m])) or '(leaf)'}")
    # Cycles: strongly connected components of more than one module (Tarjan).
    index, low, stack, on, sccs = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for m in modules:
        if m not in index:
            visit(m)
    bad = False
    for comp in sccs:
        pairs = {tuple(sorted((a, b))) for a in comp for b in graph[a] if b in comp}
        allowed = len(comp) == 2 and pairs <= allow
        print(f"cycle: {' <-> '.join(comp)}{' (allowed)' if allowed else ''}")
        bad |= not allowed
    if not sccs:
        print("no cycles")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
