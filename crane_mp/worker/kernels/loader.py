"""Compile and load the native CPU kernels for one instruction-set tier (see cpu_isa.py, which decides).

Each tier is compiled with explicit flags (never -march=native) under its own name, which also holds
the compiler's identity and a digest of everything in the build command: sources, flags, compiler,
torch version and the environment's include and library paths. So one cache directory can be shared
by every machine, user and virtual environment of a host image: an AVX2 CPU never loads code built
for AMX, a new compiler or torch rebuilds instead of loading a stale library, and two environments
taking turns each keep their own build.

Compiling needs a C++ compiler and ninja; without them, or if the build fails, build_kernels
returns False and says why in the log. The build runs the environment's own ninja (the `ninja` package
installed with crane-mp) whatever PATH the server was started with: two ninja versions read each
other's build log as every command changed, so a server started alternately from an activated virtual
environment and from a system PATH with its own ninja recompiled everything (a minute) at each start.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import shutil
import stat
import subprocess
import sysconfig
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from crane_mp.config import cache_root

log = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "paged_decode_attention.cpp", "fused_elementwise.cpp", "qkv_rope_cache.cpp", "argmax.cpp", "amx_linear.cpp",
        "gguf_matmul.cpp", "gguf_int8.cpp", "gguf_repack.cpp", "gguf_tiles.cpp", "bf16_linear.cpp", "gated_delta.cpp",
        "prompt_attention.cpp", "widened_linear.cpp",
    )
]
_HEADERS = [
    Path(__file__).with_name(name)
    for name in ("cpu_vec.h", "gguf_blocks.h", "gguf_int8.h", "packed_rows.h", "tile_state.h")
]

_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mprefer-vector-width=512"]
_AVX512_BF16 = [*_AVX512, "-mavx512bf16", "-mavx512vnni"]
TIER_FLAGS = {
    "avx2": _AVX2,
    "avx512": _AVX512,
    "avx512_bf16": _AVX512_BF16,
    "amx": [*_AVX512_BF16, "-mamx-tile", "-mamx-bf16", "-mamx-int8"],
}
# -fopenmp makes at::parallel_for parallel; the loader reuses the libgomp torch already loaded.
_COMMON_FLAGS = ["-O3", "-fopenmp", "-ffast-math"]


@lru_cache(maxsize=1)
def compiler_identity() -> tuple[str, str] | None:
    """(short tag for file names, full version line) of the compiler torch will call, or None."""
    compiler = os.environ.get("CXX", "c++")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    line = version.stdout.splitlines()[0] if version.stdout else compiler
    family = "clang" if "clang" in line else ("gcc" if "Free Software Foundation" in version.stdout else "cxx")
    number = re.search(r"\d+(\.\d+)+", line)
    return f"{family}{number.group(0).replace('.', '_') if number else ''}", line


def ninja_dir() -> str | None:
    """The directory of the `ninja` package's executable, None without the package (PATH's ninja then)."""
    try:
        import ninja
    except ImportError:
        return None
    return ninja.BIN_DIR if (Path(ninja.BIN_DIR) / "ninja").exists() else None


def _build_env_path() -> str:
    """PATH for the build: the package's ninja first."""
    path = os.environ.get("PATH", os.defpath)
    own = ninja_dir()
    return path if own is None else os.pathsep.join([own, path])


@lru_cache(maxsize=1)
def ninja_version() -> str:
    """The version of the ninja the build runs ("" when there is none): builds of two versions never
    share a directory, whose build log each would read as stale."""
    try:
        found = shutil.which("ninja", path=_build_env_path())
        return subprocess.run([found, "--version"], capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip() if found else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def build_name(tier: str, compiler_tag: str, compiler_line: str) -> str:
    digest = hashlib.sha256()
    for path in _SOURCES + _HEADERS:
        digest.update(path.read_bytes())
    digest.update(" ".join([*TIER_FLAGS[tier], *_COMMON_FLAGS, compiler_line, torch.__version__, ninja_version(),
                            *build_paths()]).encode())
    return f"crane_mp_cpu_{tier}_{compiler_tag}_{digest.hexdigest()[:12]}"


def build_paths() -> list[str]:
    """The paths torch writes into the build file (its headers and libraries, Python's headers). Two
    environments of the same torch differ only here: sharing one build directory, each start after
    the other's would find a changed build file and recompile everything."""
    from torch.utils.cpp_extension import include_paths, library_paths

    return [*include_paths(), *library_paths(), sysconfig.get_paths()["include"]]


def kernel_cache_dir() -> Path | None:
    """<CRANE_MP_CACHE>/kernels, or a private temporary directory when that is not writable or not
    safely ours (a service user without a home, a read-only image, a shared path); None when neither
    can be used safely."""
    preferred = cache_root() / "kernels"
    try:
        preferred.mkdir(parents=True, exist_ok=True)
        if os.access(preferred, os.W_OK | os.X_OK) and _owned_by_us(preferred, 0o022):
            return preferred
    except OSError:
        pass
    fallback = Path(tempfile.gettempdir()) / f"crane-mp-kernels-{os.getuid()}"
    try:
        fallback.mkdir(mode=0o700, exist_ok=True)
        private = _owned_by_us(fallback, 0o077)
    except OSError:
        return None
    return fallback if private else None


def _owned_by_us(path: Path, forbidden_mode: int) -> bool:
    """Libraries are loaded from the cache: a directory another user owns, or one others may write
    (`forbidden_mode` bits), could hold a planted library, which would run inside the worker."""
    info = path.lstat()
    if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & forbidden_mode:
        return True
    log.warning("%s is not this user's own directory (owner uid %d, mode %o); not building kernels there",
                path, info.st_uid, stat.S_IMODE(info.st_mode))
    return False


def _staged_sources(build_dir: Path) -> list[str]:
    """The sources as copies inside the build directory. torch writes their paths into its build file,
    so building from the package's own files would recompile everything whenever another checkout of
    the same sources (a second clone, a wheel, a CI copy) used the shared cache in between."""
    staged = build_dir / "src"
    staged.mkdir(exist_ok=True)
    for path in _SOURCES + _HEADERS:
        target = staged / path.name
        if not target.exists() or target.read_bytes() != path.read_bytes():
            shutil.copyfile(path, target)
    return [str(staged / path.name) for path in _SOURCES]


def build_kernels(tier: str) -> bool:
    """Build (or find in the cache) the kernels for `tier` and register them as torch.ops.crane_mp.*.

    Call at most once per process with success: two tiers cannot both register the same ops."""
    compiler, cache = compiler_identity(), kernel_cache_dir()
    if compiler is None or cache is None:
        return False
    build_dir = cache / build_name(tier, *compiler)
    try:
        from torch.utils.cpp_extension import load

        build_dir.mkdir(parents=True, exist_ok=True)
        # torch guards a build with a lock *file*, which a build killed half-way leaves behind: every
        # later start would wait for it forever. Builds take turns on an OS lock instead (released
        # when its holder dies), so whoever holds it knows a leftover torch lock file is stale.
        turn = os.open(build_dir / "crane-mp.lock", os.O_RDONLY | os.O_CREAT, 0o644)
        path = os.environ.get("PATH")
        os.environ["PATH"] = _build_env_path()  # torch runs whichever `ninja` PATH finds first
        try:
            fcntl.flock(turn, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            load(
                name=build_dir.name,
                sources=_staged_sources(build_dir),
                extra_cflags=[*_COMMON_FLAGS, *TIER_FLAGS[tier]],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
        finally:
            os.close(turn)
            if path is None:
                os.environ.pop("PATH", None)
            else:
                os.environ["PATH"] = path
    except Exception as err:  # no ninja, a compiler without these flags, unsupported platform
        log.warning("native CPU kernels for %s did not build: %s", tier, (str(err).strip().splitlines() or ["?"])[-1])
        return False
    return hasattr(torch.ops.crane_mp, "paged_decode_attention")
