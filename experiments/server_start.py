"""Time from `python -m models.server` to its first answered request (a cold start).

Starts the server as a subprocess on a free loopback port, sends one request as soon as it
accepts connections (retrying while it does not), and reports the seconds from launch to
the first answer, with the server's log lines timed. The server is stopped at the end.

  python -m experiments.server_start                        # the default model
  python -m experiments.server_start --server_args='--model=tiny_gqa' --ids

Pin to two cores to see a small machine: `taskset -c 0,1 python -m experiments.server_start`.
"""

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from absl import flags

from experiments import cli

_SERVER_ARGS = flags.DEFINE_string('server_args', '', 'extra flags for models.server')
_IDS = flags.DEFINE_boolean('ids', False, 'send token ids (a server without a tokenizer)')
_TIMEOUT = flags.DEFINE_float('timeout_s', 600, 'give up after this long')
_WATCH = flags.DEFINE_float('watch_s', 0, 'after the first answer, follow the warm-up this long')
_OUT = flags.DEFINE_string('out', '', 'write the result as JSON here too')
cli.at_least(1, 'timeout_s')
cli.at_least(0, 'watch_s')


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _post(port: int, payload: dict, timeout: float) -> dict:
  req = urllib.request.Request(f'http://127.0.0.1:{port}/v1/completions',
                               data=json.dumps(payload).encode(),
                               headers={'Content-Type': 'application/json'})
  with urllib.request.urlopen(req, timeout=timeout) as resp:
    return json.loads(resp.read())


def _cpu_seconds(pid: int) -> float:
  """User + system CPU seconds of a process so far (Linux): a measure a busy machine leaves
  nearly unchanged, where wall time stretches with the load."""
  with open(f'/proc/{pid}/stat') as f:
    fields = f.read().rsplit(')', 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')


def main(argv):
  del argv
  port = _free_port()
  cmd = [sys.executable, '-m', 'models.server', f'--port={port}',
         *shlex.split(_SERVER_ARGS.value)]
  start = time.monotonic()
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, 'PYTHONUNBUFFERED': '1'})
  log = []

  def read():
    for line in proc.stdout:
      log.append((round(time.monotonic() - start, 1), line.rstrip()))
      print(f'[{log[-1][0]:6.1f} s] {line.rstrip()}', flush=True)

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  payload = {'prompt': [5, 6, 7, 8] if _IDS.value else 'The capital of France is',
             'max_tokens': 8, 'temperature': 0}
  answer, first = None, None
  try:
    while time.monotonic() - start < _TIMEOUT.value and proc.poll() is None:
      try:
        answer = _post(port, payload, _TIMEOUT.value)
        first = time.monotonic() - start
        first_cpu = _cpu_seconds(proc.pid)
        break
      except (ConnectionError, urllib.error.URLError):
        time.sleep(0.2)
    if answer is None:
      raise SystemExit(f'no answer within {_TIMEOUT.value} s (server exit code {proc.poll()})')
    second_start = time.monotonic()
    _post(port, payload, _TIMEOUT.value)
    second = time.monotonic() - second_start
    time.sleep(_WATCH.value)
    with urllib.request.urlopen(f'http://127.0.0.1:{port}/v1/health', timeout=60) as resp:
      health = json.loads(resp.read())
  finally:
    proc.send_signal(signal.SIGINT)
    try:
      proc.wait(30)
    except subprocess.TimeoutExpired:
      proc.kill()
  result = {'seconds_to_first_answer': round(first, 1),
            'server_cpu_seconds_to_first_answer': round(first_cpu, 1),
            'load_average': os.getloadavg(), 'second_request_s': round(second, 2),
            'text': answer['choices'][0]['text'], 'health': health, 'command': cmd,
            'cpus': len(os.sched_getaffinity(0)), 'log': log}
  print(json.dumps({k: v for k, v in result.items() if k != 'log'}, indent=1))
  if _OUT.value:
    with open(_OUT.value, 'w') as f:
      json.dump(result, f, indent=1)


if __name__ == '__main__':
  cli.run(main)
