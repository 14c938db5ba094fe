"""The MLflow writer process's own stream: its replies to the parent and nothing else."""

from __future__ import annotations

import subprocess
import sys


def test_what_a_library_prints_in_the_writer_process_stays_out_of_its_replies() -> None:
    """The writer process answers on its own stream; a library's line on stdout (MLflow's "View run ... at" when a
    run on a tracking server ends; before: the parent read it as a broken child and warned writer_process_lost)
    goes to its stderr."""
    code = (
        "from flasync.tracking._child import protocol_replies\n"
        "replies = protocol_replies()\n"
        "print('🏃 View run r1 at: http://127.0.0.1:5000/#/experiments/1/runs/abc')\n"
        "replies.write('ok\\n')\n"
        "replies.flush()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout == "ok\n"
    assert "View run r1" in done.stderr
