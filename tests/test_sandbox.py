"""Hostile programs are contained by the sandbox, reported, and the run goes on.

Short limits keep this fast and safe on a small machine: the fork bomb only ever runs with
RLIMIT_NPROC enforced at 4 processes (skipped where the platform cannot enforce it).
"""

import dataclasses
import os
import socket
import tempfile
import threading

import pytest

from hydrajax.evaluation import apps, checker, sandbox
from hydrajax.evaluation.checker import Status

LIMITS = sandbox.SandboxLimits(wall_s=3.0, cpu_s=2, memory_bytes=512 << 20, file_bytes=1 << 20,
                               max_processes=4)
CONFIG = checker.CheckConfig(test_timeout_s=1.0, limits=LIMITS, workers=2)
ADD = apps.Problem('add', 'Print a + b.', ('1 2\n', '40 2\n'), ('3\n', '42\n'))
GOOD = 'a, b = map(int, input().split())\nprint(a + b)\n'


def check(program: str) -> checker.ProgramResult:
  return checker.check_program(ADD, program, CONFIG)


def test_a_good_program_passes():
  result = check(GOOD)
  assert result.status is Status.PASSED and result.tests_passed == 2


def test_infinite_loop_times_out():
  result = check('while True:\n  pass\n')
  assert result.status is Status.TIMED_OUT
  assert result.wall_s < LIMITS.wall_s + 5


def test_sleeping_forever_times_out():
  result = check('import time\ntime.sleep(1000)\n')
  assert result.status is Status.TIMED_OUT


def test_unbounded_allocation_is_a_runtime_error():
  small = dataclasses.replace(LIMITS, memory_bytes=256 << 20)
  config = dataclasses.replace(CONFIG, test_timeout_s=5.0, limits=small)
  result = checker.check_program(ADD, 'x = []\nwhile True:\n  x.append(bytearray(10**8))\n', config)
  assert result.status is Status.RUNTIME_ERROR
  assert 'MemoryError' in result.detail


def test_huge_file_write_is_capped():
  program = ('with open("big", "wb") as f:\n'
             '  for _ in range(1000):\n'
             '    f.write(b"x" * 10**6)\n')
  result = check(program)
  assert result.status is Status.RUNTIME_ERROR
  assert 'File too large' in result.detail or 'Errno 27' in result.detail


def test_huge_stdout_is_capped():
  result = check('import os\nwhile True:\n  os.write(1, b"y" * 65536)\n')
  assert result.status in (Status.RUNTIME_ERROR, Status.TIMED_OUT)


def test_the_scratch_dir_is_fresh_and_deleted():
  listing = sandbox.run(['-c', 'import os; print(sorted(os.listdir(".")), os.getcwd())'],
                        limits=LIMITS)
  names, cwd = listing.stdout.decode().rsplit(' ', 1)
  assert names == '[]'
  assert not os.path.exists(cwd.strip())


def test_environment_is_stripped():
  os.environ['HYDRAJAX_SECRET_FOR_TEST'] = 'x'
  try:
    result = sandbox.run(['-c', 'import os; print(sorted(os.environ))'], limits=LIMITS)
  finally:
    del os.environ['HYDRAJAX_SECRET_FOR_TEST']
  assert result.stdout.decode().strip() == "['HOME', 'LANG', 'PATH']"


def test_deleting_files_outside_its_dir_fails():
  iso = sandbox.isolation(LIMITS.use_namespaces, LIMITS.base_uid)
  if not iso.drop_uid:
    pytest.skip('files of our own uid stay writable without root (documented limit)')
  with tempfile.TemporaryDirectory() as folder:
    os.chmod(folder, 0o755)
    victim = os.path.join(folder, 'precious.txt')
    with open(victim, 'w') as f:
      f.write('keep me')
    result = check(f'import os, shutil\nos.remove({victim!r})\nshutil.rmtree({folder!r})\n')
    assert result.status is Status.RUNTIME_ERROR
    assert 'PermissionError' in result.detail
    assert open(victim).read() == 'keep me'


def test_sockets_cannot_reach_a_local_server():
  server = socket.socket()
  server.bind(('127.0.0.1', 0))
  server.listen(1)
  server.settimeout(3)
  port = server.getsockname()[1]
  accepted = []

  def accept():
    try:
      accepted.append(server.accept())
    except OSError:
      pass

  thread = threading.Thread(target=accept)
  thread.start()
  try:
    result = check(f'import socket\ns = socket.create_connection(("127.0.0.1", {port}), timeout=2)\n'
                   's.sendall(b"hello")\n')
  finally:
    thread.join()
    server.close()
  assert result.status is Status.RUNTIME_ERROR
  assert not accepted


def test_fork_bomb_is_capped_and_the_run_goes_on():
  iso = sandbox.isolation(LIMITS.use_namespaces, LIMITS.base_uid)
  if not iso.nproc_enforced:
    pytest.skip('RLIMIT_NPROC cannot be enforced here: never run a fork bomb without it')
  bomb = ('import os\n'
          'while True:\n'
          '  try:\n'
          '    os.fork()\n'
          '  except OSError:\n'
          '    pass\n')
  report = checker.check_programs(ADD, [bomb, GOOD], CONFIG)
  assert report.results[0].status is Status.TIMED_OUT
  assert report.results[1].status is Status.PASSED
  assert report.num_correct == 1


def test_forks_beyond_the_limit_fail():
  iso = sandbox.isolation(LIMITS.use_namespaces, LIMITS.base_uid)
  if not iso.nproc_enforced or not iso.drop_uid:
    pytest.skip('an exact count needs the dropped uid (without root the quota is shared)')
  program = ('import os, time\n'
             'n = 0\n'
             'for _ in range(10):\n'
             '  try:\n'
             '    if os.fork() == 0:\n'
             '      time.sleep(30)\n'
             '      os._exit(0)\n'
             '    n += 1\n'
             '  except OSError:\n'
             '    pass\n'
             'print(n)\n')
  result = sandbox.run(['p.py'], files={'p.py': program}, limits=LIMITS)
  assert result.stdout.strip() == b'3'  # 4 processes: itself and 3 children


def test_exit_and_os_exit():
  assert check('import sys\nprint(sum(map(int, input().split())))\nsys.exit(0)\n').passed
  result = check('import os\nos._exit(3)\n')
  assert result.status is Status.RUNTIME_ERROR


def test_limits_are_validated():
  with pytest.raises(ValueError, match='max_processes'):
    sandbox.SandboxLimits(max_processes=0)
  with pytest.raises(ValueError, match='wall_s'):
    sandbox.SandboxLimits(wall_s=0)
