"""The sandbox's launcher: a script the checker's own interpreter runs as root (never imported).

`sandbox.run` starts `python -I -S -c <this file's text>` with the run's settings as JSON on
stdin and a status pipe as fd 3. The launcher

1. (namespaces) unshares mount, IPC, network, UTS and PID namespaces and forks the PID
   namespace's first process (below, "init");
2. init builds the program's root on one fresh tmpfs of `disk_bytes` (every writable byte the
   program has: its dir /sandbox, /tmp, /var/tmp, /dev/shm), binds the interpreter's directories
   and /usr read-only into it, mounts a fresh /proc (only the sandbox's processes), caps SysV IPC
   in the new IPC namespace, writes the files, and chroots into it;
3. init forks the program: no groups, the run's own uid (`setresuid`, which drops every
   capability), no new privileges, the rlimits, then exec of the interpreter;
4. init reaps every process, sums the memory of the sandbox's processes (resident pages, and
   memfds they hold or map) every `poll_s` and kills them all when the sum passes
   `memory_bytes`; it ends when the program's first process does, and the kernel then kills
   whatever is left in the PID namespace.

The launcher, init and the program's first process die with their parent (PR_SET_PDEATHSIG), so
a checker that is killed takes its runs down; init also kills the program past `wall_s`.

Without namespaces (`namespaces` false) steps 1-2 and the memory watch are skipped: the program
runs in the directory the caller made, with the uid drop (when root) and the rlimits only.

The status pipe (fd `status_fd`, closed in the program before exec: nothing it does reaches it)
carries one line per event: `setup <reason>`, `memory <bytes>`, `exit <code>` or `signal <number>`.
"""

import base64
import ctypes
import json
import os
import resource
import select
import signal
import sys
import time

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x4000000, 0x8000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
STAGES = ('/mnt', '/media', '/srv', '/tmp', '/var/tmp', '/opt')  # where the new root is built
TOP_LINKS = ('bin', 'sbin', 'lib', 'lib32', 'lib64', 'libx32')   # merged-/usr symlinks
DEVICES = ('null', 'zero', 'full', 'random', 'urandom')

libc = ctypes.CDLL(None, use_errno=True)


STATUS_FD = None  # set from the settings


def status(line):
  try:
    os.write(STATUS_FD, (line + '\n').encode())
  except OSError:
    pass


def prctl(option, value):
  """prctl(2) where there is one (Linux); a no-op elsewhere (the weak mode of macOS)."""
  if hasattr(libc, 'prctl'):
    libc.prctl(option, value, 0, 0, 0)


def check(rc, what):
  if rc != 0:
    err = ctypes.get_errno()
    raise OSError(err, f'{what}: {os.strerror(err)}')


def mount(source, target, fstype, flags, data=None):
  enc = lambda s: s.encode() if s is not None else None
  check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
        f'mount {target}')


def unshare(flags):
  if hasattr(os, 'unshare'):
    os.unshare(flags)
  else:
    check(libc.unshare(flags), 'unshare')


def under(path, root):
  return path == root or path.startswith(root.rstrip('/') + '/')


def build_root(cfg):
  """The program's filesystem (see the module docstring); returns the new root's path."""
  binds = [b for b in cfg['binds'] if os.path.exists(b)]
  stage = next(s for s in STAGES if os.path.isdir(s) and not os.path.islink(s)
               and not any(under(b, s) or under(s, b) for b in binds))
  mount('tmpfs', stage, 'tmpfs', MS_NOSUID | MS_NODEV,
        f'size={cfg["disk_bytes"]},nr_inodes={cfg["inodes"]},mode=755')
  for name, mode in (('proc', 0o555), ('dev', 0o755), ('dev/shm', 0o1777), ('tmp', 0o1777),
                     ('var', 0o755), ('var/tmp', 0o1777), ('sandbox', 0o700)):
    os.mkdir(os.path.join(stage, name))
    os.chmod(os.path.join(stage, name), mode)
  for name in TOP_LINKS:
    if os.path.islink('/' + name):
      os.symlink(os.readlink('/' + name), os.path.join(stage, name))
  for source in binds:
    target = stage + source
    if os.path.isdir(source):
      os.makedirs(target, exist_ok=True)
    else:
      os.makedirs(os.path.dirname(target), exist_ok=True)
      open(target, 'w').close()
    mount(source, target, None, MS_BIND | MS_REC)
    mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
  for name in DEVICES:
    target = os.path.join(stage, 'dev', name)
    open(target, 'w').close()
    mount('/dev/' + name, target, None, MS_BIND)
  for i, name in enumerate(('stdin', 'stdout', 'stderr')):
    os.symlink(f'/proc/self/fd/{i}', os.path.join(stage, 'dev', name))
  os.symlink('/proc/self/fd', os.path.join(stage, 'dev', 'fd'))
  mount('proc', os.path.join(stage, 'proc'), 'proc', MS_NOSUID | MS_NODEV | MS_NOEXEC)
  # SysV IPC of the new IPC namespace: shared memory within the disk budget, few queues.
  pages = max(1, cfg['disk_bytes'] // os.sysconf('SC_PAGE_SIZE'))
  for name, value in (('shmmax', cfg['disk_bytes']), ('shmall', pages), ('shmmni', 64),
                      ('msgmni', 16), ('msgmnb', 65536)):
    with open(f'/proc/sys/kernel/{name}', 'w') as f:
      f.write(str(value))
  return stage


def write_files(cfg, folder, uid):
  for name, content in cfg['files'].items():
    path = os.path.join(folder, name)
    with open(path, 'wb') as f:
      f.write(base64.b64decode(content))
    if uid is not None:
      os.chown(path, uid, uid)
  if uid is not None:
    os.chown(folder, uid, uid)


def stdin_fd(cfg, folder):
  """The program's stdin: a real file (a memfd, else an unlinked file) holding the given bytes."""
  data = base64.b64decode(cfg['stdin'])
  if hasattr(os, 'memfd_create'):
    fd = os.memfd_create('stdin')
  else:
    path = os.path.join(folder, '.stdin')
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(path)
  os.write(fd, data)
  os.lseek(fd, 0, os.SEEK_SET)
  return fd


def exec_program(cfg, fd0):
  """In the forked child: drop to the run's uid, set the limits, exec. Never returns."""
  try:
    os.dup2(fd0, 0)
    os.closerange(3, 1 << 16)
    uid = cfg['uid']
    if uid is not None:
      os.setgroups([])
      os.setresgid(uid, uid, uid)
      os.setresuid(uid, uid, uid)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setresuid, which clears it
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    for kind, soft, hard in cfg['rlimits']:
      resource.setrlimit(kind, (soft, hard))
    os.execve(cfg['python'], [cfg['python'], *cfg['argv']], cfg['env'])
  except BaseException as e:  # noqa: BLE001 - the child must never return into init's code
    try:
      os.write(2, f'sandbox: could not start the program: {e}\n'.encode())
    finally:
      os._exit(127)


def resident_bytes(exclude):
  """Memory of the sandbox's processes: resident pages, and the pages of memfds they hold open or
  map (memory outside the tmpfs's size cap that resident pages do not show)."""
  total, memfds = 0, set()
  for name in os.listdir('/proc'):
    if name.isdigit() and int(name) not in exclude:
      try:
        with open(f'/proc/{name}/statm') as f:
          total += int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
      except (OSError, IndexError, ValueError):
        continue
      total += memfd_bytes(name, memfds)
  return total


def memfd_bytes(pid, seen):
  """Bytes of the memfds process `pid` has open or mapped that are not in `seen` (then added)."""
  paths = []
  try:
    for fd in os.listdir(f'/proc/{pid}/fd'):
      if os.readlink(f'/proc/{pid}/fd/{fd}').startswith('/memfd:'):
        paths.append(f'/proc/{pid}/fd/{fd}')
    with open(f'/proc/{pid}/maps') as f:
      paths += [f'/proc/{pid}/map_files/{line.split()[0]}' for line in f if '/memfd:' in line]
  except OSError:
    pass
  total = 0
  for path in paths:
    try:
      info = os.stat(path)
    except OSError:
      continue
    if (info.st_dev, info.st_ino) not in seen:
      seen.add((info.st_dev, info.st_ino))
      total += info.st_blocks * 512
  return total


def watch(cfg, child):
  """Init's loop: reap, watch the memory, return the program's wait status."""
  pidfd = os.pidfd_open(child) if hasattr(os, 'pidfd_open') else None
  me = os.getpid()
  deadline = time.monotonic() + cfg['wall_s']  # a backstop: the caller enforces the wall limit
  while True:
    if time.monotonic() > deadline:
      os.kill(child, signal.SIGKILL)
    while True:
      try:
        pid, wstatus = os.waitpid(-1, os.WNOHANG)
      except ChildProcessError:
        return 0
      if pid == 0:
        break
      if pid == child:
        return wstatus
    if cfg['namespaces']:
      used = resident_bytes({me})
      if used > cfg['memory_bytes']:
        status(f'memory {used}')
        for name in os.listdir('/proc'):
          if name.isdigit() and int(name) != me:
            try:
              os.kill(int(name), signal.SIGKILL)
            except OSError:
              pass
    if pidfd is not None:
      select.select([pidfd], [], [], cfg['poll_s'])
    else:
      time.sleep(cfg['poll_s'])


def init(cfg):
  """The PID namespace's first process (or, without namespaces, the program's parent)."""
  try:
    if cfg['namespaces']:
      prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
      stage = build_root(cfg)
      folder = os.path.join(stage, 'sandbox')
    else:
      folder = os.getcwd()
    write_files(cfg, folder, cfg['uid'])
    fd0 = stdin_fd(cfg, folder)
    if cfg['namespaces']:
      libc.sethostname(b'sandbox', 7)
      os.chroot(stage)
      os.chdir('/sandbox')
  except Exception as e:  # noqa: BLE001 - any failure to build the sandbox is reported, not run
    status(f'setup {type(e).__name__}: {e}')
    os._exit(125)
  child = os.fork()
  if child == 0:
    exec_program(cfg, fd0)
  os.close(fd0)
  wstatus = watch(cfg, child)
  if os.WIFSIGNALED(wstatus):
    status(f'signal {os.WTERMSIG(wstatus)}')
    os._exit(128 + os.WTERMSIG(wstatus))
  code = os.WEXITSTATUS(wstatus)
  status(f'exit {code}')
  os._exit(code)


def main():
  global STATUS_FD
  os.umask(0o022)
  cfg = json.loads(sys.stdin.buffer.read())
  STATUS_FD = cfg['status_fd']
  prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the caller gone: so is the run
  if os.getppid() != cfg['parent_pid']:
    os._exit(125)
  os.dup2(os.open('/dev/null', os.O_RDONLY), 0)
  if not cfg['namespaces']:
    init(cfg)
  try:
    unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWUTS | CLONE_NEWPID)
    mount(None, '/', None, MS_REC | MS_PRIVATE)
  except OSError as e:
    status(f'setup namespaces: {e}')
    os._exit(125)
  child = os.fork()
  if child == 0:
    init(cfg)
  _, wstatus = os.waitpid(child, 0)
  os._exit(os.waitstatus_to_exitcode(wstatus) if os.WIFEXITED(wstatus)
           else 128 + os.WTERMSIG(wstatus))


main()
