"""Run untrusted Python in its own sandbox, never in this process.

Each run starts `sandbox_launcher.py` (see its docstring) on this process's own interpreter. What
contains a program depends on what the machine allows; `isolation()` probes it once and says so.

Full mode (Linux, root, namespaces work; the mode of the project's machines and CI):

* own mount namespace whose root is one private tmpfs of `disk_bytes` holding everything the
  program may write (its working dir /sandbox, /tmp, /var/tmp, /dev/shm): the disk budget is total,
  and it all disappears with the namespace (nothing to clean up on the host);
* read-only: /usr and the interpreter's own directories (prefix, base prefix: its standard library
  and site-packages) only; no project, no problem files, no home, no host sockets;
* own PID namespace with a fresh /proc (only the sandbox's processes; no host command lines); when
  the program's first process ends the kernel kills the rest;
* own network namespace (no interface but a down loopback; abstract unix sockets are per
  namespace too), own IPC namespace (SysV shared memory capped at `disk_bytes`, dies with it), own
  UTS namespace;
* a uid of its own, unique across every process on the host: leased under an flock'ed file in
  `/run/hydrajax-sandbox-uids` that is held for the whole run (so two checker processes never
  share one); RLIMIT_NPROC of that uid is then a total process budget;
* total memory: the namespace's first process sums the memory of every sandbox process (resident
  pages, and memfds held or mapped) every `POLL_S` and kills them all past `memory_bytes`; the
  poll may overshoot by what a program allocates within one period. (A cgroup would be exact, but
  cgroup v2 is not delegated on these machines: /sys/fs/cgroup is cgroup v1, with only hugetlb on
  the unified hierarchy.) RLIMIT_AS caps each process as well;
* RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_CORE 0, no new privileges, no supplementary groups, an
  environment of PATH, LANG and HOME only.

Weak mode (no namespaces: macOS, no root, a kernel or container that refuses them; `isolation()`
warns once): the program runs under the rlimits in a scratch dir of the host (removed with
`rm -rf`), as a leased uid when root (whose leftover processes are killed after the run; without
root, a process that left the run's process group may outlive it). The host's files readable by
others, /proc, the network (blocked only by a Python preamble in the APPS runner) and /tmp are
then reachable, memory is capped per process only and disk per file only.

Results come back only through pipes this process holds: stdout (capped at `max_output_bytes`
unless a sink takes it chunk by chunk), the tail of stderr, and the launcher's status pipe, which
the program has no descriptor of.
"""

import base64
import dataclasses
import fcntl
import functools
import json
import logging
import os
import pathlib
import pwd
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Callable, Mapping, Sequence

LAUNCHER = (pathlib.Path(__file__).parent / 'sandbox_launcher.py').read_text()
UID_LOCK_DIR = '/run/hydrajax-sandbox-uids'
UID_RANGE = 4096      # leased uids are base_uid .. base_uid + UID_RANGE - 1
POLL_S = 0.02         # the total-memory watch's period
STDERR_TAIL = 16384   # bytes of stderr kept (the last ones)
INODES = 65536        # files and directories the sandbox's tmpfs may hold


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  """Limits of one sandboxed run.

  Attributes:
    wall_s: wall-clock timeout; every process of the run is killed after it.
    cpu_s: CPU seconds (RLIMIT_CPU) of each process.
    memory_bytes: total resident memory of the run's processes (full mode), and the address space
      (RLIMIT_AS) of each process.
    disk_bytes: everything the run may write, together (full mode: the size of its tmpfs).
    file_bytes: largest file a process may write (RLIMIT_FSIZE).
    max_processes: processes the run may have at once (RLIMIT_NPROC of its own uid).
    max_output_bytes: bytes of stdout kept; past it the run is killed and `output_too_large` set.
    base_uid: first uid leased to runs when root.
    use_namespaces: use full mode where it works (False forces the weak mode).
  """

  wall_s: float = 10.0
  cpu_s: int = 10
  memory_bytes: int = 2 << 30
  disk_bytes: int = 256 << 20
  file_bytes: int = 128 << 20
  max_processes: int = 16
  max_output_bytes: int = 64 << 20
  base_uid: int = 62000
  use_namespaces: bool = True

  def __post_init__(self):
    if not self.wall_s > 0:
      raise ValueError(f'SandboxLimits.wall_s must be > 0, got {self.wall_s}')
    for field in ('cpu_s', 'memory_bytes', 'disk_bytes', 'file_bytes', 'max_processes',
                  'max_output_bytes'):
      if getattr(self, field) < 1:
        raise ValueError(f'SandboxLimits.{field} must be >= 1, got {getattr(self, field)}')
    if not 0 < self.base_uid < 2**31 - UID_RANGE:
      raise ValueError(f'SandboxLimits.base_uid must be in (0, 2**31 - {UID_RANGE}), '
                       f'got {self.base_uid}')


@dataclasses.dataclass(frozen=True)
class Isolation:
  """What contains a program on this machine (see the module docstring).

  Attributes:
    mode: 'full' (namespaces) or 'weak'.
    python: the interpreter that runs programs.
    unique_uid: each run has a uid no other process on the host has (we are root).
    reason: why the mode is weak ('' in full mode).
  """

  mode: str
  python: str
  unique_uid: bool
  reason: str = ''

  @property
  def full(self) -> bool:
    return self.mode == 'full'


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  """How a sandboxed run ended.

  Attributes:
    returncode: the program's exit status (negative: killed by that signal); None if it never ran.
    timed_out: killed by the wall timeout, or by the CPU limit (SIGXCPU / SIGKILL past it).
    output_too_large: stdout passed `max_output_bytes` and the run was killed.
    memory_exceeded: the total-memory watch killed the run.
    setup_error: why the sandbox could not be built ('' if it was).
    stdout: what the program wrote to stdout (b'' when a sink took it).
    stderr: the last STDERR_TAIL bytes of its stderr.
    wall_s: seconds it ran.
  """

  returncode: int | None
  timed_out: bool
  output_too_large: bool
  memory_exceeded: bool
  setup_error: str
  stdout: bytes
  stderr: bytes
  wall_s: float


def _interpreter_dirs(python: str) -> list[str]:
  """The directories `python` needs (its prefixes), read-only in the sandbox."""
  if os.path.realpath(python) == os.path.realpath(sys.executable):
    dirs = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
  else:
    out = subprocess.run(
        [python, '-I', '-c', 'import sys, json; print(json.dumps([sys.prefix, sys.base_prefix, '
                             'sys.exec_prefix, sys.base_exec_prefix]))'],
        capture_output=True, timeout=30, check=True, env={'PATH': '/usr/bin:/bin'})
    dirs = json.loads(out.stdout)
  dirs.append(os.path.dirname(os.path.realpath(python)))
  return [d for d in dirs if os.path.isabs(d) and os.path.realpath(d) != '/']


@functools.cache
def _binds(python: str) -> tuple[str, ...]:
  """What full mode shows the program (read-only): /usr and the interpreter's directories, each
  at its own path and at its real path (a venv's symlinks then resolve inside the sandbox)."""
  dirs = _interpreter_dirs(python)
  wanted = sorted({os.path.realpath(d) for d in ['/usr', *dirs]}
                  | {os.path.abspath(d) for d in dirs})
  out = []
  for d in wanted:  # sorted: a directory comes before those under it
    if not any(d == o or d.startswith(o + '/') for o in out):
      out.append(d)
  return tuple(out)


@functools.cache
def isolation(python: str | None = None, use_namespaces: bool = True) -> Isolation:
  """Probes (once per interpreter) what contains a program here; warns when it is weak."""
  python = python or sys.executable
  root = hasattr(os, 'geteuid') and os.geteuid() == 0
  reason = ''
  if not use_namespaces:
    reason = 'namespaces turned off (SandboxLimits.use_namespaces)'
  elif not sys.platform.startswith('linux'):
    reason = f'no Linux namespaces on {sys.platform}'
  elif not root:
    reason = 'not root: mount namespaces, uid leases and fresh /proc need root'
  else:
    probe = _launch(['-I', '-S', '-c', 'print(6 * 7)'], {}, b'', SandboxLimits(wall_s=30),
                    Isolation('full', python, True), None)
    if probe.setup_error or probe.stdout.strip() != b'42':
      reason = (f'namespaces do not work here ({probe.setup_error or probe.stderr[-300:]!r}, '
                f'exit {probe.returncode})')
  if reason:
    unique_uid = root and sys.platform.startswith('linux')
    if unique_uid and not _world_executable(python):
      candidates = (shutil.which('python3'), '/usr/bin/python3', '/usr/local/bin/python3')
      other = next((p for p in candidates if p and _world_executable(p)), None)
      if other is None:
        unique_uid = False
        reason += f'; no interpreter another uid may run ({python} is not): programs run as root'
      else:
        reason += f'; programs run on {other} ({python} is not executable by other uids)'
        python = other
    iso = Isolation('weak', python, unique_uid, reason)
    message = (f'sandbox in weak mode: {reason}. Programs can read the host\'s files, see its '
               'processes and reach its network; see hydrajax.evaluation.sandbox')
    warnings.warn(message, RuntimeWarning, stacklevel=2)
    logging.warning(message)
    return iso
  return Isolation('full', python, True)


def _world_executable(path: str) -> bool:
  """Whether any uid may run `path` (others' x bit on the file and on every parent directory)."""
  path = os.path.realpath(path)
  try:
    while True:
      if not os.stat(path).st_mode & stat.S_IXOTH:
        return False
      if path == os.path.dirname(path):
        return True
      path = os.path.dirname(path)
  except OSError:
    return False


def _live_uids() -> set[int]:
  """The uids of the host's processes (by /proc/<pid>'s owner)."""
  uids = set()
  for name in os.listdir('/proc') if os.path.isdir('/proc') else ():
    if name.isdigit():
      try:
        uids.add(os.stat(f'/proc/{name}').st_uid)
      except OSError:
        pass
  return uids


def _has_account(uid: int) -> bool:
  try:
    pwd.getpwuid(uid)
    return True
  except KeyError:
    return False


class _UidLease:
  """A uid no other process on this host has: no account, no live process, and an flock on
  UID_LOCK_DIR/<uid> held for the run (so no other run, in any process, takes it meanwhile)."""

  def __init__(self, base_uid: int):
    os.makedirs(UID_LOCK_DIR, mode=0o700, exist_ok=True)
    info = os.stat(UID_LOCK_DIR)
    if info.st_uid != 0 or info.st_mode & 0o077:
      raise RuntimeError(f'{UID_LOCK_DIR} must be root-only (0700), it is not')
    taken = _live_uids()
    for uid in range(base_uid, base_uid + UID_RANGE):
      if uid in taken or _has_account(uid):
        continue
      fd = os.open(os.path.join(UID_LOCK_DIR, str(uid)), os.O_CREAT | os.O_RDWR, 0o600)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        os.close(fd)
        continue
      self.uid, self._fd = uid, fd
      return
    raise RuntimeError(f'all {UID_RANGE} sandbox uids from {base_uid} are in use')

  def release(self) -> None:
    os.close(self._fd)  # closing the descriptor drops the flock


def run(
    argv: Sequence[str],
    *,
    files: Mapping[str, str | bytes] = {},
    stdin: bytes = b'',
    limits: SandboxLimits = SandboxLimits(),
    python: str | None = None,
    stdout_sink: Callable[[bytes], bool] | None = None,
) -> SandboxResult:
  """Runs `python *argv` in a fresh sandbox holding `files` in its working dir, within `limits`.

  Args:
    argv: the interpreter's arguments (e.g. ['-I', 'runner.py']), paths relative to the working dir.
    files: name -> content written into the working dir first (plain names, no folders).
    stdin: the program's stdin (a real file descriptor: `open(0)` and `os.read(0, n)` work).
    limits: the limits.
    python: the interpreter (default: this process's own).
    stdout_sink: called with each chunk of stdout as it comes; returning False ends the run. When
      given, stdout is not kept (and `max_output_bytes` is the sink's to enforce).

  Thread-safe: concurrent runs (in this process or others) get different uids when root.
  """
  for name in files:
    if not name or '/' in name or name in ('.', '..'):
      raise ValueError(f'files names must be plain file names, got {name!r}')
  iso = isolation(python, limits.use_namespaces)
  lease = _UidLease(limits.base_uid) if iso.unique_uid else None
  try:
    return _launch(list(argv), files, stdin, limits, iso, lease.uid if lease else None,
                   stdout_sink)
  finally:
    if lease is not None:
      lease.release()


def _launch(argv, files, stdin, limits, iso, uid, stdout_sink=None) -> SandboxResult:
  scratch = None if iso.full else tempfile.mkdtemp(prefix='hydrajax_sandbox_')
  status_r, status_w = os.pipe()
  try:
    rlimits = [(resource.RLIMIT_CPU, limits.cpu_s, limits.cpu_s + 1),
               (resource.RLIMIT_AS, limits.memory_bytes, limits.memory_bytes),
               (resource.RLIMIT_FSIZE, limits.file_bytes, limits.file_bytes),
               (resource.RLIMIT_CORE, 0, 0)]
    if uid is not None or os.geteuid() != 0:
      nproc = limits.max_processes
      if uid is None:  # not root: the quota counts every process of our user
        nproc += len(_processes_of(os.getuid()))
      rlimits.append((resource.RLIMIT_NPROC, nproc, nproc))
    home = '/sandbox' if iso.full else scratch
    config = dict(
        namespaces=iso.full, status_fd=status_w, parent_pid=os.getpid(),
        wall_s=limits.wall_s + 5.0, uid=uid, python=iso.python, argv=list(argv),
        binds=list(_binds(iso.python)) if iso.full else [], disk_bytes=limits.disk_bytes,
        inodes=INODES, memory_bytes=limits.memory_bytes, poll_s=POLL_S, rlimits=rlimits,
        env={'PATH': '/usr/bin:/bin', 'LANG': 'C.UTF-8', 'HOME': home},
        files={k: base64.b64encode(v.encode() if isinstance(v, str) else v).decode()
               for k, v in files.items()},
        stdin=base64.b64encode(stdin).decode())
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, '-I', '-S', '-c', LAUNCHER], cwd=scratch or '/',
                            env={}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, pass_fds=(status_w,), start_new_session=True)
    os.close(status_w)
    status_w = None
    try:
      try:
        proc.stdin.write(json.dumps(config).encode())
        proc.stdin.close()
      except BrokenPipeError:
        pass
      streams = _collect(proc, status_r, limits, stdout_sink, start)
    finally:
      _kill_group(proc.pid)
      proc.wait()
      for f in (proc.stdout, proc.stderr):
        f.close()
    wall = time.perf_counter() - start
    return _result(proc.returncode, streams, wall)
  finally:
    if status_w is not None:
      os.close(status_w)
    os.close(status_r)
    if uid is not None and not iso.full:
      _kill_uid(uid)  # weak mode: no PID namespace takes leftovers down
    if scratch is not None:
      remove_tree(scratch)


def _collect(proc, status_r, limits, stdout_sink, start) -> dict:
  """Reads stdout, stderr and the status pipe until the run ends or is cut short."""
  out = dict(stdout=bytearray(), stderr=bytearray(), status=bytearray(), timed_out=False,
             too_large=False)
  sel = selectors.DefaultSelector()
  sel.register(proc.stdout, selectors.EVENT_READ, 'stdout')
  sel.register(proc.stderr, selectors.EVENT_READ, 'stderr')
  sel.register(status_r, selectors.EVENT_READ, 'status')
  deadline = start + limits.wall_s
  exited_at = None
  try:
    while sel.get_map():
      now = time.perf_counter()
      if now > deadline:
        out['timed_out'] = True
        return out
      if exited_at is None and proc.poll() is not None:
        exited_at = now
      if exited_at is not None and now > exited_at + 1.0:
        return out  # a leftover (weak mode) holds a pipe open: stop waiting for it
      for key, _ in sel.select(timeout=min(0.1, max(0.0, deadline - now))):
        fd = key.fileobj if isinstance(key.fileobj, int) else key.fileobj.fileno()
        chunk = os.read(fd, 1 << 20)
        if not chunk:
          sel.unregister(key.fileobj)
          continue
        if key.data == 'stdout':
          if stdout_sink is not None:
            if not stdout_sink(chunk):
              return out
          else:
            out['stdout'] += chunk
            if len(out['stdout']) > limits.max_output_bytes:
              del out['stdout'][limits.max_output_bytes:]
              out['too_large'] = True
              return out
        elif key.data == 'stderr':
          out['stderr'] = (out['stderr'] + chunk)[-STDERR_TAIL:]
        elif len(out['status']) < 65536:
          out['status'] += chunk
    proc.wait(timeout=max(0.1, deadline - time.perf_counter()))
  except subprocess.TimeoutExpired:
    out['timed_out'] = True
  finally:
    sel.close()
  return out


def _result(launcher_rc, streams, wall) -> SandboxResult:
  returncode, setup, memory = None, '', False
  for line in bytes(streams['status']).decode('utf-8', 'replace').splitlines():
    kind, _, value = line.partition(' ')
    if kind == 'exit' and value.lstrip('-').isdigit():
      returncode = int(value)
    elif kind == 'signal' and value.isdigit():
      returncode = -int(value)
    elif kind == 'setup':
      setup = value
    elif kind == 'memory':
      memory = True
  if returncode is None and not setup and not streams['timed_out'] and launcher_rc not in (
      None, -signal.SIGKILL):
    setup = f'the sandbox launcher ended with exit {launcher_rc} and no status'
  killed = returncode in (-signal.SIGXCPU, -signal.SIGKILL) and not memory  # the CPU limit
  timed_out = streams['timed_out'] or killed
  return SandboxResult(returncode, timed_out, streams['too_large'], memory, setup,
                       bytes(streams['stdout']), bytes(streams['stderr']), wall)


def _kill_group(pid: int) -> None:
  """SIGKILL to the process group the run started (in full mode its init takes the rest down)."""
  try:
    os.killpg(pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def _processes_of(uid: int) -> list[int]:
  pids = []
  for name in os.listdir('/proc') if os.path.isdir('/proc') else ():
    if name.isdigit():
      try:
        with open(f'/proc/{name}/status') as f:
          line = next(x for x in f if x.startswith('Uid:'))
        if int(line.split()[1]) == uid:
          pids.append(int(name))
      except (OSError, StopIteration, ValueError, IndexError):
        pass
  return pids


def _kill_uid(uid: int) -> None:
  for _ in range(3):  # a forking leftover may add processes while we kill
    pids = _processes_of(uid)
    if not pids:
      return
    for pid in pids:
      try:
        os.kill(pid, signal.SIGKILL)
      except OSError:
        pass
    time.sleep(0.05)


def remove_tree(path: str) -> None:
  """Deletes `path` however deep it goes: `rm -rf` (no recursion limit), else a bottom-up walk."""
  try:
    subprocess.run(['rm', '-rf', '--', path], capture_output=True, timeout=120,
                   env={'PATH': '/usr/bin:/bin'})
  except (OSError, subprocess.SubprocessError):
    pass
  if os.path.lexists(path):
    for dirpath, dirnames, filenames in os.walk(path, topdown=False):  # iterative from 3.12
      for name in filenames + dirnames:
        full = os.path.join(dirpath, name)
        try:
          (os.rmdir if name in dirnames and not os.path.islink(full) else os.unlink)(full)
        except OSError:
          pass
    try:
      os.rmdir(path)
    except OSError:
      pass
