"""Builds the CPU expert kernels (plain C loaded through ctypes, no Python or torch headers).

`optional=True`: on a machine without a C compiler the install still succeeds and the CPU expert
executor runs its torch path instead (engine/kernels/experts/cpu_gemv.py says which one is active).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "engine.kernels.experts._cpu_gemv", ["engine/kernels/experts/cpu_gemv.c", "engine/kernels/experts/thread_pool.c",
                                          "engine/kernels/experts/doorbell.c"],
    depends=["engine/kernels/experts/thread_pool.h"], extra_compile_args=["-O3", "-std=c11", "-pthread"],
    extra_link_args=["-pthread"], optional=True)])
