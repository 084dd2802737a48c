"""Code shape per package: lines, functions, median/p90 function body length, the long ones.

    python bench/code_shape.py [SRC_DIR] [--long]

Body lines of a function: from its first statement after the docstring to its last line
(nested functions count inside their parent and again on their own). Stdlib only; seeded by
nothing because nothing is random. One line per package, then a total line.
"""

from __future__ import annotations

import argparse
import ast
import statistics
from dataclasses import dataclass
from pathlib import Path

LONG_FUNCTION = 40
LONG_MODULE = 400


@dataclass(frozen=True, slots=True)
class Function:
    module: str
    name: str
    body_lines: int


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = node.body
    if (
        len(body) > 1
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]
    end = node.end_lineno or body[-1].lineno
    return end - body[0].lineno + 1


def functions(path: Path, root: Path) -> list[Function]:
    tree = ast.parse(path.read_text(), str(path))
    rel = str(path.relative_to(root))
    return [
        Function(rel, n.name, body_lines(n))
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
    ]


def package_of(path: Path, root: Path) -> str:
    parts = path.relative_to(root).parts
    return parts[0] if len(parts) > 1 else "(top)"


def p90(values: list[int]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) > 1 else float(values[0])


def summary(name: str, files: list[Path], root: Path) -> str:
    lengths = [f.body_lines for p in files for f in functions(p, root)]
    lines = sum(len(p.read_text().splitlines()) for p in files)
    long = sum(1 for n in lengths if n > LONG_FUNCTION)
    return (
        f"{name:<10} files={len(files):3d} lines={lines:6d} functions={len(lengths):4d} "
        f"median={statistics.median(lengths):4.1f} p90={p90(lengths):5.1f} over{LONG_FUNCTION}={long}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("src", nargs="?", default="src/kvfence")
    ap.add_argument("--long", action="store_true", help="list long modules and functions")
    args = ap.parse_args()
    root = Path(args.src)
    files = sorted(root.rglob("*.py"))
    packages: dict[str, list[Path]] = {}
    for p in files:
        packages.setdefault(package_of(p, root), []).append(p)
    for name in sorted(packages):
        print(summary(name, packages[name], root))
    print(summary("TOTAL", files, root))
    if args.long:
        for p in files:
            n = len(p.read_text().splitlines())
            if n > LONG_MODULE:
                print(f"module   {n:4d} lines  {p.relative_to(root)}")
        for p in files:
            for f in functions(p, root):
                if f.body_lines > LONG_FUNCTION:
                    print(f"function {f.body_lines:4d} body   {f.module}:{f.name}")


if __name__ == "__main__":
    main()
