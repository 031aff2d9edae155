"""The C extensions: the block table (kvoffload/_table.c) and the CPU row
copier (kvoffload/transfer/_rows.c). Everything else about the package is in
pyproject.toml; extension modules are declared here, the stable place for
them (setuptools calls ``ext-modules`` in pyproject.toml experimental)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvoffload._table",
            sources=["kvoffload/_table.c"],
            # without a compiler the install still succeeds and
            # kvoffload.table falls back to PyBlockTable, with a warning
            optional=True,
            extra_compile_args=["-O2", "-Wall", "-Wextra"],
        ),
        Extension(
            "kvoffload.transfer._rows",
            sources=["kvoffload/transfer/_rows.c"],
            # without it host_copy copies rows in a Python loop (slower at
            # small rows: docs/transfer.md)
            optional=True,
            extra_compile_args=["-O2", "-Wall", "-Wextra"],
        ),
    ]
)
