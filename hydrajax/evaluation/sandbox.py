"""Run untrusted Python in its own subprocess with resource limits (never in this process).

What contains a program (each run):

* its own process (`python -I`: no user site, no PYTHON* variables, script dir not on sys.path)
  in a new session, so the wall timeout kills its whole process group;
* rlimits set before exec: RLIMIT_CPU (seconds), RLIMIT_AS (address space), RLIMIT_FSIZE (largest
  file it may write; Python ignores SIGXFSZ so a write past it raises OSError), RLIMIT_NPROC
  (processes of its uid), RLIMIT_CORE 0;
* a fresh scratch directory as its working directory, deleted afterwards;
* an environment of PATH, LANG and HOME (= the scratch dir) only;
* where the platform allows (Linux, util-linux `unshare`): a new network namespace (no interface
  but a down loopback: no connection anywhere, 127.0.0.1 included) and a new PID namespace (when
  its first process ends, the kernel kills every process left in it);
* when this process is root: the program runs as an unprivileged uid (one per concurrent slot,
  `SandboxLimits.base_uid + slot`), so RLIMIT_NPROC is enforced (root is exempt from it), files
  outside the scratch dir are read-only to it (others' permission bits), and concurrent sandboxes
  do not share a process quota.

Where namespaces are not available the run goes on with a socket-blocking preamble in the runner
(`block_network`: replaces `socket.socket` and friends; a determined program can get around it
through `_socket`), and `isolation()` says so. Without root, RLIMIT_NPROC counts every process of
the user, so the limit is set to the user's current count plus `max_processes`; files of the user
stay writable. `isolation()` reports what applies on this machine.

The program's stdout and stderr go to files (so RLIMIT_FSIZE caps them too); the first
`max_output_bytes` of each come back.
"""

import dataclasses
import functools
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from typing import Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  """Limits of one sandboxed run.

  Attributes:
    wall_s: wall-clock timeout; the process group is killed after it.
    cpu_s: CPU seconds (RLIMIT_CPU) of each process.
    memory_bytes: address space (RLIMIT_AS) of each process.
    file_bytes: largest file a process may write (RLIMIT_FSIZE), stdout/stderr included.
    max_processes: processes the program may have at once (RLIMIT_NPROC), itself included.
    max_output_bytes: bytes of stdout / stderr returned.
    base_uid: first unprivileged uid used when running as root (slot i uses base_uid + i).
    use_namespaces: use network / PID namespaces where available.
  """

  wall_s: float = 10.0
  cpu_s: int = 10
  memory_bytes: int = 1 << 30
  file_bytes: int = 16 << 20
  max_processes: int = 16
  max_output_bytes: int = 1 << 20
  base_uid: int = 62000
  use_namespaces: bool = True

  def __post_init__(self):
    if not self.wall_s > 0:
      raise ValueError(f'SandboxLimits.wall_s must be > 0, got {self.wall_s}')
    for field in ('cpu_s', 'memory_bytes', 'file_bytes', 'max_processes', 'max_output_bytes'):
      if getattr(self, field) < 1:
        raise ValueError(f'SandboxLimits.{field} must be >= 1, got {getattr(self, field)}')
    if not 0 < self.base_uid < 2**31:
      raise ValueError(f'SandboxLimits.base_uid must be in (0, 2**31), got {self.base_uid}')


@dataclasses.dataclass(frozen=True)
class Isolation:
  """What this machine lets the sandbox use (see the module docstring).

  Attributes:
    network: 'namespace' (no network at all) or 'preamble' (socket calls blocked in Python only).
    pid_namespace: leftover processes die with the program's first process.
    drop_uid: run as an unprivileged uid (we are root).
    nproc_enforced: RLIMIT_NPROC applies to the program (it does not for root).
    python: the interpreter that runs programs.
    unshare: the `unshare` binary, or None.
  """

  network: str
  pid_namespace: bool
  drop_uid: bool
  nproc_enforced: bool
  python: str
  unshare: str | None


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  """How a sandboxed run ended.

  Attributes:
    returncode: the exit status (negative: killed by that signal), None if it never started.
    timed_out: killed by the wall timeout, or by the CPU limit (SIGXCPU / SIGKILL past it).
    stdout, stderr: the first bytes of each.
    files: contents of the requested output files of the scratch dir (missing ones absent).
    wall_s: seconds it ran.
  """

  returncode: int | None
  timed_out: bool
  stdout: bytes
  stderr: bytes
  files: Mapping[str, bytes]
  wall_s: float


def _world_executable(path: str) -> bool:
  """Whether any uid may run `path` (others' x bit on the file and every parent directory)."""
  path = os.path.realpath(path)
  try:
    if not os.stat(path).st_mode & stat.S_IXOTH:
      return False
    parent = os.path.dirname(path)
    while True:
      if not os.stat(parent).st_mode & stat.S_IXOTH:
        return False
      if parent == os.path.dirname(parent):
        return True
      parent = os.path.dirname(parent)
  except OSError:
    return False


def _python_for_others() -> str | None:
  """An interpreter an unprivileged uid can run: ours if it can, else a system python3."""
  for candidate in (sys.executable, shutil.which('python3'), '/usr/bin/python3',
                    '/usr/local/bin/python3'):
    if candidate and _world_executable(candidate):
      return candidate
  return None


def _probe(argv: Sequence[str]) -> bool:
  try:
    return subprocess.run(list(argv), capture_output=True, timeout=20,
                          env={'PATH': '/usr/bin:/bin'}).returncode == 0
  except (OSError, subprocess.SubprocessError):
    return False


@functools.cache
def isolation(use_namespaces: bool = True, base_uid: int = SandboxLimits.base_uid) -> Isolation:
  """Probes (once) which of the sandbox's mechanisms this machine supports."""
  root = os.geteuid() == 0
  python = sys.executable
  drop = False
  if root and sys.platform.startswith('linux'):
    other = _python_for_others()
    if other is not None:
      python, drop = other, True
  unshare = shutil.which('unshare') if use_namespaces and sys.platform.startswith('linux') else None
  ns_ok = False
  if unshare:
    argv = _unshare_prefix(unshare, root, drop, base_uid) + [python, '-I', '-c', 'pass']
    ns_ok = _probe(argv)
  if unshare and not ns_ok and drop:  # namespaces may fail where dropping the uid works alone
    unshare = None
  if not ns_ok:
    unshare = None
  return Isolation(
      network='namespace' if ns_ok else 'preamble',
      pid_namespace=ns_ok,
      drop_uid=drop,
      nproc_enforced=drop or not root,
      python=python,
      unshare=unshare,
  )


def _unshare_prefix(unshare: str, root: bool, drop: bool, uid: int) -> list[str]:
  argv = [unshare, '--net', '--pid', '--fork', '--kill-child']
  if not root:
    argv.insert(1, '--map-current-user')  # a user namespace lets a non-root user unshare
  if drop:
    argv += ['--setgid', str(uid), '--setuid', str(uid)]
  return argv + ['--']


def _count_processes(uid: int) -> int:
  count = 0
  for name in os.listdir('/proc') if os.path.isdir('/proc') else ():
    if name.isdigit():
      try:
        if os.stat(f'/proc/{name}').st_uid == uid:
          count += 1
      except OSError:
        pass
  return count


_slot_lock = threading.Lock()
_free_slots: list[int] = []
_next_slot = [0]


def _take_slot() -> int:
  with _slot_lock:
    if _free_slots:
      return _free_slots.pop()
    _next_slot[0] += 1
    return _next_slot[0] - 1


def _give_slot(slot: int) -> None:
  with _slot_lock:
    _free_slots.append(slot)


def run(
    argv: Sequence[str],
    *,
    files: Mapping[str, str | bytes] = {},
    stdin: bytes = b'',
    limits: SandboxLimits = SandboxLimits(),
    read_back: Sequence[str] = (),
) -> SandboxResult:
  """Runs `python -I *argv` in a fresh scratch dir holding `files`, within `limits`.

  Args:
    argv: arguments after `python -I` (e.g. ['runner.py']), paths relative to the scratch dir.
    files: name -> content written into the scratch dir first.
    stdin: bytes fed to the program's stdin.
    limits: the limits.
    read_back: names of files in the scratch dir whose content (first max_output_bytes) is
      returned in `SandboxResult.files`.

  Thread-safe: concurrent runs use different uids when running as root.
  """
  iso = isolation(limits.use_namespaces, limits.base_uid)
  slot = _take_slot()
  uid = limits.base_uid + slot
  scratch = tempfile.mkdtemp(prefix='hydrajax_sandbox_')
  logs = tempfile.mkdtemp(prefix='hydrajax_sandbox_logs_')  # ours: the program cannot reach it
  try:
    for name, content in files.items():
      if os.path.isabs(name) or '..' in name.split('/'):
        raise ValueError(f'files names must be relative, got {name!r}')
      path = os.path.join(scratch, name)
      mode = 'wb' if isinstance(content, bytes) else 'w'
      with open(path, mode) as f:
        f.write(content)
    if iso.drop_uid:
      for dirpath, _, names in os.walk(scratch):
        os.chown(dirpath, uid, uid)
        for n in names:
          os.chown(os.path.join(dirpath, n), uid, uid)
    os.chmod(scratch, 0o700)
    if iso.unshare:
      prefix = _unshare_prefix(iso.unshare, os.geteuid() == 0, iso.drop_uid, uid)
    else:
      prefix = []
    if iso.drop_uid and not iso.unshare:
      user = uid
    else:
      user = None
    nproc = limits.max_processes
    if not iso.drop_uid and iso.nproc_enforced:  # non-root: the quota counts all our processes
      nproc += _count_processes(os.getuid())
    env = {'PATH': '/usr/bin:/bin', 'LANG': 'C.UTF-8', 'HOME': scratch}
    # The limits are set by a bootstrap in the sandboxed interpreter itself, which then execs the
    # program's interpreter: no Python runs between fork and exec in this (threaded) process.
    rlimits = [(resource.RLIMIT_CPU, limits.cpu_s, limits.cpu_s + 1),
               (resource.RLIMIT_AS, limits.memory_bytes, limits.memory_bytes),
               (resource.RLIMIT_FSIZE, limits.file_bytes, limits.file_bytes),
               (resource.RLIMIT_CORE, 0, 0)]
    if iso.nproc_enforced:
      rlimits.append((resource.RLIMIT_NPROC, nproc, nproc))
    boot = [iso.python, '-I', '-c', _BOOTSTRAP, repr(rlimits), iso.python, '-I', *argv]
    with open(os.path.join(logs, 'stdout'), 'wb') as out, \
        open(os.path.join(logs, 'stderr'), 'wb') as err:
      start = time.perf_counter()
      proc = subprocess.Popen(
          prefix + boot, cwd=scratch, env=env, stdin=subprocess.PIPE,
          stdout=out, stderr=err, start_new_session=True, user=user,
          group=user, extra_groups=[] if user is not None else None, close_fds=True)
      timed_out = False
      try:
        proc.communicate(stdin, timeout=limits.wall_s)
      except subprocess.TimeoutExpired:
        timed_out = True
      finally:
        _kill_group(proc.pid)
        proc.wait()
      wall = time.perf_counter() - start
    rc = proc.returncode
    if rc in (-signal.SIGXCPU, -signal.SIGKILL) and not timed_out:
      timed_out = True  # the CPU limit (soft SIGXCPU, then SIGKILL at the hard limit)
    back = {}
    for name in read_back:
      path = os.path.join(scratch, name)
      if os.path.isfile(path) and not os.path.islink(path):
        with open(path, 'rb') as f:
          back[name] = f.read(limits.max_output_bytes)
    return SandboxResult(rc, timed_out, _head(os.path.join(logs, 'stdout'), limits),
                         _head(os.path.join(logs, 'stderr'), limits), back, wall)
  finally:
    _give_slot(slot)
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.rmtree(logs, ignore_errors=True)


_BOOTSTRAP = (
    'import ast, os, resource, sys\n'
    'for kind, soft, hard in ast.literal_eval(sys.argv[1]):\n'
    '  resource.setrlimit(kind, (soft, hard))\n'
    'os.execv(sys.argv[2], sys.argv[2:])\n')


def _head(path: str, limits: SandboxLimits) -> bytes:
  with open(path, 'rb') as f:
    return f.read(limits.max_output_bytes)


def _kill_group(pid: int) -> None:
  """SIGKILL to the process group the sandbox started (its session leader is `pid`)."""
  try:
    os.killpg(pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
