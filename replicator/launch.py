"""Starts one process per worker on this machine, each running your script with its ``TF_CONFIG``.

For tests, examples and a first try of a multi-worker job on one machine::

  python -m replicator.launch --workers 2 --devices-per-worker 2 train.py --epochs 3
  python -m replicator.launch --workers 2 -m examples.mnist

Each worker process gets loopback ports that were free a moment ago, and
this environment:

* ``TF_CONFIG``: ``{"cluster": {"worker": [...]}, "task": {"type": "worker", "index": i}}``, as
  ``tf.distribute.cluster_resolver.TFConfigClusterResolver`` and
  ``MultiWorkerReplicator.from_tf_config()`` read it;
* ``REPLICATOR_DEVICES_PER_WORKER``: ``--devices-per-worker`` (logical CPUs a worker makes);
* ``KERAS_DISTRIBUTION_JOB_ADDRESSES``, ``KERAS_DISTRIBUTION_NUM_PROCESSES``,
  ``KERAS_DISTRIBUTION_PROCESS_ID``: the same job, as ``keras.distribution.initialize()`` reads
  it (after ``replicator.enable_keras_distribution()``);
* ``REPLICATOR_LAUNCH_TASK``: its index, for a script's own logging.

Their output is printed line by line, each line led by ``[worker i]``. The
launcher waits for all of them and exits with 0 if every worker did. When one
fails (a non-zero exit, or a signal), the others are stopped (SIGTERM, and
SIGKILL after ``--grace`` seconds), and the launcher exits with the first
failure's code, naming that worker. SIGTERM or Ctrl-C to the launcher is
passed on to every worker (a worker that saves on SIGTERM gets to save). With
``--timeout`` the job is stopped after that many seconds (exit code 124).

On several machines, a cluster manager (SLURM, Kubernetes) starts the
processes and sets ``TF_CONFIG``; see the multi-worker guide.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

TIMED_OUT = 124  # as timeout(1)

FAILED = "replicator.launch: worker {task} (pid {pid}) {how}; stopping the other {others} worker(s)."
NO_SCRIPT = ("replicator.launch: no script to run. Expected: python -m replicator.launch --workers W "
             "[--devices-per-worker D] script.py [args...] (or -m module [args...]).")


def free_ports(n: int) -> list[int]:
  """``n`` distinct TCP ports that were free on localhost a moment ago."""
  sockets = []
  try:
    for _ in range(n):
      s = socket.socket()
      s.bind(("localhost", 0))
      sockets.append(s)
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


def tf_config(addresses: list[str], task: int) -> str:
  """The ``TF_CONFIG`` of worker ``task`` of a cluster of ``addresses``."""
  return json.dumps({"cluster": {"worker": list(addresses)}, "task": {"type": "worker", "index": task}})


def describe(code: int) -> str:
  """How a process ended, from its exit code (negative: killed by that signal)."""
  if code < 0:
    try:
      return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
      return f"was killed by signal {-code}"
  return f"exited with code {code}"


def _pipe(stream, prefix: str, out, lock: threading.Lock) -> None:
  for line in iter(stream.readline, b""):
    with lock:
      out.buffer.write(prefix.encode() + line if line.endswith(b"\n") else prefix.encode() + line + b"\n")
      out.flush()
  stream.close()


def _stop(processes, grace: float) -> None:
  """SIGTERM to every process still running, then SIGKILL to those still running after ``grace`` seconds."""
  for p in processes:
    if p.poll() is None:
      p.send_signal(signal.SIGTERM)
  deadline = time.monotonic() + grace
  for p in processes:
    try:
      p.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()


def launch(command: list[str], workers: int, devices_per_worker: int = 1, *, grace: float = 10.0,
           timeout: float | None = None, env: dict | None = None, out=None, err=None) -> int:
  """Runs ``command`` (``[sys.executable, ...]`` arguments) as ``workers`` processes; their exit code as one.

  Returns 0 when every worker exits with 0; else the first failure's code
  (128 + the signal for one killed by a signal, as a shell reports it), or
  :data:`TIMED_OUT` after ``timeout`` seconds.
  """
  out, err = out or sys.stdout, err or sys.stderr
  addresses = [f"localhost:{port}" for port in free_ports(workers)]
  lock = threading.Lock()
  processes, pipes = [], []
  for task in range(workers):
    child_env = dict(os.environ if env is None else env)
    child_env.update(TF_CONFIG=tf_config(addresses, task), REPLICATOR_DEVICES_PER_WORKER=str(devices_per_worker),
                     KERAS_DISTRIBUTION_JOB_ADDRESSES=",".join(addresses), KERAS_DISTRIBUTION_NUM_PROCESSES=str(workers),
                     KERAS_DISTRIBUTION_PROCESS_ID=str(task), REPLICATOR_LAUNCH_TASK=str(task), PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, *command], env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    processes.append(p)
    for stream, sink in ((p.stdout, out), (p.stderr, err)):
      t = threading.Thread(target=_pipe, args=(stream, f"[worker {task}] ", sink, lock), daemon=True)
      t.start()
      pipes.append(t)
  received = []

  def forward(signum, frame):  # pylint: disable=unused-argument
    received.append(signum)
    for p in processes:
      if p.poll() is None:
        p.send_signal(signal.SIGTERM)

  previous = {}
  if threading.current_thread() is threading.main_thread():
    for signum in (signal.SIGTERM, signal.SIGINT):
      previous[signum] = signal.signal(signum, forward)
  start, code = time.monotonic(), None
  try:
    while code is None:
      failed = [(t, p) for t, p in enumerate(processes) if p.poll() not in (None, 0)]
      if failed and not received:
        task, p = failed[0]
        with lock:
          err.write(FAILED.format(task=task, pid=p.pid, how=describe(p.returncode), others=workers - 1) + "\n")
          err.flush()
        _stop(processes, grace)
        code = p.returncode if p.returncode > 0 else 128 - p.returncode
      elif all(p.poll() is not None for p in processes):
        codes = [p.returncode for p in processes]
        bad = [c for c in codes if c != 0]
        code = 0 if not bad else (bad[0] if bad[0] > 0 else 128 - bad[0])
      elif timeout is not None and time.monotonic() - start > timeout:
        with lock:
          err.write(f"replicator.launch: the job ran past --timeout {timeout:g} s; stopping its workers.\n")
          err.flush()
        _stop(processes, grace)
        code = TIMED_OUT
      else:
        time.sleep(0.05)
  finally:
    _stop(processes, grace)
    for t in pipes:
      t.join(5.0)
    for signum, handler in previous.items():
      signal.signal(signum, handler)
  return code


_VALUED = ("--workers", "--devices-per-worker", "--grace", "--timeout")


def _split_arguments(argv: list[str]) -> tuple[list[str], list[str] | None]:
  """The launcher's own arguments, and ``["-m", module, args...]`` or ``[script, args...]`` (None: not found).

  What follows the script or ``-m module`` is the program's, even options
  the launcher does not know (``-m examples.train --steps 40``).
  """
  i = 0
  while i < len(argv):
    word = argv[i]
    if word == "-m" and i + 1 < len(argv):
      return argv[:i], argv[i:]
    if word in _VALUED:
      i += 2
      continue
    if word.startswith("-"):
      i += 1
      continue
    return argv[:i], argv[i:]
  return argv, None


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m replicator.launch", description=__doc__.split("\n\n")[0])
  parser.add_argument("--workers", type=int, required=True, help="worker processes to start (>= 1)")
  parser.add_argument("--devices-per-worker", type=int, default=1, help="logical CPUs each worker makes (>= 1)")
  parser.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL when stopping")
  parser.add_argument("--timeout", type=float, default=None, help="stop the job after this many seconds")
  parser.add_argument("-m", dest="module", default=None, help="run a module (as python -m) instead of a script")
  parser.add_argument("command", nargs=argparse.REMAINDER, help="script.py [args...]")
  argv = sys.argv[1:] if argv is None else list(argv)
  own, rest = _split_arguments(argv)
  args = parser.parse_args(own)
  if rest is not None:  # the script's (or module's) own arguments, options included, go to it untouched
    args.module, args.command = (rest[1], rest[2:]) if rest[:1] == ["-m"] else (None, rest)
  if args.workers < 1:
    parser.error(f"--workers {args.workers}: expected the number of worker processes, at least 1.")
  if args.devices_per_worker < 1:
    parser.error(f"--devices-per-worker {args.devices_per_worker}: expected at least 1 logical CPU a worker.")
  command = (["-m", args.module] + args.command) if args.module else args.command
  if not command:
    parser.error(NO_SCRIPT)
  sys.exit(launch(command, args.workers, args.devices_per_worker, grace=args.grace, timeout=args.timeout))


if __name__ == "__main__":
  main()
