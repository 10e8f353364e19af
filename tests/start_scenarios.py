"""One worker process's start in a multi-client job, as tests/test_rendezvous.py drives it (TF_CONFIG set).

Usage: python tests/start_scenarios.py ENTRY CONNECT_TIMEOUT [--die-after-meeting] [--tensorflow-first]

ENTRY: ``replicator`` (``MultiWorkerReplicator.from_tf_config``) or ``keras``
(``enable_keras_distribution`` and ``keras.distribution.initialize()`` from
``KERAS_DISTRIBUTION_*``). Prints one JSON line: how the start ended, and the
seconds it took from the call (the imports before it not counted).
"""

import json
import os
import sys
import time

import replicator
from replicator.integrations import _rendezvous

entry, timeout = sys.argv[1], float(sys.argv[2])
if "--die-after-meeting" in sys.argv:  # this worker dies between the meeting and TensorFlow's start
  meet = _rendezvous.meet

  def meet_and_die(*args, **kwargs):
    meet(*args, **kwargs)
    os._exit(7)

  _rendezvous.meet = meet_and_die
if "--tensorflow-first" in sys.argv:  # TensorFlow runs before the job starts: this worker cannot start
  import tensorflow as tf

  tf.constant(1.0) + 1.0

start = time.monotonic()
try:
  if entry == "keras":
    import keras

    replicator.enable_keras_distribution(connect_timeout=timeout)
    keras.distribution.initialize()
    devices = keras.distribution.list_devices()
  else:
    devices = replicator.MultiWorkerReplicator.from_tf_config(connect_timeout=timeout).devices
  result = dict(started=True, devices=list(devices))
except replicator.ReplicatorError as e:
  result = dict(started=False, error=type(e).__name__, message=str(e), task=getattr(e, "task", None),
                address=getattr(e, "address", None))
result["seconds"] = time.monotonic() - start
print(json.dumps(result), flush=True)
