#!/usr/bin/env python3
"""Finds modules that import each other, directly or around a loop, in every crate of the
workspace, and fails when it finds any.

A module's imports are the paths it names (`use` declarations and paths in code) that lead into
another module of the same crate: `crate::a::b`, `super::x`, `self::x`, or a child's name. A
module's `mod` and `pub use` lines make it a facade, not a dependent, so they are not imports, and
a path to an item a module re-exports counts as a path to the module that defines it.
`#[cfg(test)]` modules are left out (a test module may use what it tests).

Usage: scripts/module-cycles.py [workspace root]   (prints each cycle; exit 1 if any)
       scripts/module-cycles.py --self-test        (the checker finds planted cycles)
"""

import re
import sys
from pathlib import Path

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
PUB_USE = r"(?m)^\s*(?:#\[[^\]]*\]\s*)*pub(?:\([^)]*\))?\s+use\s+([^;]+);"


def strip_comments_and_strings(text):
    """Code without comments, string and char literals (so braces and paths in them vanish)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif c == "r" and re.match(r'r#*"', text[i:i + 10]) and (i == 0 or not re.match(r"\w", text[i - 1])):
            hashes = re.match(r'r(#*)"', text[i:]).group(1)
            end = text.find('"' + hashes, i + 2 + len(hashes))
            i = n if end < 0 else end + 1 + len(hashes)
            out.append('""')
        elif c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
            out.append('""')
        elif c == "'" and re.match(r"'(\\.|[^\\'])'|'\\u\{[0-9a-fA-F]+\}'|'\\x..'", text[i:i + 12]):
            m = re.match(r"'(\\.|[^\\'])'|'\\u\{[0-9a-fA-F]+\}'|'\\x..'", text[i:i + 12])
            i += len(m.group(0))
            out.append("' '")
        else:
            out.append(c)
            i += 1
    return "".join(out)


def drop_test_modules(code):
    """Removes `#[cfg(test)] mod name { ... }` blocks."""
    while True:
        m = re.search(r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod\s+" + IDENT + r"\s*\{", code)
        if not m:
            return code
        depth, i = 1, m.end()
        while i < len(code) and depth:
            depth += {"{": 1, "}": -1}.get(code[i], 0)
            i += 1
        code = code[: m.start()] + code[i:]


class Crate:
    def __init__(self, root_file):
        self.src = root_file.parent
        self.modules = {}  # path tuple -> code
        self.files = {}  # path tuple -> file
        self.load((), root_file)

    def load(self, path, file):
        code = drop_test_modules(strip_comments_and_strings(file.read_text()))
        self.modules[path] = code
        self.files[path] = file
        own_dir = file.parent if file.name in ("lib.rs", "main.rs", "mod.rs") or not path else file.parent / file.stem
        for m in re.finditer(r"(?:#\[[^\]]*\]\s*)*\bmod\s+(" + IDENT + r")\s*;", code):
            name = m.group(1)
            attrs = re.search(r'#\[path\s*=\s*""\]', m.group(0))
            for cand in (own_dir / f"{name}.rs", own_dir / name / "mod.rs"):
                if cand.exists() and not attrs:
                    self.load(path + (name,), cand)
                    break

    def reexports(self):
        """Names each module re-exports: module -> {name: module path defining it}."""
        out = {}
        for here, code in self.modules.items():
            names = out.setdefault(here, {})
            for m in re.finditer(PUB_USE, code):
                self.expand_use(here, m.group(1), lambda name, target: names.setdefault(name, target))
        return out

    def expand_use(self, here, tree, emit, prefix=()):
        """Calls emit(last name, module path) for each leaf of a use tree."""
        tree = tree.strip()
        m = re.match(r"^(.*?)::\{(.*)\}$", tree, re.S)
        if m:
            base = tuple(p for p in m.group(1).split("::") if p)
            for part in split_top(m.group(2)):
                self.expand_use(here, part, emit, prefix + base)
            return
        if tree.startswith("{") and tree.endswith("}"):
            for part in split_top(tree[1:-1]):
                self.expand_use(here, part, emit, prefix)
            return
        tree = re.sub(r"\s+as\s+" + IDENT + "$", "", tree)
        segs = prefix + tuple(s for s in tree.split("::") if s)
        target = self.resolve(here, segs)
        if target is not None:
            emit(segs[-1], target)

    def resolve(self, here, segs):
        """The module a path from module `here` leads into, or None (another crate, a std
        item)."""
        if not segs:
            return None
        if segs[0] == "crate":
            base, rest = (), segs[1:]
        elif segs[0] == "super":
            base, rest = here, segs
            while rest and rest[0] == "super":
                base, rest = base[:-1], rest[1:]
        elif segs[0] == "self":
            base, rest = here, segs[1:]
        elif here + (segs[0],) in self.modules:
            base, rest = here, segs
        else:
            return None
        path = base
        for s in rest:
            if path + (s,) in self.modules:
                path = path + (s,)
            else:
                break
        return path


def split_top(s):
    parts, depth, cur = [], 0, []
    for c in s:
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        depth += {"{": 1, "}": -1}.get(c, 0)
        cur.append(c)
    parts.append("".join(cur))
    return [p for p in (x.strip() for x in parts) if p and p != "self"]


def edges(crate):
    reexp = crate.reexports()
    out = {m: set() for m in crate.modules}
    for here, code in crate.modules.items():
        # Facade lines are not imports.
        code = re.sub(PUB_USE, "", code)

        def add(target, name=None):
            seen = set()
            while target is not None and name in reexp.get(target, {}) and target not in seen:
                seen.add(target)
                target = reexp[target][name]
            if target is None or target == here:
                return
            out[here].add(target)
        for m in re.finditer(r"\buse\s+([^;]+);", code):
            crate.expand_use(here, m.group(1), lambda name, t: add(t, name))
        for m in re.finditer(r"\b((?:crate|super|self)(?:::" + IDENT + r")+)", code):
            segs = tuple(m.group(1).split("::"))
            target = crate.resolve(here, segs)
            # The first name past the modules: an item, perhaps one the module re-exports.
            depth = len(target) - len(crate.resolve(here, segs[:1]) or ())
            rest = segs[1 + depth:]
            add(target, rest[0] if rest else None)
    return out


def cycles(graph):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def name(crate_name, path):
    return "::".join((crate_name,) + path) if path else crate_name


def check(root):
    """Prints every cycle; returns how many there are."""
    members = re.search(r"members\s*=\s*\[([^\]]*)\]", (root / "Cargo.toml").read_text()).group(1)
    new = 0
    for member in re.findall(r'"([^"]+)"', members):
        for entry in ("src/lib.rs", "src/main.rs"):
            f = root / member / entry
            if not f.exists():
                continue
            crate = Crate(f)
            graph = edges(crate)
            for comp in cycles(graph):
                new += 1
                mods = ", ".join(name(member, p) for p in comp)
                print(f"{member}/{entry}: modules that import each other: {mods}")
                for a in comp:
                    back = sorted(b for b in graph[a] if b in comp)
                    print(f"    {name(member, a)} -> {', '.join(name(member, b) for b in back)}")
    return new


def self_test():
    """Plants cycles the checker must find, and facades it must not mistake for cycles."""
    import tempfile

    cases = {
        # A module and its child importing each other through `super`.
        "parent_child": ({"lib.rs": "mod a;", "a.rs": "mod b;\nuse b::Y;\npub struct X;",
                          "a/b.rs": "use super::X;\npub struct Y;"}, 1),
        # Around a loop of three, through a grouped `use crate::{...}` and a path in code.
        "three": ({"lib.rs": "mod a; mod b; mod c;", "a.rs": "use crate::{b::B};\npub struct A;",
                   "b.rs": "pub struct B;\nfn f() { crate::c::g(); }",
                   "c.rs": "use crate::a::A;\npub fn g() {}"}, 1),
        # A facade's re-exports are not imports, and paths through them reach the definer.
        "facade": ({"lib.rs": "mod a; mod b;\npub use a::A;\npub use b::B;",
                    "a.rs": "pub struct A;", "b.rs": "use crate::A;\npub struct B;"}, 0),
        # A test module using its parent is not a cycle; a string or comment naming one neither.
        "tests": ({"lib.rs": "mod a; mod b;",
                   "a.rs": "// use crate::b::B;\nconst S: &str = \"crate::b::B\";\n"
                           "#[cfg(test)]\nmod tests { use crate::b::B; }",
                   "b.rs": "use crate::a::S;\npub struct B;"}, 0),
    }
    failed = 0
    for case, (files, want) in cases.items():
        with tempfile.TemporaryDirectory() as d:
            root = Path(d)
            (root / "Cargo.toml").write_text('[workspace]\nmembers = ["k"]\n')
            for rel, text in files.items():
                f = root / "k" / "src" / rel
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_text(text)
            got = len(cycles(edges(Crate(root / "k" / "src" / "lib.rs"))))
            if got != want:
                print(f"self-test {case}: {got} cycle(s), expected {want}")
                failed += 1
    print("self-test: " + ("failed" if failed else "every planted cycle found, no false one"))
    return 1 if failed else 0


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    new = check(Path(sys.argv[1] if len(sys.argv) > 1 else "."))
    if new:
        print(f"{new} import cycle(s): break them (the crate map in README.md says which way each crate points)")
        return 1
    print("no module imports a module that imports it back")
    return 0


if __name__ == "__main__":
    sys.exit(main())
