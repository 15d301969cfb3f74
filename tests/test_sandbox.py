"""Hostile and tricky programs against the sandbox and the APPS checker.

Every program here is the project's own. Full-mode tests (namespaces, root: the project's machines
and CI) skip with the reason where the machine cannot give that mode. Short limits keep each run
well under a second of CPU; the fork bomb only runs with a per-uid RLIMIT_NPROC of 4.
"""

import ast
import dataclasses
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from hydrajax.evaluation import apps, apps_runner, checker, sandbox
from hydrajax.evaluation.checker import Status

LIMITS = sandbox.SandboxLimits(wall_s=5.0, cpu_s=3, memory_bytes=512 << 20, disk_bytes=64 << 20,
                               file_bytes=32 << 20, max_processes=4)
CONFIG = checker.CheckConfig(test_timeout_s=2.0, limits=LIMITS, workers=2)
ADD = apps.Problem('add', 'Print a + b.', ('1 2\n', '40 2\n'), ('3\n', '42\n'))
ONE = apps.Problem('three', 'Print 3.', ('\n',), ('3\n',))
GOOD = 'a, b = map(int, input().split())\nprint(a + b)\n'


def full_mode():
  iso = sandbox.isolation()
  if not iso.full:
    pytest.skip(f'full isolation unavailable here: {iso.reason}')
  return iso


def run(source: str, limits: sandbox.SandboxLimits = LIMITS, **kw) -> sandbox.SandboxResult:
  return sandbox.run(['-I', 'p.py'], files={'p.py': textwrap.dedent(source)}, limits=limits, **kw)


def statuses(problem, programs, config=CONFIG):
  return [r.status for r in checker.check_programs(problem, programs, config).results]


# ---------------------------------------------------------------------------
# Verdicts come from the parent alone; one program never stops the run


def test_forged_results_never_pass_and_the_run_goes_on():
  forged = [
      'print("[]")\nprint(\'{"compile_error": 1}\')\n',                  # the old JSON records
      'import os\nfor fd in range(3, 64):\n  try:\n    os.write(fd, b"\\x00" * 64)\n'
      '  except OSError:\n    pass\n',                                   # garbage on every fd
      'import os\nfor fd in range(3, 64):\n  try:\n    os.write(fd, b"Z" + bytes(8))\n'
      '  except OSError:\n    pass\n',                                   # an unknown frame kind
      'import os\nfor fd in range(3, 64):\n  try:\n'
      '    os.write(fd, b"O" + (1 << 40).to_bytes(8, "big"))\n'
      '  except OSError:\n    pass\n',                                   # a 1 TiB frame
      'import os\nfor fd in range(3, 64):\n  try:\n    os.write(fd, b"O\\x00")\n'
      '  except OSError:\n    pass\nos._exit(0)\n',                      # a frame cut short
  ]
  results = checker.check_programs(ADD, forged + [GOOD], CONFIG).results
  assert [r.status for r in results[:-1]] != [Status.PASSED] * len(forged)
  assert not any(r.passed for r in results[:-1]), results
  assert results[-1].passed
  assert {r.status for r in results[:-1]} <= {Status.FAILED, Status.ERROR, Status.OUTPUT_TOO_LARGE,
                                             Status.RUNTIME_ERROR}


def test_a_failure_to_judge_is_that_programs_error_verdict(monkeypatch):
  real_run = sandbox.run

  def flaky_run(argv, files, **kw):
    if 'explode' in files['program.py']:
      raise RuntimeError('no sandbox for you')
    return real_run(argv, files=files, **kw)

  monkeypatch.setattr(sandbox, 'run', flaky_run)
  report = checker.check_programs(ADD, ['# explode\n', GOOD], CONFIG)
  assert report.results[0].status is Status.ERROR
  assert 'no sandbox for you' in report.results[0].detail
  assert report.results[1].passed
  assert report.counts()['error'] == 1


def test_output_past_the_cap_is_its_own_verdict():
  small = dataclasses.replace(CONFIG, max_output_bytes=1 << 20)
  programs = ['import sys\nsys.stdout.write("y" * (2 << 20))\n',
              'import os\nwhile True:\n  os.write(1, b"y" * 65536)\n']
  assert statuses(ADD, programs, small) == [Status.OUTPUT_TOO_LARGE] * 2


def test_deep_directory_trees_are_cleaned_up(tmp_path):
  deep = ('import os\nfor _ in range({n}):\n  os.mkdir("d")\n  os.chdir("d")\n'
          'os.chdir("{tmp}")\nfor _ in range({n}):\n  os.mkdir("e")\n  os.chdir("e")\nprint(4)\n')
  assert checker.check_program(ONE, deep.format(n=1500, tmp='/tmp'), CONFIG).status is Status.FAILED
  weak = dataclasses.replace(CONFIG, limits=dataclasses.replace(LIMITS, use_namespaces=False))
  with pytest.warns(RuntimeWarning, match='weak mode'):
    sandbox.isolation.cache_clear()
    sandbox.isolation(None, False)
  # Weak mode's scratch dir is on the host's disk, where deleting deep trees is slow: 2 x 300.
  assert checker.check_program(ONE, deep.format(n=300, tmp='.'), weak).status is Status.FAILED
  # Deeper than Python's recursion limit and PATH_MAX, on a tmpfs where there is one.
  folder = tempfile.mkdtemp(dir='/dev/shm' if os.path.isdir('/dev/shm') else tmp_path)
  fd = os.open(folder, os.O_RDONLY)
  for _ in range(1200):
    os.mkdir('dddd', dir_fd=fd)
    fd, old = os.open('dddd', os.O_RDONLY, dir_fd=fd), fd
    os.close(old)
  os.close(fd)
  sandbox.remove_tree(folder)
  assert not os.path.exists(folder)


# ---------------------------------------------------------------------------
# Isolation from the host and from other runs (full mode)


def test_only_the_sandbox_processes_are_visible_and_the_problem_file_is_not(tmp_path):
  full_mode()
  answers = [str(random.Random(7).randrange(10**9)) for _ in range(2)]
  problem_file = tmp_path / 'problems.jsonl'
  problem = apps.Problem('secret', 'Guess.', ('\n', '\n'), tuple(a + '\n' for a in answers))
  problem_file.write_text(json.dumps(problem.to_record()) + '\n')
  os.chmod(tmp_path, 0o755)
  os.chmod(problem_file, 0o644)
  cheat = textwrap.dedent(f'''
      import glob, json, os
      pids = [p for p in os.listdir("/proc") if p.isdigit()]
      lines = [open(f"/proc/{{p}}/cmdline", "rb").read() for p in pids]
      assert all(b"pytest" not in l for l in lines), lines
      assert len(pids) <= 3, pids
      record = json.loads(open({str(problem_file)!r}).readline())
      print(json.loads(record["input_output"])["outputs"][0])
  ''')
  result = checker.check_program(problem, cheat, CONFIG)
  assert result.status is Status.RUNTIME_ERROR
  assert 'FileNotFoundError' in result.detail


def test_host_files_are_not_visible(tmp_path):
  full_mode()
  secret = tmp_path / 'secret.txt'
  secret.write_text('x')
  os.chmod(tmp_path, 0o755)
  here = os.path.abspath(__file__)
  home = os.path.expanduser('~')
  interpreter = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}
  home_files = [os.path.join(home, n) for n in sorted(os.listdir(home))
                if not any(p.startswith(os.path.join(home, n)) for p in interpreter)][:20]
  result = run(f'''
      import os, sys
      paths = [{str(secret)!r}, {here!r}, "/etc/passwd", "/work/main/README.md", "/run", "/sys",
               "/var/log"] + {home_files!r}
      print(sorted(p for p in paths if os.path.exists(p)))
      print(sorted(os.listdir("/")))
      print(os.access(sys.prefix, os.W_OK), os.access("/usr/bin", os.W_OK))
      import importlib.util
      print(importlib.util.find_spec("hydrajax"))
  ''')
  seen, top, writable, project = result.stdout.decode().splitlines()
  assert seen == '[]'
  if not os.path.realpath(apps.__file__).startswith(os.path.realpath(sys.prefix)):
    assert project == 'None'  # the project's source (an editable install) is not there
  interpreter_tops = {p.strip('/').split('/')[0] for p in (sys.prefix, sys.base_prefix)}
  assert set(ast.literal_eval(top)) <= {'bin', 'dev', 'lib', 'lib32', 'lib64', 'libx32', 'proc',
                                        'sandbox', 'sbin', 'tmp', 'usr', 'var'} | interpreter_tops
  assert writable == 'False False'


def test_temporary_files_and_shared_memory_do_not_outlive_a_run():
  full_mode()
  leave = run('''
      import ctypes, os
      for d in ("/tmp", "/var/tmp", "/dev/shm", "."):
        open(os.path.join(d, "hydrajax-left-behind"), "w").write("x")
      libc = ctypes.CDLL(None, use_errno=True)
      shmid = libc.shmget(0x4859444A, 1 << 20, 0o1666)  # IPC_CREAT | 0666, never removed
      print(shmid >= 0)
  ''')
  assert leave.stdout.strip() == b'True', leave
  # An interpreter kept under /tmp (a venv there) is mounted at its path: its top folder shows.
  mounts = sorted({d.split('/')[2] for d in sandbox._binds(sys.executable)
                   if d.startswith('/tmp/')})
  look = run(f'''
      import ctypes, os
      own = {{"/tmp": {mounts!r}, "/var/tmp": [], "/dev/shm": [], ".": ["p.py"]}}
      print([(d, os.listdir(d)) for d, names in own.items() if sorted(os.listdir(d)) != names])
      print(ctypes.CDLL(None).shmget(0x4859444A, 0, 0o666) < 0)
  ''')
  assert look.stdout.decode().split('\n')[:2] == ['[]', 'True'], look
  for d in ('/tmp', '/var/tmp', '/dev/shm'):
    assert not os.path.exists(os.path.join(d, 'hydrajax-left-behind'))
  with open('/proc/sysvipc/shm') as f:
    assert '1213809738' not in f.read()  # 0x4859444A


def test_two_checker_processes_never_share_a_uid():
  full_mode()
  path = os.path.join(os.path.dirname(sandbox.__file__), 'sandbox.py')
  child = textwrap.dedent(f'''
      import importlib.util
      spec = importlib.util.spec_from_file_location('sandbox_copy', {path!r})
      sb = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(sb)
      r = sb.run(['-I', '-c', 'import os, time; print(os.getuid()); time.sleep(2)'],
                 limits=sb.SandboxLimits(wall_s=20))
      print(r.stdout.decode().strip())
  ''')
  procs = [subprocess.Popen([sys.executable, '-I', '-c', child], stdout=subprocess.PIPE)
           for _ in range(2)]
  uids = [int(p.communicate(timeout=60)[0].split()[-1]) for p in procs]
  assert len(set(uids)) == 2 and all(u >= LIMITS.base_uid for u in uids), uids


def test_daemons_die_with_their_run():
  full_mode()
  result = run('''
      import os, time
      print(os.getuid(), flush=True)
      if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
          time.sleep(100)
        os._exit(0)
  ''')
  uid = int(result.stdout)
  assert uid not in sandbox._live_uids()


def test_a_killed_checker_takes_its_programs_down():
  full_mode()
  path = os.path.join(os.path.dirname(sandbox.__file__), 'sandbox.py')
  child = textwrap.dedent(f'''
      import importlib.util, sys
      spec = importlib.util.spec_from_file_location('sandbox_copy', {path!r})
      sb = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(sb)
      def show(chunk):
        sys.stdout.buffer.write(chunk)
        sys.stdout.flush()
        return True
      sb.run(['-I', '-c', 'import os, time; print(os.getuid(), flush=True); time.sleep(100)'],
             limits=sb.SandboxLimits(wall_s=100), stdout_sink=show)
  ''')
  checker_process = subprocess.Popen([sys.executable, '-I', '-c', child], stdout=subprocess.PIPE)
  uid = int(checker_process.stdout.readline())
  checker_process.kill()
  checker_process.wait()
  for _ in range(50):
    if uid not in sandbox._live_uids():
      break
    time.sleep(0.1)
  assert uid not in sandbox._live_uids()


def test_the_network_and_host_sockets_are_unreachable(tmp_path):
  full_mode()
  os.chmod(tmp_path, 0o755)
  path = str(tmp_path / 'open.sock')
  servers = []
  for family, address in ((socket.AF_INET, ('127.0.0.1', 0)), (socket.AF_UNIX, path),
                          (socket.AF_UNIX, '\0hydrajax-sandbox-test')):
    s = socket.socket(family)
    s.bind(address)
    s.listen(1)
    s.settimeout(0.2)
    servers.append(s)
  os.chmod(path, 0o777)
  port = servers[0].getsockname()[1]
  try:
    result = run(f'''
        import socket
        reached = []
        for family, address in ((socket.AF_INET, ("127.0.0.1", {port})), (socket.AF_UNIX, {path!r}),
                                (socket.AF_UNIX, "\\0hydrajax-sandbox-test")):
          s = socket.socket(family)
          s.settimeout(1)
          try:
            s.connect(address)
            reached.append(address)
          except OSError:
            pass
        print(reached)
    ''')
    accepted = []
    for s in servers:
      try:
        accepted.append(s.accept())
      except OSError:
        pass
  finally:
    for s in servers:
      s.close()
  assert result.stdout.strip() == b'[]', result
  assert not accepted


def test_disk_budget_is_total():
  full_mode()
  result = run('''
      for i in range(40):
        with open(f"/tmp/f{i}", "wb") as f:
          f.write(b"x" * (4 << 20))
      print("wrote all")
  ''', dataclasses.replace(LIMITS, disk_bytes=32 << 20))
  assert b'No space left' in result.stderr and result.stdout == b''


def test_memory_budget_is_total():
  full_mode()
  result = run('''
      import os, time
      for _ in range(3):
        if os.fork() == 0:
          break
      block = bytearray(120 << 20)
      for i in range(0, len(block), 4096):
        block[i] = 1
      time.sleep(3)
      print("all held")
  ''', dataclasses.replace(LIMITS, memory_bytes=256 << 20, max_processes=8))
  assert result.memory_exceeded and b'all held' not in result.stdout, result


def test_memory_files_count_in_the_memory_budget():
  full_mode()
  result = run('''
      import os, time
      held = []
      for i in range(10):
        fd = os.memfd_create(f"m{i}")
        for _ in range(30):
          os.write(fd, b"x" * (1 << 20))
        held.append(fd)
      time.sleep(3)
      print("all held")
  ''', dataclasses.replace(LIMITS, memory_bytes=256 << 20))
  assert result.memory_exceeded and b'all held' not in result.stdout, result


def test_fork_bomb_is_capped_and_the_run_goes_on():
  if not sandbox.isolation().unique_uid:
    pytest.skip('RLIMIT_NPROC is a total only for a uid of its own (root): no fork bomb without it')
  bomb = 'import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass\n'
  report = checker.check_programs(ADD, [bomb, GOOD], CONFIG)
  assert report.results[0].status is Status.TIMED_OUT
  assert report.results[1].passed


def test_limits_and_names_are_validated():
  with pytest.raises(ValueError, match='max_processes'):
    sandbox.SandboxLimits(max_processes=0)
  with pytest.raises(ValueError, match='wall_s'):
    sandbox.SandboxLimits(wall_s=0)
  with pytest.raises(ValueError, match='plain file names'):
    sandbox.run(['-c', 'pass'], files={'../x': ''})
  with pytest.raises(ValueError, match='max_output_bytes'):
    checker.CheckConfig(max_output_bytes=0)


# ---------------------------------------------------------------------------
# Correct programs APPS accepts


def test_stdin_is_a_real_descriptor_and_the_preamble_is_there():
  programs = [
      'import os\na, b = map(int, os.read(0, 100).split())\nprint(a + b)\n',
      'a, b = map(int, open(0).read().split())\nprint(a + b)\n',
      'import sys\na, b = map(int, sys.stdin.buffer.read().split())\nprint(a + b)\n',
      'x: List[int] = list(map(int, input().split()))\nd = defaultdict(int)\n'
      'heappush(h := [], sum(x))\nprint(int(np.int64(heappop(h))))\n',
      'import os\nos.write(1, (str(sum(map(int, input().split()))) + "\\n").encode())\n',
  ]
  assert statuses(ADD, programs) == [Status.PASSED] * len(programs)


def test_big_outputs_and_big_ints_pass_on_our_own_interpreter():
  line = 'x' * 1023 + '\n'
  big = apps.Problem('big', 'Print n lines.', ('17000\n',), (line * 17000,))  # 17 MiB
  assert statuses(big, ['n = int(input())\nprint(("x" * 1023 + "\\n") * n, end="")\n']) == [
      Status.PASSED]
  limit = sys.get_int_max_str_digits()
  sys.set_int_max_str_digits(0)
  try:
    digits = apps.Problem('digits', 'Print 7**6000.', ('\n',), (str(7**6000) + '\n',))
  finally:
    sys.set_int_max_str_digits(limit)
  probe = (f'import sys\nassert sys.executable == {sys.executable!r}, sys.executable\n'
           'print(7**6000)\n')
  assert statuses(digits, [probe]) == [Status.PASSED]


def test_call_based_values_arrive_as_python_objects():
  pairs = apps.Problem('pairs', 'Map i to its name.', ([{'1': 'a', '2': 'b'}],),
                       ({'1': 'a', '2': 'b'},), fn_name='names')
  several = apps.Problem('merge', 'Look up key k.', ([{'x': 1, 'y': 2}, 'y'],), ([2],),
                         fn_name='get')
  tuples = apps.Problem('zip', 'Pairs.', ([[1, 2], [3, 4]],), ([[[1, 3], [2, 4]]],),
                        fn_name='zipped')
  assert statuses(pairs, ['class Solution:\n  def names(self, d):\n'
                          '    assert all(type(k) is int for k in d)\n    return dict(d)\n']) == [
                              Status.PASSED]
  assert statuses(several, ['def get(d, k):\n  print("debug", d)\n  return d[k]\n']) == [
      Status.PASSED]
  assert statuses(tuples, ['def zipped(a, b):\n  return list(zip(a, b))\n',
                           'def zipped(a, b):\n  return [(1, 3), (2, 5)]\n']) == [Status.PASSED,
                                                                                 Status.FAILED]


def test_values_round_trip_the_runner_codec():
  values = [None, True, 0, -1, 2**64 + 3, -(2**70), 1.5, float('inf'), 'é', [1, (2, 3)],
            {1: 'a', (1, 2): [3]}, {'1': 1}, {1, 2}, frozenset({3}), ((),), [[[]]]]
  for value in values:
    wire = json.loads(json.dumps(apps_runner.encode_value(value)))
    assert apps_runner.decode_value(wire) == value
    assert type(apps_runner.decode_value(wire)) is type(value)
  odd = apps_runner.decode_value(apps_runner.encode_value(object()))
  assert odd != odd and isinstance(odd, apps_runner.Unrepresentable)
  for bad in ({'q': []}, {'t': 1}, {'d': [[1]]}, {'t': [], 'd': []}):
    with pytest.raises(ValueError):
      apps_runner.decode_value(bad)


def test_another_interpreter_can_be_chosen():
  other = '/usr/bin/python3'
  if not os.path.exists(other) or os.path.realpath(other) == os.path.realpath(sys.executable):
    pytest.skip(f'no second interpreter at {other}')
  config = dataclasses.replace(CONFIG, python=other)
  probe = (f'import sys\nassert sys.executable == {other!r}, sys.executable\n'
           'a, b = map(int, input().split())\nprint(a + b)\n')
  assert statuses(ADD, [probe], config) == [Status.PASSED]
