"""The GPU's SM clock, power and throttle reasons in each phase of a device call (s54/call1.sh).

python3 clock_summary.py <dir>: reads <dir>/smi.csv (nvidia-smi every 100 ms: timestamp, SM and
memory clock MHz, power W, temperature C, utilization %, active clock-event reasons as a bit mask)
and <dir>/phases.txt ("<timestamp> start|end <phase>"), prints one JSON line a phase over its busy
samples (utilization >= 90%), and writes clocks.png when matplotlib is installed.
"""

import datetime
import json
import pathlib
import statistics
import sys

from hydrajax.benchmarking.gpu_clock import REASON_NAMES as REASONS

FIELDS = ('time', 'sm_mhz', 'mem_mhz', 'power_w', 'temp_c', 'util', 'reasons')


def _time(text):
  return datetime.datetime.strptime(text.strip(), '%Y/%m/%d %H:%M:%S.%f')


def _number(text):
  try:
    return float(text)
  except ValueError:
    return float('nan')


def read_samples(path):
  samples = []
  for line in path.read_text().splitlines():
    parts = [p.strip() for p in line.split(',')]
    if len(parts) != len(FIELDS):
      continue
    row = dict(zip(FIELDS, parts))
    row['time'] = _time(row['time'])
    for key in FIELDS[1:6]:
      row[key] = _number(row[key])
    row['reasons'] = int(row['reasons'], 16) if row['reasons'].startswith('0x') else 0
    samples.append(row)
  return samples


def read_phases(path):
  starts, phases = {}, []
  for line in path.read_text().splitlines():
    day, clock, what, name = line.split()
    when = _time(f'{day} {clock}')
    if what == 'start':
      starts[name] = when
    else:
      phases.append((name, starts.pop(name), when))
  return phases


def summarize(name, samples):
  busy = [s for s in samples if s['util'] >= 90]
  record = {'phase': name, 'samples': len(samples), 'busy_samples': len(busy)}
  if busy:
    clocks = sorted(s['sm_mhz'] for s in busy)
    record.update(
        sm_mhz_median=statistics.median(clocks), sm_mhz_p10=clocks[len(clocks) // 10],
        sm_mhz_min=clocks[0], power_w_median=statistics.median(s['power_w'] for s in busy),
        temp_c_max=max(s['temp_c'] for s in busy),
        reasons={REASONS.get(bit, hex(bit)): sum(bool(s['reasons'] & bit) for s in busy)
                 for bit in REASONS if any(s['reasons'] & bit for s in busy)})
  return record


def plot(samples, phases, path):
  try:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
  except ImportError:
    return
  t0 = samples[0]['time']
  seconds = [(s['time'] - t0).total_seconds() for s in samples]
  fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 5))
  top.plot(seconds, [s['sm_mhz'] for s in samples], lw=0.8)
  top.set_ylabel('SM clock (MHz)')
  bottom.plot(seconds, [s['power_w'] for s in samples], lw=0.8, color='tab:red')
  bottom.set_ylabel('power (W)')
  bottom.set_xlabel('seconds')
  for name, start, end in phases:
    for axis in (top, bottom):
      axis.axvspan((start - t0).total_seconds(), (end - t0).total_seconds(), alpha=0.1)
    top.text((start - t0).total_seconds(), top.get_ylim()[1], name, va='top', fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(directory):
  directory = pathlib.Path(directory)
  samples = read_samples(directory / 'smi.csv')
  if not samples:
    print(f'no samples in {directory / "smi.csv"}')
    return
  phases = read_phases(directory / 'phases.txt')
  for name, start, end in phases:
    print(json.dumps(summarize(name, [s for s in samples if start <= s['time'] <= end])))
  plot(samples, phases, directory / 'clocks.png')


if __name__ == '__main__':
  main(sys.argv[1])
