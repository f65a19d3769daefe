"""What the preforked service server (rlbus.preforked) imports (and freezes) once for every service it forks: torch,
transformers' model classes and the services' own modules. Imports only: no CUDA, no threads of our own,
no sockets, so a fork of this state is as clean as a fresh interpreter. Not `rlbus.cli`: a child re-runs
the launcher's main module (`python -m rlbus.cli`) as `__mp_main__`, and runpy warns on stderr when that
module is already imported (importing it in the child takes ~1 ms)."""

import atexit
import contextlib
import gc
import os
import sys

SERVER_PID = os.getpid()  # the server's: its forked children (the services) have pids of their own


def _end_without_teardown() -> None:
    """The server ends with the launcher (its pipe closes). An interpreter holding torch and transformers takes
    seconds to tear down (2-3 s on the 2-core box), and the server keeps the launcher's stdout and stderr
    open until it is gone: whatever reads `rlbus up`'s output (a pipe, `subprocess.run`, CI) waited that
    long after the launcher had exited. The services end their own way (rlbus.preforked)."""
    if os.getpid() == SERVER_PID:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


atexit.register(_end_without_teardown)  # registered first, so it runs last: after every other exit hook

import torch  # noqa: E402, F401
import transformers.generation.utils  # noqa: E402, F401
import transformers.models.auto.modeling_auto  # noqa: E402, F401
import transformers.models.qwen2.modeling_qwen2  # noqa: E402, F401  # the bundled model's family (and Qwen's)

import rlbus.learner.service  # noqa: E402, F401
import rlbus.modeling  # noqa: E402, F401
import rlbus.ref.service  # noqa: E402, F401
import rlbus.reward.service  # noqa: E402, F401
import rlbus.rollout.engines.hf  # noqa: E402, F401
import rlbus.rollout.service  # noqa: E402, F401

# A model load's first call builds transformers' checkpoint conversion table (hundreds of regular
# expressions): 0.1-0.3 s of every learner and rollout start and restart, made here once instead.
with contextlib.suppress(Exception):  # a transformers without the table loads as before
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    get_checkpoint_conversion_mapping("qwen2")

# What was imported lives as long as every child: frozen, a child's garbage collections never walk it. Each
# service collects once when ready (ServiceContext.mark_ready): over these imports that took 0.2 s of CPU, 0.3 s
# on the 2-core box beside the other services, and a learner restart waited it out before its first dispatch.
gc.collect()
gc.freeze()
# ... and unfrozen at each child's exit (rlbus.preforked runs the atexit hooks), so its last collection frees
# them: frozen, triton's bindings print "nanobind: leaked ..." to the log (the server itself skips its teardown)
atexit.register(gc.unfreeze)
