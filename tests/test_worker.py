"""The worker process (python -m replicator.worker): its security notice and what it listens on.

One worker is started for the module on a free loopback port; every wait on it
has a deadline, and it is terminated (then killed) at the end.
"""

import getpass
import ipaddress
import json
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

from replicator import testing
from replicator import worker

START_TIMEOUT = 120.0  # seconds for the worker to import TensorFlow and print its notice

NOTICE_PATTERN = (
    r"replicator\.worker: task 0 serves TensorFlow's gRPC runtime on port {port} of every network interface, IPv4 "
    r"and IPv6 \(TensorFlow cannot bind it to localhost alone\), without authentication or encryption: anyone who "
    r"can reach this port can run any TensorFlow op as (user \S+|this process's user), including reading and "
    r"writing files\. Run workers on a private network only, or firewall the port\."
)


class _Worker:
  """A worker subprocess whose stderr lines are read by a thread (so it never blocks on a full pipe)."""

  def __init__(self, port: int):
    self.port = port
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    self.process = subprocess.Popen(
        [sys.executable, "-m", "replicator.worker", "--cluster", json.dumps({"worker": [f"localhost:{port}"]}),
         "--task", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    self.lines: queue.Queue = queue.Queue()
    self.stderr: list[str] = []
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    for line in self.process.stderr:
      self.stderr.append(line)
      self.lines.put(line.rstrip("\n"))
    self.lines.put(None)  # end of output

  def wait_for_line(self, prefix: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
      left = deadline - time.monotonic()
      if left <= 0:
        raise AssertionError(f"no stderr line starting {prefix!r} within {timeout:.0f} s:\n{''.join(self.stderr)[-4000:]}")
      try:
        line = self.lines.get(timeout=left)
      except queue.Empty:
        continue
      if line is None:
        self.process.wait(timeout=10)
        raise AssertionError(f"the worker exited (code {self.process.returncode}) before printing {prefix!r}:\n"
                             f"{''.join(self.stderr)[-4000:]}")
      if line.startswith(prefix):
        return line

  def stop(self):
    if self.process.poll() is None:
      self.process.terminate()
      try:
        self.process.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self.process.kill()
        self.process.wait(timeout=10)
    self._reader.join(timeout=10)  # the pipe ends with the process
    self.process.stderr.close()


@pytest.fixture(scope="module")
def running_worker():
  (port,) = testing.free_ports(1)
  process = _Worker(port)
  try:
    process.notice = process.wait_for_line("replicator.worker: ", START_TIMEOUT)
    yield process
  finally:
    process.stop()


def _non_loopback_addresses() -> list[str]:
  """This machine's addresses other than loopback and link-local (IPv4 and IPv6)."""
  found = []
  if shutil.which("ip"):
    output = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
    found = [m.group(1).split("/")[0] for m in re.finditer(r"\binet6? (\S+)", output)]
  else:
    try:
      with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # routing only: a UDP connect sends nothing
        found = [s.getsockname()[0]]
    except OSError:
      pass
  return [a for a in found if not (ipaddress.ip_address(a).is_loopback or ipaddress.ip_address(a).is_link_local)]


def _connects(host: str, port: int) -> bool:
  try:
    with socket.create_connection((host, port), timeout=2.0):
      return True
  except OSError:
    return False


def test_worker_prints_the_security_notice_on_stderr(running_worker):
  assert re.fullmatch(NOTICE_PATTERN.format(port=running_worker.port), running_worker.notice), running_worker.notice
  assert running_worker.notice == worker.notice(f"localhost:{running_worker.port}", 0)
  try:
    user = getpass.getuser()
  except (KeyError, OSError):
    user = None
  if user is not None:
    assert f" as user {user}, " in running_worker.notice
  assert running_worker.process.poll() is None  # still serving after the notice


def test_notice_names_the_host_it_cannot_bind():
  text = worker.notice("10.1.2.3:2222", 4)
  assert text.startswith("replicator.worker: task 4 serves TensorFlow's gRPC runtime on port 2222 of every network "
                         "interface, IPv4 and IPv6 (TensorFlow cannot bind it to 10.1.2.3 alone), without "
                         "authentication or encryption: ")
  assert "\n" not in text


@pytest.mark.skipif(not shutil.which("ss"), reason="needs ss (iproute2)")
def test_worker_listens_on_every_interface_as_the_notice_says(running_worker):
  # Measured on TensorFlow 2.21: one dual-stack socket, "LISTEN 0 4096 *:<port> *:*". If TensorFlow ever
  # binds the cluster address's host, this fails: then bind it and update the notice and the Security section of docs/guides/multi-worker.md.
  output = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True, timeout=10).stdout
  pid = running_worker.process.pid
  hosts = set()
  for line in output.splitlines():
    fields = line.split()
    if len(fields) >= 4 and fields[3].endswith(f":{running_worker.port}") and f"pid={pid}," in line:
      hosts.add(fields[3].rsplit(":", 1)[0])
  assert hosts, f"the worker (pid {pid}) has no listening socket on port {running_worker.port}:\n{output}"
  assert "*" in hosts or {"0.0.0.0", "[::]"} <= hosts, hosts


def test_worker_answers_on_a_non_loopback_address(running_worker):
  addresses = _non_loopback_addresses()
  if not addresses:
    pytest.skip("this machine has no non-loopback address")
  assert _connects("127.0.0.1", running_worker.port)
  reached = {a: _connects(a, running_worker.port) for a in addresses}
  assert all(reached.values()), f"cluster address localhost:{running_worker.port}; connections: {reached}"


def test_docs_security_section_quotes_the_notice():
  with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "guides",
                         "multi-worker.md"), encoding="utf-8") as f:
    page = f.read()
  assert "\n## Security\n" in page
  quoted = re.search(r"\*\*Notice\.\*\*[^`]*`([^`]*)`", page)
  assert quoted, "the multi-worker guide's Security section quotes the worker's notice"
  expected = worker.NOTICE.format(task=0, port=2222, host="localhost", user="user alice")
  assert " ".join(quoted.group(1).split()) == expected


def test_a_taken_port_is_named_not_a_traceback(running_worker):
  # A second worker on the running worker's port: TensorFlow says only "Could not start gRPC server".
  process = subprocess.run(
      [sys.executable, "-m", "replicator.worker", "--cluster",
       json.dumps({"worker": [f"localhost:{running_worker.port}"]}), "--task", "0"],
      capture_output=True, text=True, timeout=START_TIMEOUT, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
  assert process.returncode == 1
  assert process.stderr.splitlines()[-1] == (
      f"replicator.worker: Worker 0 cannot listen on port {running_worker.port} (localhost:{running_worker.port}): "
      f"another process holds it (Address already in use). Fix: stop that process, or give this worker a free "
      f"port in the cluster spec (every worker and the client must use the same spec).")
  assert "Traceback" not in process.stderr


def test_a_malformed_cluster_flag_is_blamed_on_the_flag_not_tf_config():
  process = subprocess.run([sys.executable, "-m", "replicator.worker", "--cluster", "{worker: 1}", "--task", "0"],
                           capture_output=True, text=True, timeout=START_TIMEOUT,
                           env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
  assert process.returncode == 1
  last = process.stderr.splitlines()[-1]
  assert last.startswith("replicator.worker: The cluster '{worker: 1}' is not valid JSON (")
  assert last.endswith("Expected e.g. '{\"worker\": [\"host0:2222\", \"host1:2222\"]}' (an IPv6 host in "
                       "brackets: \"[::1]:2222\").")
  assert "TF_CONFIG" not in last


@pytest.mark.parametrize("address,expected", [
    ("localhost:2222", ("localhost", 2222)), ("10.0.0.1:1", ("10.0.0.1", 1)), ("[::1]:2222", ("::1", 2222)),
    ("[fd00::2]:65535", ("fd00::2", 65535)), ("::1:2222", None), ("localhost", None), ("host:0", None),
    ("host:65536", None), (":2222", None), ("[]:2222", None), (2222, None)])
def test_addresses_ipv6_in_brackets(address, expected):
  from replicator.integrations import _cluster
  assert _cluster.host_and_port(address) == expected


_IPV6_CLIENT = """
import json, subprocess, sys
import replicator, tensorflow as tf
port = int(sys.argv[1])
worker = subprocess.Popen([sys.executable, "-m", "replicator.worker", "--cluster",
                           json.dumps({"worker": [f"[::1]:{port}"]}), "--task", "0", "--devices", "2"],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
try:
  assert worker.stdout.readline().startswith(f"replicator worker 0 ready at [::1]:{port}")
  repl = replicator.MultiWorkerReplicator(cluster={"worker": [f"[::1]:{port}"]})
  print([x.numpy().tolist() for x in repl.run(lambda: repl.all_sum(tf.ones([2])))])
finally:
  worker.kill()
"""


def test_a_bracketed_ipv6_address_serves_and_connects(tmp_path):
  try:
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
      s.bind(("::1", 0))
      port = s.getsockname()[1]
  except OSError:
    pytest.skip("no IPv6 loopback on this machine")
  script = tmp_path / "client.py"
  script.write_text(_IPV6_CLIENT, encoding="utf-8")
  process = subprocess.run([sys.executable, str(script), str(port)], capture_output=True, text=True,
                           timeout=2 * START_TIMEOUT, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
  assert process.returncode == 0, process.stderr[-3000:]
  assert process.stdout.strip().splitlines()[-1] == "[[2.0, 2.0], [2.0, 2.0]]"  # 2 replicas on the one worker
