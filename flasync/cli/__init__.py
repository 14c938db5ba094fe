"""The ``flasync`` command line: ``run``, ``report``, ``compare``, ``serve`` and ``client``.

Exit status: 0 on success, 2 for bad input (config file, ``--set``, flags, data, model, unknown run or experiment,
a run to resume) with a one-line message on stderr, 1 for an unexpected failure, 130 when interrupted by SIGINT
(Ctrl-C) and 143 by SIGTERM.

The first SIGINT or SIGTERM asks the run to stop: it finishes the message at hand, cancels the clients, flushes
every metric, writes a checkpoint and ends the MLflow run as ``KILLED`` (with tracking on); ``flasync run --resume
RUN_ID`` continues it. A second signal stops at once (still ``KILLED``, no checkpoint). Either way the partial
summary is printed on one line.
"""

from __future__ import annotations

from flasync.cli.program import console, main

__all__ = ["console", "main"]
