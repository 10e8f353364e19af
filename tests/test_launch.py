"""``python -m replicator.launch``: one process per worker with its TF_CONFIG; a failure or a signal reaches them all.

The workers here are small Python scripts (no TensorFlow), so each test takes
about a second; the multi-worker tests run TensorFlow programs through it.
"""

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from replicator import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script(tmp_path, body: str) -> str:
  path = tmp_path / "script.py"
  path.write_text(textwrap.dedent(body))
  return str(path)


def _launch(command, workers, **kwargs):
  out, err = io.TextIOWrapper(io.BytesIO(), write_through=True), io.TextIOWrapper(io.BytesIO(), write_through=True)
  code = launch.launch(command, workers, out=out, err=err, **kwargs)
  return code, out.buffer.getvalue().decode(), err.buffer.getvalue().decode()


def test_every_worker_gets_its_tf_config_and_the_script_its_arguments(tmp_path):
  script = _script(tmp_path, """
      import json, os, sys
      config = json.loads(os.environ["TF_CONFIG"])
      print(json.dumps({"config": config, "devices": os.environ["REPLICATOR_DEVICES_PER_WORKER"],
                        "task": os.environ["REPLICATOR_LAUNCH_TASK"], "argv": sys.argv[1:]}))
      """)
  code, out, err = _launch([script, "--epochs", "3"], 3, devices_per_worker=2)
  assert code == 0, err
  seen = {}
  for line in out.splitlines():
    prefix, _, rest = line.partition("] ")
    seen[int(prefix.removeprefix("[worker "))] = json.loads(rest)
  assert sorted(seen) == [0, 1, 2]
  clusters = {json.dumps(s["config"]["cluster"]) for s in seen.values()}
  assert len(clusters) == 1  # one cluster, the same in every worker
  (cluster,) = [s["config"]["cluster"] for s in list(seen.values())[:1]]
  assert len(set(cluster["worker"])) == 3 and all(a.startswith("localhost:") for a in cluster["worker"])
  for task, s in seen.items():
    assert s["config"]["task"] == {"type": "worker", "index": task}
    assert s["task"] == str(task) and s["devices"] == "2" and s["argv"] == ["--epochs", "3"]


def test_a_failing_worker_stops_the_others_and_its_code_is_the_jobs(tmp_path):
  script = _script(tmp_path, """
      import os, sys, time
      if os.environ["REPLICATOR_LAUNCH_TASK"] == "1":
        time.sleep(0.5)
        print("worker 1 fails", file=sys.stderr)
        sys.exit(3)
      time.sleep(120)
      """)
  start = time.monotonic()
  code, _, err = _launch([script], 3, grace=5.0)
  assert code == 3
  assert time.monotonic() - start < 30  # the sleeping workers were stopped, not waited for
  assert "[worker 1] worker 1 fails" in err
  assert "replicator.launch: worker 1 (pid " in err and "exited with code 3; stopping the other 2 worker(s)" in err


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path):
  script = _script(tmp_path, """
      import os, signal, sys, time
      if os.environ["REPLICATOR_LAUNCH_TASK"] == "0":
        sys.exit(1)
      signal.signal(signal.SIGTERM, signal.SIG_IGN)
      print("ignoring", flush=True)
      time.sleep(120)
      """)
  start = time.monotonic()
  code, _, err = _launch([script], 2, grace=1.0)
  assert code == 1 and time.monotonic() - start < 20, err


def test_a_job_past_its_timeout_is_stopped(tmp_path):
  script = _script(tmp_path, "import time\ntime.sleep(120)\n")
  code, _, err = _launch([script], 2, timeout=1.0, grace=2.0)
  assert code == launch.TIMED_OUT
  assert "ran past --timeout 1 s" in err


def test_sigterm_to_the_launcher_reaches_every_worker(tmp_path):
  script = _script(tmp_path, """
      import os, signal, sys, time
      task = os.environ["REPLICATOR_LAUNCH_TASK"]
      def saved(signum, frame):
        print(f"task {task} saves and exits", flush=True)
        sys.exit(0)
      signal.signal(signal.SIGTERM, saved)
      print("ready", flush=True)
      time.sleep(120)
      """)
  process = subprocess.Popen([sys.executable, "-m", "replicator.launch", "--workers", "2", script], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  ready = 0
  deadline = time.monotonic() + 120
  while ready < 2 and time.monotonic() < deadline:
    line = process.stdout.readline()
    ready += line.endswith("] ready\n")
  assert ready == 2
  process.send_signal(signal.SIGTERM)
  out, err = process.communicate(timeout=60)
  assert process.returncode == 0, err
  assert "[worker 0] task 0 saves and exits" in out and "[worker 1] task 1 saves and exits" in out


def test_python_dash_m_replicator_launch_starts_without_a_runtime_warning_or_tensorflow(tmp_path):
  # `python -m replicator.launch` imports the package `replicator` first; it imported replicator.launch on the way
  # (replicator.testing did), and runpy then warned on every start: "RuntimeWarning: 'replicator.launch' found in
  # sys.modules after import of package 'replicator', but prior to execution of 'replicator.launch'". And it imported
  # the whole library, TensorFlow with it: 2.8-2.9 s to a worker's first line, and TensorFlow's banner; now 0.08 s.
  script = _script(tmp_path, "print('ran')")
  process = subprocess.run([sys.executable, "-X", "importtime", "-W", "default", "-m", "replicator.launch",
                            "--workers", "1", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert process.returncode == 0, process.stderr
  assert process.stdout == "[worker 0] ran\n"
  assert "RuntimeWarning" not in process.stderr and "found in sys.modules" not in process.stderr, process.stderr
  # -X importtime: a line "import time: self [us] | cumulative | module" per import of the launcher's (a worker's
  # own lines, were there any, would be led by "[worker 0] ").
  launcher = [line for line in process.stderr.splitlines() if not line.startswith("[worker ")]
  imported = [line.rsplit("|", 1)[-1].strip() for line in launcher if line.startswith("import time:")]
  assert "replicator" in imported, process.stderr[-3000:]  # the package itself: these are the launcher's imports
  heavy = [m for m in imported if m.split(".")[0] in ("tensorflow", "keras", "numpy", "mesh", "rewrite")]
  assert not heavy, f"the launcher imported {heavy[:10]}: expected the standard library and replicator only"


@pytest.mark.parametrize("argv, message", [
    (["--workers", "0", "x.py"], "--workers 0: expected the number of worker processes, at least 1."),
    (["--workers", "2", "--devices-per-worker", "0", "x.py"], "--devices-per-worker 0: expected at least 1"),
    (["--workers", "2"], "no script to run. Expected: python -m replicator.launch --workers W"),
])
def test_bad_arguments_say_what_was_expected(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    launch.main(argv)
  assert e.value.code == 2
  assert message in capsys.readouterr().err


def test_a_module_runs_as_with_python_dash_m(tmp_path):
  (tmp_path / "launched_module.py").write_text("import os\nprint('module', os.environ['REPLICATOR_LAUNCH_TASK'])\n")
  env = dict(os.environ, PYTHONPATH=str(tmp_path))
  code, out, err = _launch(["-m", "launched_module"], 2, env=env)
  assert code == 0, err
  assert sorted(out.splitlines()) == ["[worker 0] module 0", "[worker 1] module 1"]


@pytest.mark.parametrize("argv", [
    ["--workers", "2", "--timeout", "60", "-m", "launched_module", "--steps", "3", "-m", "x"],
    ["--workers=2", "{script}", "--steps", "3", "-m", "x"],
])
def test_options_after_the_program_are_the_programs(tmp_path, argv, monkeypatch):
  # Was: `-m module --steps 3` stopped with "unrecognized arguments: --steps" (the launcher read them as its own).
  body = "import sys, os\nprint('args', os.environ['REPLICATOR_LAUNCH_TASK'], sys.argv[1:])\n"
  (tmp_path / "launched_module.py").write_text(body)
  argv = [a.format(script=str(tmp_path / "launched_module.py")) for a in argv]
  launched = []
  monkeypatch.setattr(launch, "launch", lambda command, workers, devices, **kw: launched.append((command, workers)) or 0)
  with pytest.raises(SystemExit) as stopped:
    launch.main(argv)
  assert stopped.value.code == 0
  command, workers = launched[0]
  assert workers == 2 and command[-4:] == ["--steps", "3", "-m", "x"]
  assert command[0] in ("-m", str(tmp_path / "launched_module.py"))
