"""Compile and load a C++ kernel of ours as torch ops, once per machine.

The kernels are built for the CPU they run on (`-march=native`: AVX512-VNNI where it exists),
so the build is cached under a key of the source, the torch version and the CPU's flags: a
cache shared by different machines never loads a binary built for another CPU. The first
build takes 10-20 s (torch's headers); later loads take milliseconds. Ranks
starting together build once: an flock on the build directory makes the others wait, and
since the kernel releases an flock when its holder dies, a build killed half-way (a worker
lost, a test interrupted) cannot leave a lock that hangs every later start, as torch's own
lock file would.

Where no compiler is found the build fails with KernelUnavailable and the caller falls back
to a torch format (the weight format says so in a warning).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

import torch

_HERE = Path(__file__).parent


class KernelUnavailable(RuntimeError):
    pass


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cache_root() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec")) / "kernels"


def _key(source: Path) -> str:
    h = hashlib.sha256()
    h.update(source.read_bytes())
    h.update(torch.__version__.encode())
    h.update(_cpu_flags().encode())
    h.update(sys.version.encode())
    return h.hexdigest()[:16]


def _private_dir(path: Path) -> Path:
    """`path`, created owner-only, refused if anyone else could have put code in it: a
    shared library found here is loaded into the process, so a directory owned by another
    user, or writable by group or others, could hand us theirs. Directories it creates are
    owner-only whatever the umask (under umask 002 a parent would otherwise come out
    group-writable, and be refused)."""
    missing = []
    d = path
    while not d.exists():
        missing.append(d)
        d = d.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True, mode=0o700)
        os.chmod(d, 0o700)  # mkdir's mode is masked by the umask
    for d in (path, path.parent):
        st = d.stat()
        if st.st_uid != os.getuid():
            raise KernelUnavailable(f"the kernel cache {d} belongs to uid {st.st_uid}, not to "
                                    "this user: not loading code from it (set SPECDEC_CACHE "
                                    "to a directory of your own)")
        if st.st_mode & 0o022:
            raise KernelUnavailable(f"the kernel cache {d} is writable by others (mode "
                                    f"{st.st_mode & 0o777:o}): not loading code from it "
                                    f"(chmod go-w {d})")
    return path


@functools.cache
def load(name: str) -> None:
    """Build (or find built) kernels/<name>.cpp and register its ops with torch."""
    source = _HERE / f"{name}.cpp"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise KernelUnavailable(f"no C++ compiler to build the {name} kernel")
    build_dir = _private_dir(_cache_root()) / f"{name}-{_key(source)}"
    build_dir.mkdir(exist_ok=True, mode=0o700)
    # ninja comes with the package (PyPI's wheel puts it beside this interpreter), which a
    # Ray worker's PATH may not include.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    from torch.utils import cpp_extension

    built = any(build_dir.glob(f"{name}*.so"))
    if not built:
        print(f"specdec: building the {name} kernel for this CPU (once, ~15 s) in {build_dir}",
              file=sys.stderr, flush=True)
    t = time.monotonic()
    with _build_lock(build_dir):
        _build(name, source, build_dir, cpp_extension)
    if not built:
        print(f"specdec: {name} kernel built in {time.monotonic() - t:.0f} s",
              file=sys.stderr, flush=True)


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """Held while torch builds or loads in `build_dir`. torch's own lock (a file named `lock`,
    created and removed around its build) stays behind when its holder is killed, and every
    later load then waits on it forever. Every builder takes this flock first, so a `lock`
    file found while holding it belongs to no live builder: it is removed."""
    with open(build_dir / "build.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                print(f"specdec: removing {stale}, left by a build that did not finish",
                      file=sys.stderr, flush=True)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(name: str, source: Path, build_dir: Path, cpp_extension) -> None:
    try:
        cpp_extension.load(
            name=name, sources=[str(source)], build_directory=str(build_dir),
            # -fopenmp: at::parallel_for's region; the library links libgomp.so.1, which
            # resolves to the copy torch already loaded (one thread pool, not two).
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as e:  # compiler errors, missing headers, no ninja
        raise KernelUnavailable(f"the {name} kernel did not build: {e}") from e


@functools.cache
def kquant():
    """torch.ops.specdec_kquant (the Q4_K and Q6_K linears), built for this CPU on first use
    (KernelUnavailable if it cannot be)."""
    load("kquant_linear")
    return torch.ops.specdec_kquant


def kquant_available() -> bool:
    """The kernels built here, in their SIMD form (AVX512-VNNI): elsewhere their scalar form
    is correct but slower than FBGEMM's int8, so the formats stand back."""
    try:
        return bool(kquant().simd())
    except KernelUnavailable:
        return False


@functools.cache
def attention():
    """torch.ops.specdec_attention (each token attending alone over its own slot), built for
    this CPU on first use (KernelUnavailable if it cannot be)."""
    load("token_attention")
    return torch.ops.specdec_attention


@functools.cache
def rows():
    """torch.ops.specdec_rows (row-parallel elementwise ops a batch-invariant model needs),
    built for this CPU on first use (KernelUnavailable if it cannot be)."""
    load("row_ops")
    return torch.ops.specdec_rows


@functools.cache
def race():
    """torch.ops.specdec_race (the seeded race: specdec/model/step/seeded.py), built for this CPU on
    first use (KernelUnavailable if it cannot be)."""
    load("seeded_race")
    return torch.ops.specdec_race
