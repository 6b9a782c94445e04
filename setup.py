"""Build the Cython kernels.

Flags are part of the numeric contract (ARCHITECTURE §5.4): -ffp-contract=off keeps the
float32 chains unfused, and nothing may enable -ffast-math.  The build is portable by
default; K3_NATIVE=1 opts into -march=native (same bits: orders are fixed in the source).
"""
import os

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

compile_args = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno"]
if os.environ.get("K3_NATIVE") == "1":
    compile_args.append("-march=native")


def kernel_ext(name: str) -> Extension:
    return Extension(
        f"k3engine.kernels.{name}",
        sources=[f"engine/k3engine/kernels/{name}.pyx"],
        include_dirs=[np.get_include(), "engine/k3engine/kernels"],
        extra_compile_args=compile_args,
        extra_link_args=["-fopenmp"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )


# _k3z: the compressed trunk's block codec, _k3io: the native reader threads (modules of
# their own: they are I/O, not part of the forward pass's numeric contract).
exts = [kernel_ext("_kernels"), kernel_ext("_k3z"), kernel_ext("_k3io")]

setup(
    ext_modules=cythonize(
        exts,
        compiler_directives={
            "language_level": 3,
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
        },
    )
)
