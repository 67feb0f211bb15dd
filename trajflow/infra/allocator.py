"""The memory allocator preloaded into the Ray worker processes that hold the models.

``resources.allocator`` is ``auto`` (tcmalloc if the system has it, else the system's), ``system``
or the path of a shared library to preload. It reaches the workers as ``LD_PRELOAD`` in the job's
runtime environment; the driver process, which holds no model, keeps its own allocator. Why
tcmalloc, with the measurements: docs/scaling.md ("Memory allocator").
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

#: Where Debian/Ubuntu (multiarch), Fedora/RHEL and others put tcmalloc, minimal build first.
_TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def find_tcmalloc() -> str | None:
    """Path of an installed tcmalloc shared library, or None."""
    for d in _LIB_DIRS:
        for name in _TCMALLOC_NAMES:
            p = Path(d) / name
            if p.is_file():
                return str(p)
    return None


def is_shared_library(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts like an ELF object (what the dynamic loader preloads)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def allocator_error(setting: str) -> str | None:
    """Why ``resources.allocator = setting`` is not allowed, or None if it is."""
    if setting in ("auto", "system") or is_shared_library(setting):
        return None
    what = "not a shared library (no ELF header)" if Path(setting).is_file() else "no such file"
    return (f"resources.allocator={setting!r} is not allowed: 'auto', 'system' or the path of a shared library "
            f"to preload (e.g. /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4); {what}")


def resolve_allocator(setting: str) -> str | None:
    """The library to preload for ``resources.allocator = setting``; None for the system allocator.

    Raises:
        ValueError: ``setting`` is neither ``auto``, ``system`` nor a shared library (names the key).
    """
    error = allocator_error(setting)
    if error:
        raise ValueError(error)
    if setting == "system":
        return None
    if setting == "auto":
        return find_tcmalloc()
    return str(Path(setting).resolve())


def _is_allocator(path: str) -> bool:
    """Whether a library path names a malloc replacement (tcmalloc, jemalloc, mimalloc)."""
    return any(k in Path(path).name for k in ("tcmalloc", "jemalloc", "mimalloc"))


def _preloaded_allocator(preload: str) -> str | None:
    """The allocator entry of an ``LD_PRELOAD`` value, or None."""
    return next((e for e in preload.replace(" ", ":").split(":") if e and _is_allocator(e)), None)


def worker_env_vars(setting: str) -> dict[str, str]:
    """Environment variables for the Ray workers' runtime environment (``{}``: nothing to change).

    An ``LD_PRELOAD`` the user exported reaches the workers anyway (they inherit the driver's
    environment). With ``auto`` and an allocator already in it, that choice is kept (two allocators
    in one process would be loaded for nothing); an explicit path is put first, ahead of the rest.
    """
    lib = resolve_allocator(setting)
    if lib is None:
        return {}
    current = os.environ.get("LD_PRELOAD", "")
    if setting == "auto" and _preloaded_allocator(current):
        return {}
    if lib in current.split(":"):
        return {"LD_PRELOAD": current}
    return {"LD_PRELOAD": ":".join(x for x in (lib, current) if x)}


def loaded_allocator(pid: int | None = None) -> str | None:
    """The tcmalloc/jemalloc/mimalloc library mapped into process ``pid`` (default: this one), or None."""
    maps = Path(f"/proc/{pid or os.getpid()}/maps")
    try:
        text = maps.read_text()
    except OSError:
        return None
    paths = (line.split()[-1] for line in text.splitlines() if line.split())
    return next((p for p in paths if _is_allocator(p)), None)


def _symbol(name: str):
    """The C function ``name`` among the libraries loaded into this process, or None."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (AttributeError, OSError):
        return None


def _other_malloc_loaded() -> bool:
    """Whether jemalloc or mimalloc (their own entry points found) serves malloc in this process."""
    return _symbol("mallctl") is not None or _symbol("mi_version") is not None


def release_free_memory() -> str | None:
    """Hand the pages the allocator holds free back to the operating system; returns which call did it.

    Both allocators keep freed memory for reuse: tcmalloc in its page heap, glibc in the holes of its
    heaps (it only returns the top of a heap, so a long-lived block above the holes pins them). A
    model worker frees gigabytes between its phases (an update's activations and gradients, a
    rollout's KV cache) that it would keep resident, and counted in its RSS, while the next phase
    allocates in other places. The pages stay mapped and come back, zero-filled, on their next use.

    Calls tcmalloc's ``MallocExtension_ReleaseFreeMemory`` when tcmalloc is loaded, else glibc's
    ``malloc_trim(0)``; another allocator (jemalloc, mimalloc) is left alone.

    Returns:
        ``"tcmalloc"``, ``"glibc"`` or None (nothing was released: an unknown allocator).
    """
    tc = _symbol("MallocExtension_ReleaseFreeMemory")
    if tc is not None:
        tc.restype = None
        tc()
        return "tcmalloc"
    if _other_malloc_loaded():
        return None  # jemalloc/mimalloc serve malloc: glibc's trim would not reach their heaps
    trim = _symbol("malloc_trim")
    if trim is None:  # not glibc (musl)
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return "glibc"


#: glibc's ``mallopt`` parameter number of ``M_ARENA_MAX`` (malloc.h).
_M_ARENA_MAX = -8


def limit_malloc_arenas(count: int) -> bool:
    """Cap glibc malloc's arenas in this process at ``count`` (``mallopt(M_ARENA_MAX, count)``).

    glibc gives threads that contend for the heap arenas of their own, up to 8 per core, and each
    keeps the memory it freed for its own threads: a process whose threads allocate in turn
    (Prefect's task threads, Ray's and MLflow's background threads) holds several heaps' worth of
    free pages. ``MALLOC_ARENA_MAX`` does the same for a process started with it; this is for one
    that is already running (arenas created before the call stay).

    Returns:
        Whether glibc accepted it (False under another allocator, or where glibc is absent).
    """
    if _symbol("MallocExtension_ReleaseFreeMemory") is not None or _other_malloc_loaded():
        return False
    mallopt = _symbol("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_ARENA_MAX, int(count)))
