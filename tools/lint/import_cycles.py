#!/usr/bin/env python3
# import_cycles.py: find import circles between the source files of each crate.
#
# Rule (see tools/lint/README.md):
#   For every crate under crates/*/src, each source file is a node (src/lib.rs,
#   src/main.rs, src/a.rs, src/a/mod.rs, src/a/b.rs, ...). An edge A -> B exists
#   when a path written in A resolves to an item of module file B:
#     * `use crate::…`, `use super::…`, `use self::…` (also `pub use`,
#       `pub(crate) use` and nested groups `use crate::{a::X, b::{Y, Z}}`),
#     * qualified paths in code, `crate::a::foo(…)`, `super::bar::Baz`,
#       `$crate::…` in macro bodies.
#   A path resolves to the deepest module that has its own file
#   (crate::a::b::Thing -> src/a/b.rs or src/a/b/mod.rs if present, else the
#   file of `a`). Comments, string/char literals and `#[cfg(test)] mod … { }`
#   blocks are ignored; inline `mod x { }` blocks belong to their file (and are
#   taken into account when resolving `super::`/`self::` inside them).
#   Edges from a module's file to its own descendants' files are dropped: a
#   parent composing and re-exporting its children is normal. Everything else
#   counts (child -> ancestor, sibling -> sibling, cousin -> cousin).
#   Every strongly connected component with more than one file is a circle; it
#   is printed with the edges inside it and the lines that create them.
#   Exit status: 1 if any circle exists, 0 otherwise.
#
# Limitations: re-exports are not followed (`use crate::Foo` where lib.rs has
# `pub use a::Foo` is an edge to lib.rs, which is never part of a circle);
# imports of a name brought in by another `use` (`use crate::a; a::f()`) count
# through that `use`; `#[path]` attributes and src/bin/ are not supported (a
# warning is printed if `#[path]` appears under src/).
#
# Usage: python3 tools/lint/import_cycles.py [--root DIR] [--edges]
#   --root DIR   workspace root (default: two levels above this script)
#   --edges      also print every counted edge (for debugging)
"""Find import circles between the source files of each crate (see header)."""

import argparse
import bisect
import os
import re
import sys

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


# ---------------------------------------------------------------- lexing ----

def strip_code(text):
    """Blank out comments and string/char literals, keeping every newline and
    every offset (so line numbers and positions stay valid)."""
    out = list(text)
    n = len(text)
    i = 0

    def blank(a, b):
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = text[i]
        if c == "/" and text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif c == "/" and text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            blank(i, j)
            i = j
        elif c in "rb" and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            # raw strings r"..", r#".."#, br#".."#; byte strings b"..", b'.'
            m = re.compile(r"b?r(#*)\"").match(text, i)
            if m:
                end = text.find('"' + m.group(1), m.end())
                end = n if end < 0 else end + 1 + len(m.group(1))
                blank(i, end)
                i = end
            elif text.startswith('b"', i) or text.startswith("b'", i):
                i = skip_quoted(text, i + 1, blank)
            else:
                i += 1
        elif c == '"':
            i = skip_quoted(text, i, blank)
        elif c == "'":
            # char literal or lifetime/label
            m = re.compile(r"'(\\(x[0-9a-fA-F]{2}|u\{[0-9a-fA-F_]*\}|.)|[^\\'\n])'").match(text, i)
            if m:
                blank(i, m.end())
                i = m.end()
            else:
                i += 1
        else:
            i += 1
    return "".join(out)


def skip_quoted(text, i, blank):
    """text[i] is a quote; blank the literal and return the offset after it."""
    q = text[i]
    j = i + 1
    n = len(text)
    while j < n:
        if text[j] == "\\":
            j += 2
        elif text[j] == q:
            j += 1
            break
        else:
            j += 1
    blank(i, j)
    return j


def matching_brace(code, open_pos):
    depth = 0
    for j in range(open_pos, len(code)):
        if code[j] == "{":
            depth += 1
        elif code[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(code) - 1


MOD_RE = re.compile(r"\bmod\s+(" + IDENT + r")\s*([{;])")


CFG_TEST_BEFORE_RE = re.compile(
    r"#\[\s*cfg\s*\(\s*test\s*\)\s*\](\s*#\[[^\]]*\])*\s*(pub\s*(\([^)]*\))?\s*)?$"
)


def is_cfg_test(code, pos):
    """Whether the item starting at pos carries `#[cfg(test)]`."""
    return CFG_TEST_BEFORE_RE.search(code[max(0, pos - 400):pos]) is not None


def blank_range(code, a, b):
    return code[:a] + "".join("\n" if ch == "\n" else " " for ch in code[a:b]) + code[b:]


def remove_test_modules(code):
    """Blank `#[cfg(test)] mod x { … }` blocks; return (code, test_child_names)
    where test_child_names are `#[cfg(test)] mod x;` declarations."""
    test_children = set()
    pos = 0
    while True:
        m = MOD_RE.search(code, pos)
        if not m:
            return code, test_children
        if is_cfg_test(code, m.start()):
            if m.group(2) == "{":
                end = matching_brace(code, m.end() - 1)
                code = blank_range(code, m.start(), end + 1)
                pos = end + 1
                continue
            test_children.add(m.group(1))
        pos = m.end()


def inline_modules(code):
    """[(start, end, name)] of inline `mod name { … }` blocks."""
    spans = []
    for m in MOD_RE.finditer(code):
        if m.group(2) == "{":
            spans.append((m.end() - 1, matching_brace(code, m.end() - 1), m.group(1)))
    return spans


def module_at(base, spans, pos):
    """Module path at offset pos: the file's module plus enclosing inline mods."""
    path = list(base)
    for start, end, name in spans:  # spans are in source order: outer first
        if start < pos <= end:
            path.append(name)
    return path


# ---------------------------------------------------------- use parsing ----

USE_RE = re.compile(r"(?<![A-Za-z0-9_$])use\s+")
TOKEN_RE = re.compile(r"\s*(::|\$crate|" + IDENT + r"|\{|\}|,|\*|;)")


def parse_use(code, start):
    """Parse the use tree starting at offset start (just after `use`).
    Returns (leaves, end) where leaves = [(segments, offset)]; `self` leaves
    are folded into their prefix and `*` leaves end at their prefix."""
    tokens = []
    pos = start
    while pos < len(code):
        m = TOKEN_RE.match(code, pos)
        if not m:
            # not a use declaration (e.g. `impl Trait + use<'a>`): ignore it
            return [], start
        tok = m.group(1)
        tokens.append((tok, m.start(1)))
        pos = m.end()
        if tok == ";":
            break
    leaves = []

    def tree(i, prefix):
        segs = list(prefix)
        seg_pos = None
        while i < len(tokens):
            tok, p = tokens[i]
            if tok == "::":
                i += 1
            elif tok == "{":
                i = group(i + 1, segs)
                return i
            elif tok == "*":
                leaves.append((segs, p))
                return i + 1
            elif tok in (",", "}", ";"):
                break
            elif tok == "as":
                i += 2  # skip the alias
            elif tok == "self" and prefix and len(segs) == len(prefix):
                seg_pos = p if seg_pos is None else seg_pos
                i += 1  # `{self, …}` means the prefix itself
            else:
                segs.append(tok)
                seg_pos = p if seg_pos is None else seg_pos
                i += 1
        if segs:
            leaves.append((segs, seg_pos if seg_pos is not None else tokens[max(i - 1, 0)][1]))
        return i

    def group(i, prefix):
        while i < len(tokens):
            tok = tokens[i][0]
            if tok == "}":
                return i + 1
            if tok == ",":
                i += 1
                continue
            if tok == ";":
                return i
            i = tree(i, prefix)
        return i

    tree(0, [])
    end = tokens[-1][1] + 1 if tokens else start
    return leaves, end


# ------------------------------------------------------------ resolution ----

PATH_RE = re.compile(
    r"(?<![A-Za-z0-9_$])(\$crate|crate|super|self)((?:\s*::\s*" + IDENT + r")+)"
)
VIS_IN_RE = re.compile(r"pub\s*\(\s*in\s+[^)]*\)")


def resolve(segments, here, modules):
    """Module path (tuple) of the deepest module file the path points into, or
    None if it does not start at crate/super/self."""
    if not segments:
        return None
    head = segments[0]
    if head in ("crate", "$crate"):
        cur, rest = [], segments[1:]
    elif head in ("self", "super"):
        cur, rest = list(here), segments
        while rest and rest[0] in ("self", "super"):
            if rest[0] == "super":
                if not cur:
                    return None
                cur.pop()
            rest = rest[1:]
    else:
        return None
    full = cur + list(rest)
    for k in range(len(full), -1, -1):
        if tuple(full[:k]) in modules:
            return tuple(full[:k])
    return None


# ------------------------------------------------------------- the crate ----

def crate_files(src):
    """{module path tuple: relative file path} for one crate's src dir."""
    modules = {}
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = sorted(d for d in dirnames if not (dirpath == src and d == "bin"))
        for f in sorted(filenames):
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), src).replace(os.sep, "/")
            parts = rel[:-3].split("/")
            if rel in ("lib.rs", "main.rs"):
                key = ()
            elif parts[-1] == "mod":
                key = tuple(parts[:-1])
            else:
                key = tuple(parts)
            if key in modules and key == ():
                # both lib.rs and main.rs: main.rs is a separate crate; keep lib
                if rel == "main.rs":
                    continue
            modules[key] = rel
    return modules


def scan_file(path, here):
    """[(module path tuple, line)] of every crate/super/self path in the file."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    code = strip_code(text)
    code, test_children = remove_test_modules(code)
    for m in VIS_IN_RE.finditer(code):
        code = blank_range(code, m.start(), m.end())
    spans = inline_modules(code)
    refs = []

    newlines = [k for k, ch in enumerate(code) if ch == "\n"]

    def line_of(pos):
        return bisect.bisect_left(newlines, pos) + 1

    # use declarations first; then blank them so their prefixes are not seen
    # again as shallower inline paths.
    uses = []
    for m in USE_RE.finditer(code):
        leaves, end = parse_use(code, m.end())
        where = module_at(here, spans, m.start())
        for segs, pos in leaves:
            refs.append((segs, where, line_of(pos)))
        uses.append((m.start(), end))
    for a, b in reversed(uses):
        code = blank_range(code, a, b)
    for m in PATH_RE.finditer(code):
        segs = [m.group(1)] + [s.strip() for s in m.group(2).split("::") if s.strip()]
        refs.append((segs, module_at(here, spans, m.start()), line_of(m.start())))
    return refs, test_children, ("#[path" in re.sub(r"\s", "", code))


def analyze_crate(src):
    """Return (files, edges) with edges = {(from_rel, to_rel): [lines]}."""
    modules = crate_files(src)
    edges = {}
    test_only = set()
    warnings = []
    for here, rel in sorted(modules.items(), key=lambda kv: kv[1]):
        refs, test_children, has_path = scan_file(os.path.join(src, rel), list(here))
        if has_path:
            warnings.append("%s: #[path] attribute is not supported" % rel)
        for child in test_children:
            test_only.add(here + (child,))
        for segs, where, line in refs:
            target = resolve(segs, where, modules)
            if target is None:
                continue
            if target[: len(here)] == here:
                continue  # itself or one of its own descendants
            key = (rel, modules[target])
            edges.setdefault(key, [])
            if line not in edges[key]:
                edges[key].append(line)
    # drop files that exist only as `#[cfg(test)] mod x;` (and their children)
    test_rels = {
        rel for key, rel in modules.items()
        if any(key[: len(t)] == t for t in test_only)
    }
    files = sorted(r for r in modules.values() if r not in test_rels)
    edges = {k: sorted(v) for k, v in edges.items()
             if k[0] not in test_rels and k[1] not in test_rels}
    return files, edges, warnings


def strongly_connected(nodes, edges):
    """Tarjan's algorithm (iterative). Returns a list of components."""
    succ = {n: [] for n in nodes}
    for a, b in edges:
        succ[a].append(b)
    index, low, on_stack, stack, comps = {}, {}, set(), [], []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on_stack.add(v)
            if i < len(succ[v]):
                work.append((v, i + 1))
                w = succ[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                comps.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return comps


def shortest_cycle(comp, edges):
    """A shortest cycle through the component's first file, as a node list."""
    inside = set(comp)
    start = comp[0]
    prev = {start: None}
    queue = [start]
    for v in queue:
        for (a, b) in sorted(edges):
            if a != v or b not in inside:
                continue
            if b == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if b not in prev:
                prev[b] = v
                queue.append(b)
    return comp


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    ap.add_argument("--edges", action="store_true", help="print every counted edge")
    args = ap.parse_args(argv)
    crates_dir = os.path.join(args.root, "crates")
    crates = sorted(
        d for d in os.listdir(crates_dir) if os.path.isdir(os.path.join(crates_dir, d, "src"))
    ) if os.path.isdir(crates_dir) else []
    n_files = n_circles = 0
    for crate in crates:
        src = os.path.join(crates_dir, crate, "src")
        files, edges, warnings = analyze_crate(src)
        n_files += len(files)
        for w in warnings:
            print("import_cycles: warning: crates/%s/src/%s" % (crate, w), file=sys.stderr)
        base = "crates/%s/src/" % crate
        if args.edges:
            for (a, b), lines in sorted(edges.items()):
                print("  edge %s%s -> %s  (lines %s)" % (base, a, b, ", ".join(map(str, lines))))
        for comp in strongly_connected(files, edges):
            if len(comp) < 2:
                continue
            n_circles += 1
            cyc = shortest_cycle(comp, edges)
            print("circle in %s: %s" % (crate, ", ".join(base + f for f in comp)))
            print("  e.g. " + " -> ".join(cyc))
            inside = set(comp)
            for (a, b), lines in sorted(edges.items()):
                if a in inside and b in inside:
                    print("  %s -> %s" % (a, b))
                    for ln in lines:
                        print("      %s%s:%d: %s" % (base, a, ln, source_line(os.path.join(src, a), ln)))
    print("import_cycles: %d crates, %d files, %d circle%s"
          % (len(crates), n_files, n_circles, "" if n_circles == 1 else "s"))
    return 1 if n_circles else 0


_LINES = {}


def source_line(path, ln):
    if path not in _LINES:
        with open(path, encoding="utf-8") as fh:
            _LINES[path] = fh.read().split("\n")
    lines = _LINES[path]
    return lines[ln - 1].strip() if 0 < ln <= len(lines) else ""


if __name__ == "__main__":
    sys.exit(main())
