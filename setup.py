"""The C block table (kvoffload/_table.c). Everything else about the
package is in pyproject.toml; an extension module is declared here, the
stable place for it (setuptools calls ``ext-modules`` in pyproject.toml
experimental)."""

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
        )
    ]
)
