"""What users' type checkers see: ``kvoffload`` ships ``py.typed``, and the C
block table a stub (``kvoffload/_table.pyi``) that says what the pure-Python
table's signatures say."""

from __future__ import annotations

import ast
import inspect
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvoffload
from kvoffload.table import PyBlockTable

PACKAGE = Path(kvoffload.__file__).parent


def _stub_methods() -> dict[str, ast.FunctionDef]:
    tree = ast.parse((PACKAGE / "_table.pyi").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BlockTable"]
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def _stub_signature(fn: ast.FunctionDef) -> list[tuple[str, str, str | None, str | None]]:
    """(kind, name, annotation, default) of each parameter after self."""
    a = fn.args
    out = []
    positional = [("POSITIONAL_ONLY", p) for p in a.posonlyargs]
    positional += [("POSITIONAL_OR_KEYWORD", p) for p in a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for (kind, p), d in zip(positional, defaults, strict=True):
        out.append((kind, p.arg, p.annotation, d))
    for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        out.append(("KEYWORD_ONLY", p.arg, p.annotation, d))
    return [
        (k, n, ast.unparse(t) if t else None, ast.unparse(d) if d else None)
        for k, n, t, d in out[1:]
    ]


def _py_signature(name: str) -> list[tuple[str, str, str | None, str | None]]:
    sig = inspect.signature(getattr(PyBlockTable, name))
    return [
        (
            p.kind.name,
            p.name,
            None if p.annotation is p.empty else str(p.annotation),
            None if p.default is p.empty else repr(p.default),
        )
        for p in list(sig.parameters.values())[1:]
    ]


def test_the_stub_declares_what_the_python_table_defines() -> None:
    stub = _stub_methods()
    public = {n for n, v in vars(PyBlockTable).items() if callable(v) and not n.startswith("_")} | {
        "__len__",
        "__contains__",
    }
    properties = {
        name
        for name, fn in stub.items()
        if any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list)
    }
    assert {"pinned", "in_flight", "walked", "window_uses", "holds"} <= properties
    for name in properties:  # attributes of the reference
        assert hasattr(PyBlockTable(), name), name
    assert set(stub) - {"__init__", "_check"} - properties == public
    for name in sorted(public):
        assert _stub_signature(stub[name]) == _py_signature(name), name
        assert (
            ast.unparse(stub[name].returns)
            == inspect.signature(  # type: ignore[arg-type]
                getattr(PyBlockTable, name)
            ).return_annotation
        ), name


def test_the_c_table_has_what_the_stub_declares() -> None:
    from kvoffload._table import BlockTable

    assert set(_stub_methods()) - {"_check"} <= set(dir(BlockTable))


def test_a_type_checker_sees_the_api_of_an_installed_kvoffload(tmp_path: Path) -> None:
    """The package as a wheel installs it (its ``.py``, ``.pyi`` and
    ``py.typed`` files), found on the path as an installed package: mypy
    types the C table from the stub and catches a misuse."""
    pytest.importorskip("mypy")
    site = tmp_path / "site"
    shutil.copytree(
        PACKAGE, site / "kvoffload", ignore=shutil.ignore_patterns("*.so", "__pycache__")
    )
    user = tmp_path / "user.py"
    user.write_text(
        "from kvoffload.policies import TouchRules\n"
        "from kvoffload.table import BlockTable\n"
        "t = BlockTable()\n"
        "t.set_touch_rules(TouchRules(ready={0: 1}))\n"
        "reveal_type(t.evict(0, 2, (), b=1))\n"
        "t.evict(0, 2, (), 1)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(user)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300, check=False,
    )  # fmt: skip
    out = done.stdout
    assert (
        'Revealed type is "tuple[list[kvoffload.abstract.BlockHash], list[Any], int] | None"' in out
    )
    assert "user.py:6: error: Too many positional arguments" in out
    assert "Found 1 error" in out, out
