"""``python -m grpo_kit`` for the tests that launch it under torchrun / ``accelerate launch``: the real CLI, then the
process ends with ``os._exit`` once the CLI has returned and its output is flushed.

Why: on the CPU, torch's process group can abort a rank in the interpreter's teardown after a run that finished
("terminate called without an active exception"), also after ``destroy_process_group``; the launcher then reports
the rank as failed and stops the others although every file was written. Seen twice in the local suite on
2026-12-06 (once in the CLI, once in ``_parallel_worker``). The tests check what the runs wrote, not the teardown.
"""

import os
import sys

from grpo_kit.app.cli import main


def exit_now(code) -> None:
    """Flush and end the process without the interpreter's teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 1)


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
