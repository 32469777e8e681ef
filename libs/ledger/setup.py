"""The compiled core of the ledger (``cortex.ledger._core``); everything else is in
pyproject.toml. Plain C against the CPython API: the build needs a C compiler and Python's
headers only (no numpy headers, no Cython, nothing from the network).

Optional: without a compiler the install still succeeds and the trees run on the pure-Python
core, with a loud warning at import (``cortex.ledger.cores``); the ledger tests' native half
then fails, so CI cannot miss it."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "cortex.ledger._core",
            ["cortex/ledger/_core.c"],
            depends=["cortex/ledger/_wire.h", "cortex/ledger/_keymap.h",
                     "cortex/ledger/_sync.h", "cortex/ledger/_kvdecode.h",
                     "cortex/ledger/_blockkeys.h"],
            optional=True,
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-Wno-missing-field-initializers", "-Wno-cast-function-type"],
        )
    ]
)
