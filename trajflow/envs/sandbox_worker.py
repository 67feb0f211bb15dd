"""The sandbox's worker processes: a trusted supervisor and the confined process that runs one tool call.

:class:`trajflow.envs.sandbox.Sandbox` starts ``python -m trajflow.envs.sandbox_worker`` per call. That
process, the *supervisor*, runs only this module's code: it reads the request on stdin, forks the
*tool process*, reads the tool's answer with a deadline and a byte cap, kills the tool's processes
and writes one validated JSON answer on its stdout, which no tool process holds. The tool process,
before it imports the tool (all of it trusted code, nothing the tool controls yet):

1. joins a fresh memory cgroup (v2 or v1, where the supervisor could create one): the memory limit
   then holds for all of the tool's processes together;
2. as root, drops to ``nobody`` (uid/gid 65534, no supplementary groups);
3. enters new user, mount, network, PID, IPC and UTS namespaces (the user namespace maps one uid,
   65534, to the caller's unprivileged uid, so the tool holds no capability outside it);
4. builds a private root on a size-limited tmpfs: read-only binds of the system directories
   (``/usr``, ``/etc``, ...), the Python installation, the trajflow package and the tool's own
   top-level package, four device nodes, and a writable ``/tmp``; everything else (the run's
   folders, home directories, the worker's files) does not exist there. ``pivot_root`` detaches the
   old root, so no path leads back to it, and the tmpfs vanishes with the namespace after the call;
5. forks the process that becomes PID 1 of the new PID namespace (when it exits, the kernel kills
   every process the tool started), mounts that namespace's ``/proc``, sets ``RLIMIT_CPU``,
   ``RLIMIT_AS``, ``RLIMIT_NPROC``, ``RLIMIT_FSIZE`` and ``RLIMIT_CORE``, replaces the environment by
   an allow-list, drops every capability, sets ``no_new_privs``, a parent-death signal and the
   seccomp filter of :mod:`trajflow.envs.seccomp`, and only then imports and calls the tool.

Where the kernel refuses a step (no user namespaces in a container, no cgroup), the call still runs
with what could be set up, and the answer lists what is missing; :class:`Sandbox` refuses to run tools
that way unless the user allowed a weaker sandbox. Nothing here is importable by the tool's code in
a way that matters: the answer channel to the caller is this process's stdout, which the tool
process closed before the tool ran.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import resource
import select
import shutil
import signal
import struct
import sys
import tempfile
import time

from trajflow.envs import seccomp

NOBODY = 65534
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}.get(platform.machine())
#: the answer frame: magic, big-endian length, then that many bytes of JSON
MAGIC = b"TFSB"
#: what the tool's environment may contain (nothing else of the worker's is passed: no secrets)
ENV_ALLOWED = ("LANG", "LC_ALL", "LC_CTYPE", "TZ")
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
DEVICES = ("null", "zero", "full", "random", "urandom")
#: the name of a supervisor's cgroup and temp directory, by its pid (for the caller to remove them)
_NAME = "trajflow-tool-{}"

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _unshare(flags: int, what: str) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), f"unshare({what})")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {target}")


def _prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl({option})")


def _drop_capabilities() -> None:
    """Empty the effective, permitted and inheritable sets (``capset`` v3, two 32-bit words)."""
    header = struct.pack("Ii", 0x20080522, 0)
    data = ctypes.create_string_buffer(24)
    _check(_libc.capset(ctypes.c_char_p(header), data), "capset")


def _write(path: str, text: str, dir_fd: int | None = None) -> None:
    fd = os.open(path, os.O_WRONLY, dir_fd=dir_fd)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------ memory cgroup

def _cgroup_parents() -> list[tuple[str, str]]:
    """``(version, folder)`` of this process's memory cgroups (v2 where ``memory`` is delegated, v1)."""
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "" and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            out.append(("v2", "/sys/fs/cgroup" + path))
        elif "memory" in controllers.split(","):
            out.append(("v1", "/sys/fs/cgroup/memory" + path))
    return out


def make_cgroup(memory_mb: int) -> str | None:
    """A fresh memory cgroup below this process's own, limited to ``memory_mb`` MiB (swap included
    where the kernel accounts it), or ``None`` where none can be made (not root, no delegation)."""
    limit = str(int(memory_mb) * 1024 * 1024)
    for version, parent in _cgroup_parents():
        cg = os.path.join(parent, _NAME.format(os.getpid()))
        try:
            if version == "v2":
                if "memory" not in open(os.path.join(parent, "cgroup.subtree_control")).read().split():
                    continue
                os.mkdir(cg)
                _write(os.path.join(cg, "memory.max"), limit)
                if os.path.exists(os.path.join(cg, "memory.swap.max")):
                    _write(os.path.join(cg, "memory.swap.max"), "0")
                return cg
            os.mkdir(cg)
            _write(os.path.join(cg, "memory.limit_in_bytes"), limit)
            if os.path.exists(os.path.join(cg, "memory.memsw.limit_in_bytes")):
                _write(os.path.join(cg, "memory.memsw.limit_in_bytes"), limit)
            return cg
        except OSError:
            continue
    return None


def remove_leftovers(pid: int) -> None:
    """Remove the cgroup and temp directory of the supervisor ``pid`` after it was killed (called by
    its parent, which shares its cgroup; the tool's processes die with the supervisor)."""
    shutil.rmtree(os.path.join(tempfile.gettempdir(), _NAME.format(pid)), ignore_errors=True)
    for _, parent in _cgroup_parents():
        if os.path.isdir(os.path.join(parent, _NAME.format(pid))):
            remove_cgroup(os.path.join(parent, _NAME.format(pid)))


def cgroup_oom_kills(cg: str) -> int:
    """How many processes the kernel killed for the cgroup's memory limit."""
    for name in ("memory.events", "memory.oom_control"):
        try:
            for line in open(os.path.join(cg, name)):
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except OSError:
            continue
    return 0


def remove_cgroup(cg: str) -> None:
    """Remove the cgroup once its processes are gone (they were killed; the kernel may lag a little)."""
    for _ in range(200):
        try:
            os.rmdir(cg)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.005)


# ------------------------------------------------------------------------------------ private root

def _bind_flags(path: str) -> int:
    """The flags a read-only remount of a bind of ``path`` must keep (a user namespace may not clear them)."""
    f = os.statvfs(path).f_flag
    out = MS_BIND | MS_REMOUNT | MS_RDONLY
    for st, ms in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                   (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME)):
        if f & st:
            out |= ms
    return out


def visible_paths(function: str) -> list[str]:
    """What the tool's root shows read-only besides the system directories: the Python installation,
    the trajflow package and the top-level package (or module file) of ``function``; computed in the
    supervisor without importing the tool (``find_spec`` of a top-level name runs no code)."""
    import importlib.util

    paths = {sys.prefix, sys.exec_prefix, sys.base_prefix, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    top = function.partition(":")[0].split(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        if spec.submodule_search_locations:
            paths.update(os.path.abspath(p) for p in spec.submodule_search_locations)
        elif spec.origin and os.path.isabs(spec.origin):
            paths.add(os.path.abspath(spec.origin))
    return sorted(os.path.realpath(p) for p in paths if p)


def _root_mount_point(paths: list[str]) -> str:
    """An existing directory to mount the new root's tmpfs on, above none of the paths to bind."""
    for d in ("/mnt", "/srv", "/media", "/sys", "/tmp"):
        if os.path.isdir(d) and not os.path.islink(d) and not any(p.startswith(d + "/") for p in paths):
            return d
    raise OSError(0, "no directory to mount the private root on")


def _build_root(root: str, paths: list[str]) -> None:
    """Populate the tmpfs mounted at ``root`` (see the module doc) and make it ``/``."""
    bound: list[str] = []
    for path in [p for p in SYSTEM_DIRS if os.path.lexists(p)] + paths:
        if any(path == b or path.startswith(b.rstrip("/") + "/") for b in bound) or not os.path.exists(path):
            continue
        target = root + path
        if os.path.islink(path) and path in SYSTEM_DIRS:  # merged /usr: /bin -> usr/bin
            os.symlink(os.readlink(path), target)
            continue
        if os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "w").close()
        _mount(path, target, None, MS_BIND | MS_REC)
        _mount(None, target, None, _bind_flags(path))
        bound.append(path)
    os.makedirs(root + "/dev", exist_ok=True)
    for dev in DEVICES:
        if os.path.exists("/dev/" + dev):
            open(f"{root}/dev/{dev}", "w").close()
            _mount("/dev/" + dev, f"{root}/dev/{dev}", None, MS_BIND)
    os.symlink("/proc/self/fd", root + "/dev/fd")
    # The host's /proc, only ever covered by the PID namespace's own: the kernel lets a user
    # namespace mount a proc only where one is already visible.
    os.makedirs(root + "/proc", exist_ok=True)
    _mount("/proc", root + "/proc", None, MS_BIND | MS_REC)
    for d in ("/tmp", "/dev/shm"):
        os.makedirs(root + d, exist_ok=True)
        os.chmod(root + d, 0o1777)
    os.chdir(root)
    _check(_libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")


# ------------------------------------------------------------------------------------ the tool process

def _private_root(req: dict, got: dict, missing: list[str]) -> None:
    """A new mount namespace whose root is the private tmpfs of the module doc (step 4)."""
    try:
        _unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS, "CLONE_NEWNS")
        if SYS_PIVOT_ROOT is None:
            raise OSError(0, f"pivot_root: unknown syscall number on {platform.machine()}")
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        root = _root_mount_point(req["paths"])
        _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, f"size={int(req['memory_mb'])}m,mode=755")
        _build_root(root, req["paths"])
        got["mount"] = "private root (pivot_root), tmpfs /tmp"
    except OSError as e:
        missing.append(f"mount: {e}")


def _user_namespace(got: dict, missing: list[str], proc_self: int) -> None:
    """A new user namespace mapping only ``NOBODY`` inside to this process's uid and gid (step 3);
    ``proc_self``: this process's ``/proc/self``, opened before a new root hid ``/proc``."""
    uid, gid = os.geteuid(), os.getegid()
    try:
        _unshare(CLONE_NEWUSER, "CLONE_NEWUSER")
        _write("setgroups", "deny", proc_self)
        _write("uid_map", f"{NOBODY} {uid} 1", proc_self)
        _write("gid_map", f"{NOBODY} {gid} 1", proc_self)
        got["user"] = f"uid {uid} outside, {NOBODY} inside a user namespace"
    except OSError as e:
        missing.append(f"user: {e}")
        got["user"] = f"uid {uid}, no user namespace"


def _confine(req: dict, cgroup: str | None) -> tuple[dict, list[str]]:
    """Steps 1-4 of the module doc in the tool process; returns what was isolated and what was not.

    As root, the private root is built before the switch to ``nobody`` (who could not reach, say, a
    Python installed under ``/root``), and a second mount namespace, owned by the new user namespace,
    is entered after it so that the PID namespace's ``/proc`` can be mounted; otherwise the user
    namespace comes first and gives the rights to build the root.
    """
    got: dict = {}
    missing: list[str] = []
    if cgroup is not None:
        try:
            _write(os.path.join(cgroup, "cgroup.procs"), str(os.getpid()))
            got["memory"] = "cgroup"
        except OSError as e:
            missing.append(f"memory cgroup: {e}")
    root = bool(req["switch_user"])
    if os.geteuid() == 0 and not root:
        missing.append(f"user: uid {NOBODY} is not mapped in this user namespace (a rootless container?): "
                       "the tool runs as the worker's uid 0")
    proc_self = os.open("/proc/self", os.O_PATH | os.O_DIRECTORY)
    if root:
        _private_root(req, got, missing)
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
        _prctl(PR_SET_DUMPABLE, 1)  # so that this process may write its own /proc/self/uid_map
    _user_namespace(got, missing, proc_self)
    os.close(proc_self)
    if not root and "inside a user namespace" in got["user"]:
        _private_root(req, got, missing)
    for key, flag, what in (("net", CLONE_NEWNET, "CLONE_NEWNET"), ("pid", CLONE_NEWPID, "CLONE_NEWPID")):
        try:
            _unshare(flag, what)
            got[key] = "namespace"
        except OSError as e:
            missing.append(f"{key}: {e}")
    if root and "mount" in got and "pid" in got:
        try:
            _unshare(CLONE_NEWNS, "CLONE_NEWNS")
        except OSError as e:
            missing.append(f"proc: {e}")
    # After the credential changes above (uid, user namespace), each of which clears it.
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != req["supervisor"]:
        os._exit(1)
    return got, missing


def _tool_main(req: dict, answer_w: int, alive_r: int) -> None:
    """Step 5 of the module doc, in the process that becomes PID 1 of the tool's PID namespace."""
    from trajflow.envs.tools import import_callable

    os.setpgid(0, 0)  # without a PID namespace, the supervisor kills this group
    if req["proc"]:
        try:
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        except OSError:  # never the host's: an empty /proc then
            _mount("tmpfs", "/proc", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=555")
    cpu_s, mem = int(req["cpu_s"]), int(req["memory_mb"]) * 1024 * 1024
    for lim, value in ((resource.RLIMIT_CPU, (cpu_s, cpu_s + 1)), (resource.RLIMIT_AS, (mem, mem)),
                       (resource.RLIMIT_NPROC, (req["max_processes"], req["max_processes"])),
                       (resource.RLIMIT_FSIZE, (req["file_size"], req["file_size"])),
                       (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(lim, value)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past RLIMIT_FSIZE fails with EFBIG instead
    # PID 1 of a namespace ignores signals it has no handler for: stop at the soft CPU limit, not the hard one
    signal.signal(signal.SIGXCPU, lambda *_: os._exit(128 + signal.SIGXCPU))
    os.environ.clear()
    os.environ.update(req["env"], TMPDIR=req["tmp"], HOME=req["tmp"])
    os.chdir(req["tmp"])
    os.umask(0o077)
    try:
        _drop_capabilities()
    except OSError:
        pass  # no capabilities to drop outside a user namespace (never root: see _confine)
    # Last of the credential changes, which clear it (a change of capabilities too).
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if select.select([alive_r], [], [], 0)[0]:  # the parent died before the line above: stop
        os._exit(1)
    os.close(alive_r)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    if req["seccomp"]:
        seccomp.install()
    try:
        value = import_callable(req["function"])(**req["arguments"], **req["options"])
        if isinstance(value, str):
            status, text, length = "ok", value[:req["max_chars"]], len(value)
        else:
            status, text, length = "error", f"result: the tool returned {type(value).__name__}, not a string", 0
    except MemoryError:
        status, text, length = "error", f"memory: the call ran out of its {req['memory_mb']} MiB", 0
    except BaseException as e:  # everything the tool raises is the model's to read
        status, text, length = "error", f"exception: {type(e).__name__}: {e}"[:500], 0
    _send(answer_w, status, text, length)
    os._exit(0)


def _send(fd: int, status: str, text: str, length: int) -> None:
    # UTF-8, not \u escapes: at most 6 bytes (an escaped control character) per character of text
    body = json.dumps([status, text, length], ensure_ascii=False).encode("utf-8", "replace")
    data = MAGIC + struct.pack(">I", len(body)) + body
    while data:
        data = data[os.write(fd, data):]


def _tool_process(req: dict, cgroup: str | None, answer_w: int, report_w: int) -> None:
    """The forked tool process: confine, fork PID 1 of the new namespace, wait for it, report."""
    try:
        devnull = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        keep = sorted({0, 1, 2, answer_w, report_w})
        for lo, hi in zip(keep, keep[1:] + [resource.getrlimit(resource.RLIMIT_NOFILE)[0]]):
            os.closerange(lo + 1, hi)
        got, missing = _confine(req, cgroup)
        if "mount" not in got:
            req["tmp"] = req["fallback_tmp"]
        req["proc"] = "pid" in got and "mount" in got
        req["seccomp"] = seccomp.supported()
        got["seccomp"] = "unshare, setns, mount, ptrace, keys, bpf, ... denied" if req["seccomp"] else "none"
        alive_r, alive_w = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(report_w)
            os.close(alive_w)
            try:
                _tool_main(req, answer_w, alive_r)
            except BaseException as e:  # noqa: BLE001 - a failure of the set-up, before the tool ran
                _send(answer_w, "error", f"crashed: the sandbox could not set up the call: {type(e).__name__}: {e}", 0)
            os._exit(0)
        os.close(answer_w)
        os.write(report_w, (json.dumps({"isolation": got, "missing": missing, "pid": child}) + "\n").encode())
        _, status, usage = os.wait4(child, 0)
        os.write(report_w, (json.dumps({"status": status, "cpu_s": usage.ru_utime + usage.ru_stime}) + "\n").encode())
    except BaseException as e:  # noqa: BLE001 - reported to the supervisor, which turns it into an error result
        try:
            os.write(report_w, (json.dumps({"setup_error": f"{type(e).__name__}: {e}"}) + "\n").encode())
        except OSError:
            pass
    os._exit(0)


# ------------------------------------------------------------------------------------ the supervisor

class _Reader:
    """Reads a pipe with a deadline (``select``) and a byte cap, never blocking past the deadline."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buf, self.eof = fd, b"", False

    def fill(self, deadline: float, want: int, cap: int) -> bool:
        """Read until ``want`` bytes are buffered, EOF, ``cap`` bytes, or the deadline; True if ``want`` reached."""
        while len(self.buf) < want and not self.eof and len(self.buf) <= cap:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return False
            chunk = os.read(self.fd, 65536)
            self.eof = not chunk
            self.buf += chunk
        return len(self.buf) >= want

    def line(self, deadline: float) -> dict | None:
        """The next JSON line (written by trusted code: the tool process before it ran the tool)."""
        while b"\n" not in self.buf:
            if self.eof or not self.fill(deadline, len(self.buf) + 1, 1 << 16):
                return None
        raw, _, self.buf = self.buf.partition(b"\n")
        return json.loads(raw)


_ERROR_KINDS = ("exception:", "memory:", "result:", "crashed:")


def parse_answer(body: bytes) -> tuple[str, str, int]:
    """``(status, text, length)`` of a frame's body, or ValueError when it is not the wrapper's shape."""
    value = json.loads(body.decode("utf-8"))
    if (not isinstance(value, list) or len(value) != 3 or value[0] not in ("ok", "error")
            or not isinstance(value[1], str) or type(value[2]) is not int or value[2] < 0):
        raise ValueError("not [status, text, length]")
    if value[0] == "error" and not value[1].startswith(_ERROR_KINDS):
        raise ValueError("an error of an unknown kind")
    return value[0], value[1], value[2]


def _nobody_mapped() -> bool:
    """Whether uid and gid ``NOBODY`` exist in this process's user namespace (not so in a rootless
    container that maps one uid)."""
    for name in ("uid_map", "gid_map"):
        try:
            ranges = [tuple(map(int, line.split())) for line in open(f"/proc/self/{name}")]
        except (OSError, ValueError):
            return False
        if not any(inner <= NOBODY < inner + count for inner, _, count in ranges):
            return False
    return True


def _kill(pidfd: int | None, pid: int | None) -> None:
    for send in ((lambda: signal.pidfd_send_signal(pidfd, signal.SIGKILL)) if pidfd is not None else None,
                 (lambda: os.killpg(pid, signal.SIGKILL)) if pid is not None else None):
        try:
            if send is not None:
                send()
        except OSError:
            pass


def supervise(req: dict) -> dict:
    """Run one call (``req``: the request of :class:`trajflow.envs.sandbox.Sandbox`) and return its
    validated answer: ``{"status": "ok"|"error", "value", "length", "isolation", "missing"}``."""
    timeout, cap = float(req["timeout_s"]), 6 * int(req["max_chars"]) + 4096
    cgroup = make_cgroup(int(req["memory_mb"]))
    try:  # named after this process, so that the caller can remove it should this process be killed
        fallback_tmp = os.path.join(tempfile.gettempdir(), _NAME.format(os.getpid()))
        os.mkdir(fallback_tmp, 0o700)
    except OSError:  # taken (by anyone): a random name, then
        fallback_tmp = tempfile.mkdtemp(prefix="trajflow-tool-")
    req["switch_user"] = os.geteuid() == 0 and _nobody_mapped()
    if req["switch_user"]:
        os.chown(fallback_tmp, NOBODY, NOBODY)
    req.update(supervisor=os.getpid(), paths=visible_paths(req["function"]), fallback_tmp=fallback_tmp, tmp="/tmp")
    answer_r, answer_w = os.pipe()
    report_r, report_w = os.pipe()
    deadline = time.monotonic() + timeout
    child = os.fork()
    if child == 0:
        os.close(answer_r)
        os.close(report_r)
        _tool_process(req, cgroup, answer_w, report_w)
    os.close(answer_w)
    os.close(report_w)
    out: dict = {"status": "error", "value": "", "length": 0, "isolation": {}, "missing": []}
    report, answer = _Reader(report_r), _Reader(answer_r)
    pidfd = tool_pid = None
    try:
        first = report.line(deadline)
        if first is None or "setup_error" in first:
            why = "timed out" if first is None else first["setup_error"]
            out["value"] = f"crashed: the sandbox could not start the call: {why}"
            return out
        out["isolation"], out["missing"], tool_pid = first["isolation"], first["missing"], first["pid"]
        try:
            pidfd = os.pidfd_open(tool_pid)
        except OSError:
            pass  # already gone
        if answer.fill(deadline, 8, cap) and answer.buf[:4] == MAGIC:
            size = struct.unpack(">I", answer.buf[4:8])[0]
            if size > cap:
                out["value"] = f"result: the answer is longer than {cap} bytes"
            elif answer.fill(deadline, 8 + size, cap + 8):
                try:
                    out["status"], out["value"], out["length"] = parse_answer(answer.buf[8:8 + size])
                    return out
                except (ValueError, UnicodeDecodeError) as e:
                    out["value"] = f"result: the tool's answer is malformed ({e})"
        elif answer.buf[:4] != MAGIC[:len(answer.buf[:4])]:
            out["value"] = "result: the tool's answer is malformed (not a frame)"
        if out["value"]:
            return out
        if not answer.eof:
            out["value"] = f"timeout: the call took longer than {timeout:g} s and was stopped"
            return out
        if answer.buf:
            out["value"] = "result: the tool's answer is malformed (cut short)"
            return out
        done = report.line(time.monotonic() + 2.0) or {}
        status, cpu = int(done.get("status", -1)), float(done.get("cpu_s", 0.0))
        xcpu = (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGXCPU) or (
            os.WIFEXITED(status) and os.WEXITSTATUS(status) == 128 + signal.SIGXCPU)  # _tool_main's handler
        if cpu >= int(req["cpu_s"]) - 0.05 or xcpu:
            out["value"] = f"cpu: the call used more than {req['cpu_s']} s of CPU time"
        elif os.WIFSIGNALED(status):
            out["value"] = f"crashed: killed ({signal.Signals(os.WTERMSIG(status)).name})"
        else:
            out["value"] = f"crashed: the call's process exited with code {os.WEXITSTATUS(status) if status >= 0 else '?'}"
        return out
    finally:
        _kill(pidfd, tool_pid)
        try:
            os.kill(child, signal.SIGKILL)
        except OSError:
            pass
        os.waitpid(child, 0)
        for fd in (answer_r, report_r) + ((pidfd,) if pidfd is not None else ()):
            os.close(fd)
        if cgroup is not None:
            kills = cgroup_oom_kills(cgroup)
            remove_cgroup(cgroup)
            if kills:
                out.update(status="error", length=0, value=f"memory: the call's processes together used more than "
                           f"{req['memory_mb']} MiB (the kernel stopped {kills})")
        shutil.rmtree(fallback_tmp, ignore_errors=True)


def main() -> None:
    """Entry point: the request as JSON on stdin, the answer as one JSON line on stdout."""
    try:
        out = supervise(json.loads(sys.stdin.buffer.read(1 << 26)))
    except BaseException as e:  # noqa: BLE001 - the caller gets it as an error result
        out = {"status": "error", "value": f"crashed: the sandbox failed: {type(e).__name__}: {e}", "length": 0,
               "isolation": {}, "missing": []}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
