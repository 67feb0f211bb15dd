"""A seccomp filter for the sandbox's tool process: the system calls that reach namespaces, mounts,
other processes' memory and rarely needed kernel subsystems fail with ``EPERM``.

The namespaces of :mod:`trajflow.envs.sandbox_worker` already keep a tool from leaving them; this
filter narrows what of the kernel a tool can reach at all (a kernel bug reachable from an
unprivileged user namespace, say, through ``unshare`` or ``mount``). It is a deny-list, installed
after ``no_new_privs`` and inherited by every process the tool starts (see ``seccomp(2)``,
``SECCOMP_MODE_FILTER``). ``clone`` is refused only with a ``CLONE_NEW*`` flag; ``clone3``, whose
flags the filter cannot read, returns ``ENOSYS`` so that the C library falls back to ``clone``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct

PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JSET_K, BPF_RET_K = 0x20, 0x15, 0x45, 0x06
#: every CLONE_NEW* flag (namespace, user, cgroup, time)
CLONE_NEW_ANY = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x00000080

#: (audit arch, syscall numbers denied, clone, clone3) per machine
_TABLES = {
    "x86_64": (0xC000003E, {
        "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kexec_load": 246,
        "init_module": 175, "finit_module": 313, "delete_module": 176, "add_key": 248, "request_key": 249,
        "keyctl": 250, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "open_tree": 428,
        "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "mount_setattr": 442}, 56, 435),
    "aarch64": (0xC00000B7, {
        "unshare": 97, "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51,
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kexec_load": 104,
        "init_module": 105, "finit_module": 273, "delete_module": 106, "add_key": 217, "request_key": 218,
        "keyctl": 219, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282, "open_tree": 428,
        "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "mount_setattr": 442}, 220, 435),
}


def supported() -> bool:
    """Whether this machine's system call numbers are known here."""
    return platform.machine() in _TABLES


def _program() -> bytes:
    arch, denied, clone, clone3 = _TABLES[platform.machine()]
    ins: list[tuple[int, int, int, int]] = []
    deny = SECCOMP_RET_ERRNO | errno.EPERM
    ins.append((BPF_LD_W_ABS, 0, 0, 4))                          # seccomp_data.arch
    ins.append((BPF_JEQ_K, 1, 0, arch))
    ins.append((BPF_RET_K, 0, 0, deny))                          # another ABI (x32, i386): refused
    ins.append((BPF_LD_W_ABS, 0, 0, 0))                          # seccomp_data.nr
    for nr in sorted(denied.values()):
        ins += [(BPF_JEQ_K, 0, 1, nr), (BPF_RET_K, 0, 0, deny)]
    ins += [(BPF_JEQ_K, 0, 1, clone3), (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.ENOSYS)]
    ins += [(BPF_JEQ_K, 0, 3, clone), (BPF_LD_W_ABS, 0, 0, 16),  # args[0], low 32 bits (little-endian)
            (BPF_JSET_K, 0, 1, CLONE_NEW_ANY), (BPF_RET_K, 0, 0, deny)]
    ins.append((BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW))
    return b"".join(struct.pack("HBBI", *i) for i in ins)


def install() -> None:
    """Install the filter on this process (and so on all it starts); needs ``no_new_privs`` first.

    Raises:
        OSError: the machine is not supported or the kernel refused the filter.
    """
    if not supported():
        raise OSError(errno.ENOSYS, f"no seccomp table for {platform.machine()}")
    code = _program()
    buf = ctypes.create_string_buffer(code, len(code))

    class _Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = _Prog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_SECCOMP, ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(prog), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp: {os.strerror(err)}")
