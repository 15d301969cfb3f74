"""The APPS runner: runs one program on every test of a problem, inside the sandbox.

This file is both a module (the checker imports its value codec and frame format) and the script
the sandbox runs (`__main__`, on the program's interpreter, stdlib only, Python >= 3.8): it is
copied into the sandbox with the program (`program.py`) and the tests' inputs (`spec.json`), never
the expected outputs.

Like APPS' `eval/testing_util.py::run_test`, every test runs in this one process, after APPS'
import preamble (`PREAMBLE`; numpy is bound lazily, so programs that never touch `np` do not pay
for importing it):

* standard input: the program is executed once per test with fd 0 a file holding the test's input
  (so `input()`, `sys.stdin`, `open(0)` and `os.read(0, n)` all read it) and fd 1 a file
  collecting what it writes (`print` and `os.write(1, ...)` alike); SystemExit ends a test
  normally;
* call-based: the program is executed once, then `Solution().<fn_name>(*args)` (or the function
  `fn_name` when there is no class Solution) is called per test.

Each test has its own timeout (SIGALRM); the int-to-str digit limit is lifted, as APPS' Python had
none. The runner stops at the first test that raises, times out, or writes more than
`max_output_bytes`.

What goes back: frames on the descriptor stdout had when the runner started, each `kind` (1
byte), payload length (8 bytes, big-endian) and payload. The program runs in this process and can
write frames too; that does not matter: the parent compares every claimed output with expected
outputs the sandbox never sees, and treats a stream it cannot parse as a program it cannot judge.

Return values and call arguments travel as JSON with tags, so they arrive as the same Python
objects (`encode_value` / `decode_value`): lists as arrays, tuples {"t": [...]}, dicts
{"d": [[key, value], ...]} (int keys stay ints), sets {"s": [...]}, frozensets {"f": [...]},
ints past 64 bits {"i": hex}, anything else {"x": repr} (equal to nothing).
"""

import builtins
import fcntl
import importlib
import importlib.util
import json
import os
import signal
import socket
import struct
import sys
import tempfile
import types

HEADER = struct.Struct('>cQ')
STARTED = b'S'        # the program compiled (and, call-based, loaded); no payload
COMPILE_ERROR = b'C'  # payload: the error
LOAD_ERROR = b'L'     # call-based: loading the program or finding fn_name raised; payload: error
OUTPUT = b'O'         # one test's output: stdout bytes, or the encoded return value
RAISED = b'E'         # a test raised; payload: the error
TIMEOUT = b'T'        # a test ran past its timeout
TOO_LARGE = b'B'      # a test's output passed max_output_bytes; payload: its size

# APPS' preamble (testing_util.py prepends these imports to every program).
PREAMBLE = (
    'import sys', 'import time', 'import itertools',
    'from itertools import accumulate, product, permutations, combinations', 'import collections',
    'from collections import Counter, OrderedDict, deque, defaultdict, ChainMap',
    'from functools import lru_cache', 'import math',
    'from math import sqrt, sin, cos, tan, ceil, fabs, floor, gcd, exp, log, log2',
    'import fractions', 'from typing import List, Tuple', 'import random', 'import heapq',
    'from heapq import *')


class Unrepresentable:
  """A value the runner could not send (its repr); equal to nothing."""

  def __init__(self, text):
    self.text = text

  def __eq__(self, other):
    return False

  __hash__ = object.__hash__

  def __repr__(self):
    return f'<unrepresentable {self.text}>'


def encode_value(x):
  """A Python value as tagged JSON-able data (see the module docstring)."""
  t = type(x)
  if x is None or t in (bool, str, float):
    return x
  if t is int:
    return x if -2**63 <= x < 2**63 else {'i': hex(x)}
  if t is list:
    return [encode_value(v) for v in x]
  if t is tuple:
    return {'t': [encode_value(v) for v in x]}
  if t is dict:
    return {'d': [[encode_value(k), encode_value(v)] for k, v in x.items()]}
  if t in (set, frozenset):
    return {'s' if t is set else 'f': [encode_value(v) for v in x]}
  if t.__module__ == 'numpy' and hasattr(x, 'tolist'):
    return encode_value(x.tolist())
  for base in (bool, int, float, str, list, tuple, dict, set, frozenset):  # subclasses
    if isinstance(x, base):
      return encode_value(base(x.items()) if base is dict else base(x))
  try:
    text = repr(x)[:200]
  except Exception:  # noqa: BLE001 - a broken __repr__ of the program's object
    text = t.__name__
  return {'x': text}


def decode_value(v):
  """The Python value `encode_value` encoded; ValueError on anything it cannot have made."""
  if isinstance(v, list):
    return [decode_value(x) for x in v]
  if not isinstance(v, dict):
    return v
  if len(v) != 1:
    raise ValueError(f'a tagged value has one key, got {sorted(v)[:3]}')
  (tag, body), = v.items()
  if tag == 'i' and isinstance(body, str):
    return int(body, 16)
  if tag == 'x' and isinstance(body, str):
    return Unrepresentable(body)
  if not isinstance(body, list):
    raise ValueError(f'tag {tag!r} needs a list')
  if tag == 't':
    return tuple(decode_value(x) for x in body)
  if tag == 's':
    return {decode_value(x) for x in body}
  if tag == 'f':
    return frozenset(decode_value(x) for x in body)
  if tag == 'd':
    if not all(isinstance(kv, list) and len(kv) == 2 for kv in body):
      raise ValueError('a dict is a list of [key, value] pairs')
    return {decode_value(k): decode_value(val) for k, val in body}
  raise ValueError(f'unknown tag {tag!r}')


def frame(kind: bytes, payload: bytes = b'') -> bytes:
  return HEADER.pack(kind, len(payload)) + payload


# ---------------------------------------------------------------------------
# The script (runs in the sandbox)


class _TestTimeout(BaseException):
  pass


def _alarm(signum, frame_):
  raise _TestTimeout()


class _LazyModule(types.ModuleType):
  """A module imported on first attribute access (numpy costs ~0.1 s to import)."""

  def __getattr__(self, name):
    module = importlib.import_module(self.__name__)
    self.__dict__.update(module.__dict__)
    return getattr(module, name)


def _preamble_namespace():
  scope = {'__builtins__': builtins}
  for line in PREAMBLE:
    exec(line, scope)
  if importlib.util.find_spec('numpy') is not None:
    scope['np'] = _LazyModule('numpy')
  return scope


def _error(e):
  return (type(e).__name__ + ': ' + str(e)[:500]).encode('utf-8', 'replace')


def _memfile(name, data=b''):
  if hasattr(os, 'memfd_create'):
    fd = os.memfd_create(name)
  else:
    fd, path = tempfile.mkstemp()
    os.unlink(path)
  # A descriptor >= 10: never 0 or 1, even where the program closed them.
  high = fcntl.fcntl(fd, getattr(fcntl, 'F_DUPFD_CLOEXEC', fcntl.F_DUPFD), 10)
  os.close(fd)
  os.write(high, data)
  os.lseek(high, 0, os.SEEK_SET)
  return high


def _run_stdin_test(code, preamble, text, timeout, cap):
  """Runs the program on one input; returns (kind, payload)."""
  in_fd, out_fd = _memfile('stdin', text.encode('utf-8')), _memfile('stdout')
  os.dup2(in_fd, 0)
  os.dup2(out_fd, 1)
  os.close(in_fd)
  sys.stdin = open(0, 'r', encoding='utf-8', closefd=False)
  sys.stdout = open(1, 'w', encoding='utf-8', closefd=False)
  try:
    try:
      signal.setitimer(signal.ITIMER_REAL, timeout)
      exec(code, dict(preamble, __name__='__main__'))
    except SystemExit:
      pass
    finally:
      signal.setitimer(signal.ITIMER_REAL, 0)
      try:
        sys.stdout.flush()
      except Exception:  # noqa: BLE001 - a closed or broken stdout: what reached fd 1 counts
        pass
  except _TestTimeout:
    return TIMEOUT, b''
  except BaseException as e:  # noqa: BLE001 - the program's exception is its verdict
    size = os.fstat(out_fd).st_size
    return (TOO_LARGE, str(size).encode()) if size > cap else (RAISED, _error(e))
  else:
    size = os.fstat(out_fd).st_size
    if size > cap:
      return TOO_LARGE, str(size).encode()
    return OUTPUT, os.pread(out_fd, size, 0)
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    os.close(out_fd)


def _call_target(code, preamble, fn_name):
  scope = dict(preamble, __name__='program')
  exec(code, scope)
  solution = scope.get('Solution')
  return getattr(solution(), fn_name) if solution is not None else scope[fn_name]


def main():
  if hasattr(sys, 'set_int_max_str_digits'):
    sys.set_int_max_str_digits(0)
  channel = os.dup(1)
  runner_pid = os.getpid()
  os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # what a call-based program prints is dropped
  sys.stdout = open(1, 'w', encoding='utf-8', closefd=False)

  def send(kind, payload=b''):
    if os.getpid() != runner_pid:  # a child the program forked came back here: it ends
      os._exit(0)
    data = frame(kind, payload)
    while data:
      data = data[os.write(channel, data):]

  with open('spec.json') as f:
    spec = json.load(f)
  with open('program.py', encoding='utf-8', errors='replace') as f:
    source = f.read()
  try:
    code = compile(source, 'program.py', 'exec')
  except BaseException as e:  # noqa: BLE001 - SyntaxError, ValueError (NUL bytes), MemoryError
    send(COMPILE_ERROR, _error(e))
    return
  preamble = _preamble_namespace()
  signal.signal(signal.SIGALRM, _alarm)
  if spec['block_network']:
    _block_network()
  timeout, cap = spec['timeout_s'], spec['max_output_bytes']
  fn_name = spec['fn_name']
  if fn_name is not None:
    try:
      signal.setitimer(signal.ITIMER_REAL, timeout)
      fn = _call_target(code, preamble, fn_name)
      signal.setitimer(signal.ITIMER_REAL, 0)
    except _TestTimeout:
      send(TIMEOUT)
      return
    except BaseException as e:  # noqa: BLE001
      signal.setitimer(signal.ITIMER_REAL, 0)
      send(LOAD_ERROR, _error(e))
      return
  send(STARTED)
  for test in spec['inputs']:
    if fn_name is None:
      kind, payload = _run_stdin_test(code, preamble, test, timeout, cap)
    else:
      kind, payload = _run_call_test(fn, decode_value(test), timeout, cap)
    send(kind, payload)
    if kind != OUTPUT:
      return


def _run_call_test(fn, args, timeout, cap):
  try:
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
      value = fn(*args)
    finally:
      signal.setitimer(signal.ITIMER_REAL, 0)
    payload = json.dumps(encode_value(value)).encode()
  except _TestTimeout:
    return TIMEOUT, b''
  except BaseException as e:  # noqa: BLE001
    return RAISED, _error(e)
  if len(payload) > cap:
    return TOO_LARGE, str(len(payload)).encode()
  return OUTPUT, payload


def _block_network():
  """Weak mode only (full mode has no network at all): socket calls fail in Python."""

  def blocked(*args, **kwargs):
    raise OSError('network access is disabled in the sandbox')

  socket.socket = socket.create_connection = socket.socketpair = socket.getaddrinfo = blocked


if __name__ == '__main__':
  main()
