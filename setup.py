"""Build the native core: every ``native/<name>.c`` becomes ``tierstore._native_<name>``.

The libraries use only gcc, libc and the Python headers (no liburing, no libaio). They are plain C
loaded with ctypes (which releases the GIL around every call); each also defines an empty module
init so that the import system can locate the built file.
"""
import glob
import os

from setuptools import Extension, setup

here = os.path.dirname(os.path.abspath(__file__))
extensions = []
for src in sorted(glob.glob(os.path.join(here, "native", "*.c"))):
    name = os.path.splitext(os.path.basename(src))[0]
    extensions.append(
        Extension(
            f"tierstore._native_{name}",
            sources=[os.path.relpath(src, here)],
            depends=glob.glob(os.path.join("native", "*.h")),
            extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-pthread"],
            extra_link_args=["-pthread"],
        )
    )

setup(ext_modules=extensions)
