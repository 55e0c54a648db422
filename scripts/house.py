"""The house at a revision: the package's largest files and definitions, its docstrings of
eight lines or more, and the README's length, for before/after notes on the layout.

    python scripts/house.py [REV ...]     (default: HEAD)
"""
from __future__ import annotations

import ast
import subprocess
import sys


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def house(rev: str) -> str:
    files = [f for f in _git("ls-tree", "-r", "--name-only", rev, "kvprof").split()
             if f.endswith(".py")]
    sizes, defs, long_docs = [], [], 0
    for f in files:
        src = _git("show", f"{rev}:{f}")
        sizes.append((src.count("\n"), f))
        tree = ast.parse(src)
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defs.append((node.end_lineno - node.lineno + 1, f"{f}:{node.name}"))
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef,
                                 ast.ClassDef)) and ast.get_docstring(node) is not None:
                first = node.body[0]
                long_docs += first.end_lineno - first.lineno + 1 >= 8
    sizes.sort(reverse=True)
    defs.sort(reverse=True)
    readme = _git("show", f"{rev}:README.md").count("\n")
    return "\n".join([
        f"{rev}: {len(files)} modules, {sum(n for n, _ in sizes)} lines, {long_docs} docstrings "
        f"of 8+ lines, README {readme} lines",
        "  largest files: " + ", ".join(f"{f} {n}" for n, f in sizes[:6]),
        "  largest definitions: " + ", ".join(f"{f} {n}" for n, f in defs[:6])])


if __name__ == "__main__":
    print("\n".join(house(rev) for rev in sys.argv[1:] or ["HEAD"]))
