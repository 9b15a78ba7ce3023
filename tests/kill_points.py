"""train.py under torchrun, with a SIGKILL planted at a chosen point of a chosen attempt (tests/test_elastic.py).

    python -m torch.distributed.run ... tests/kill_points.py configs/demo.yaml key=value ...

$ALEXNET_TEST_KILLS lists "attempt:rank:point" items (comma-separated); in attempt `attempt` (the
agent's TORCHELASTIC_RESTART_COUNT) the process of global rank `rank` kills itself with SIGKILL at
`point`, as an out-of-memory killer or a dead machine would, so that torchrun restarts the job. Rank 0
dies once the checkpoint write it handed to its writer thread has landed, so whether the next attempt
resumes does not depend on the machine's speed (with 20 tasks runnable on 2 cores, a kill in validation
once came before the previous step's write had finished, and the next attempt started afresh); a kill
inside a write is the ``save`` point:

- ``first``: in its first training step (before any checkpoint of that attempt);
- ``step=N``: in global step N (1-based);
- ``val``: in validation, after its first batch;
- ``save``: in a checkpoint write, once the temporary file is written and before it is renamed.
"""
from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def die(trainer: object | None = None) -> None:
    if trainer is not None and trainer.dist.is_main:  # its own writer only: a barrier would wait for the others
        trainer.writer.wait()
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def point() -> str | None:
    """This process's kill point in this attempt, if any."""
    attempt, rank = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), os.environ.get("RANK", "0")
    for item in filter(None, os.environ.get("ALEXNET_TEST_KILLS", "").split(",")):
        a, r, where = item.split(":", 2)
        if a == attempt and r == rank:
            return where
    return None


def plant(where: str) -> None:
    from alexnet import checkpoint, trainer

    if where == "first" or where.startswith("step="):
        at = 1 if where == "first" else int(where.split("=")[1])
        step = trainer.Trainer.train_step

        def train_step(self, x, y):
            if self.global_step + 1 == at:
                die(self)
            return step(self, x, y)
        trainer.Trainer.train_step = train_step
    elif where == "val":
        evaluate = trainer.Trainer.evaluate

        def evaluating(self, epoch):
            batches = self.loader.batches

            def val_batches(split, *args, **kwargs):
                for i, batch in enumerate(batches(split, *args, **kwargs)):
                    if split == "val" and i == 1:
                        die(self)
                    yield batch
            self.loader.batches = val_batches
            return evaluate(self, epoch)
        trainer.Trainer.evaluate = evaluating
    elif where == "save":
        import torch

        def write_then_die(obj, path):  # save_atomic's temporary file, written; killed before the rename
            path = Path(path)
            with open(path.with_name(f".{path.name}.{os.getpid()}.tmp"), "wb") as f:
                torch.save(obj, f)
            die()
        checkpoint.save_atomic = write_then_die
    else:
        raise SystemExit(f"kill_points.py: unknown kill point {where!r}")


if __name__ == "__main__":
    where = point()
    if where is not None:
        plant(where)
    sys.argv = [str(REPO / "train.py"), *sys.argv[1:]]
    runpy.run_path(str(REPO / "train.py"), run_name="__main__")
