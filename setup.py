"""Builds offtensor's native extension, offtensor._C, against the torch already installed.

    pip install --no-build-isolation -e .      # torch must come from this environment, never from
                                               # an isolated build env (which would fetch another one)

- The C++ part (csrc/offtensor.cpp, csrc/policy.cpp, csrc/eviction.cpp, csrc/guesses.cpp,
  csrc/guess_records.cpp, csrc/bookkeeping.cpp) is always built.
- csrc/cuda/runtime.cu is compiled with nvcc and linked in (with -lcudart) when nvcc is found via
  CUDA_HOME, CUDA_PATH, PATH or /usr/local/cuda. That is decided from the toolkit, never from
  torch.cuda.is_available(): a GPU-less build machine must not silently drop the CUDA code.
  An nvcc without a usable libcudart.so beside it builds without the CUDA part, with a warning.
- OFFTENSOR_NO_CUDA=1 builds without the CUDA part; OFFTENSOR_NO_NATIVE=1 installs pure Python.
- OFFTENSOR_UNOPTIMISED_BUILD=1 compiles the C++ part without optimisation or debug information, in
  under half the time: for a throwaway build whose speed does not matter (benchmarks/native_errors.py's
  second build, which only checks that a refusal reaches Python), never for one that runs models.
"""

import os
import shutil
import subprocess
import warnings

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
CUDA_SOURCE = os.path.join("csrc", "cuda", "runtime.cu")
# runtime.cu's kernel (the expert pool's masked gather) is built as SASS for Ampere, Hopper and
# Blackwell, plus PTX of the newest so later GPUs can JIT it.
CUDA_ARCH_FLAGS = [
    "-gencode", "arch=compute_80,code=sm_80",
    "-gencode", "arch=compute_90,code=sm_90",
    "-gencode", "arch=compute_100,code=sm_100",
    "-gencode", "arch=compute_120,code=sm_120",
    "-gencode", "arch=compute_120,code=compute_120",
]


def env_flag(name):
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def find_cuda():
    """(toolkit dir, libcudart dir) to compile and link runtime.cu with, or None to build without CUDA."""
    if env_flag("OFFTENSOR_NO_CUDA"):
        return None
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:  # may be a wrapper script outside the toolkit, so this candidate can be incomplete
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    for home in filter(None, candidates):
        if not os.path.isfile(os.path.join(home, "bin", "nvcc")):
            continue
        for sub in ("lib64", os.path.join("targets", "x86_64-linux", "lib"), "lib"):
            lib_dir = os.path.join(home, sub)
            if os.path.exists(os.path.join(lib_dir, "libcudart.so")):
                return home, lib_dir
    if nvcc:
        # Still a working extension, only without exact-size pinned memory and the native GPU copy
        # engine (_ext.py then warns once at import and uses torch's): better than no build at all.
        warnings.warn(f"offtensor: nvcc is on PATH ({nvcc}) but no CUDA toolkit with libcudart.so was found in "
                      f"{[c for c in candidates if c]}, so offtensor._C is built WITHOUT its CUDA part. Set CUDA_HOME "
                      "to a complete toolkit to build it, or OFFTENSOR_NO_CUDA=1 to silence this warning.")
        print("offtensor: building without the CUDA part: no usable libcudart.so next to nvcc", flush=True)
    return None


def native_build():
    """(ext_modules, cmdclass) for offtensor._C."""
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as error:
        raise RuntimeError(
            "offtensor's native extension builds against the installed torch, but torch cannot be imported "
            f"({error}). Install torch first and run `pip install --no-build-isolation -e .`, "
            "or set OFFTENSOR_NO_NATIVE=1 for a pure-Python install.") from error

    cuda = find_cuda()
    kwargs = {}
    if cuda:
        lib_dir = cuda[1]
        kwargs = dict(
            define_macros=[("OFFTENSOR_WITH_CUDA", None)],
            library_dirs=[lib_dir],
            libraries=["cudart"],
            # Find libcudart without LD_LIBRARY_PATH. A CUDA build of torch loads its own
            # libcudart first, and the loader then reuses it for us (same soname).
            extra_link_args=[f"-Wl,-rpath,{lib_dir}"],
        )
    extension = CppExtension(
        "offtensor._C",
        [os.path.join("csrc", name) for name in ("offtensor.cpp", "policy.cpp", "eviction.cpp", "guesses.cpp", "guess_records.cpp", "bookkeeping.cpp")],
        # Last on the command line, so these win over Python's own "-g -O3".
        extra_compile_args=["-O0", "-g0"] if env_flag("OFFTENSOR_UNOPTIMISED_BUILD") else ["-O2"],
        **kwargs,
    )

    class BuildWithCuda(BuildExtension):
        """Compiles runtime.cu with nvcc (no torch headers involved) and links the object in."""

        def build_extensions(self):
            if cuda:
                # nvcc runs beside the C++ compile (each takes a core; ~15 s saved on a 2-core
                # machine) and the link waits for it.
                obj, nvcc = self.start_cuda_runtime(cuda[0])
                for ext in self.extensions:
                    ext.extra_objects = [*ext.extra_objects, obj]
                link = self.compiler.link_shared_object

                def link_after_nvcc(*args, **kwargs):
                    if nvcc is not None and nvcc.wait() != 0:
                        raise subprocess.CalledProcessError(nvcc.returncode, nvcc.args)
                    return link(*args, **kwargs)

                self.compiler.link_shared_object = link_after_nvcc
            super().build_extensions()

        def start_cuda_runtime(self, home):
            """(object file, the nvcc process compiling it, or None when it is up to date)."""
            os.makedirs(self.build_temp, exist_ok=True)
            obj = os.path.join(self.build_temp, "offtensor_cuda_runtime.o")
            sources = [os.path.join(ROOT, CUDA_SOURCE), os.path.join(ROOT, "csrc", "cuda", "runtime.h")]
            if os.path.exists(obj) and all(os.path.getmtime(obj) >= os.path.getmtime(s) for s in sources):
                return obj, None
            command = [os.path.join(home, "bin", "nvcc"), "-c", sources[0], "-o", obj,
                       "-Xcompiler", "-fPIC,-fvisibility=hidden", "-O2", "-std=c++17", *CUDA_ARCH_FLAGS]
            print("offtensor: " + " ".join(command), flush=True)
            return obj, subprocess.Popen(command)

    return [extension], {"build_ext": BuildWithCuda}


if env_flag("OFFTENSOR_NO_NATIVE"):
    ext_modules, cmdclass = [], {}
else:
    ext_modules, cmdclass = native_build()

setup(ext_modules=ext_modules, cmdclass=cmdclass)
