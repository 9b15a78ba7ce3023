"""The training loop of one replica: train_one_epoch, evaluate, checkpoints, exact resume.

State that makes a resumed run identical to an uninterrupted one: the weights, the velocities, the LR
policy's state, the position (epoch, step), the dropout RNG of every rank and the partial metric
sums of the current logging window. The data order and the crops are pure functions of (seed, epoch,
position), so they need no state at all.
"""
from __future__ import annotations

import math
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from data.augment import random_bits
from data.loader import InlineLoader, LoaderSpec
from data.reader import load_meta
from data.slot_loader import SlotLoader

from .checkpoint import CHECKPOINT_KIND, BackgroundWriter, CheckpointError, to_host
from .config import Config, dump_yaml, to_dict
from .distributed import DistInfo, print0, slow_barrier
from .launch import Heartbeat
from .metrics import Meter, MetricsLog
from .optim import LRSchedule
from .precision import autocast_for, configure_backends
from .preflight import (
    load_start,
    new_classifier_words,
    newest_own,
    resolve_num_classes,
    resume_position,
    run_checkpoints,
)
from .replica import MeshLayout, Replica
from .rundir import write_config

_NO_BAD_STEP = 2**62


class NonFiniteLoss(RuntimeError):
    """The loss (or, before a checkpoint, a weight) became NaN or inf; the run stops without saving."""


class StopFlag:
    """Set by a signal handler; the loop checks it between steps and stops after a checkpoint."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def request(self, signum: int) -> None:
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None


def loader_spec(cfg: Config, dist: DistInfo, layout: MeshLayout, splits: tuple[str, ...]) -> LoaderSpec:
    d = cfg.data
    return LoaderSpec(root=d.root, batch_size=layout.reader_batch,
                      val_batch_size=layout.per_reader(d.val_batch_size or cfg.train.batch_size), crop=d.crop,
                      rank=layout.reader_rank,
                      world=layout.reader_world, seed=cfg.train.seed, shuffle=d.shuffle,
                      shuffle_window=d.shuffle_window, random_crop=d.random_crop, flip=d.flip, mean=d.mean,
                      channel_mean=tuple(d.channel_mean), channel_std=tuple(d.channel_std), device=str(dist.device),
                      channels_last=cfg.train.channels_last, splits=splits, keep_empty=layout.keep_empty_batches)


def make_loader(cfg: Config, spec: LoaderSpec):
    """The configured loader: inline, or a loader thread/process filling shared slots."""
    if cfg.data.loading == "inline":
        return InlineLoader(spec)
    return SlotLoader(spec, cfg.data.loading, cfg.data.slots, cfg.data.loader_timeout)


def dropout_seed(seed: int, rank: int) -> int:
    """Each replica's own dropout stream, derived from the run's seed."""
    return int(random_bits(seed, 0, np.array([rank]), stream=7)[0] >> np.uint64(1))


def rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    """Restore rng_state()'s output; the states must be CPU byte tensors (torch refuses others)."""
    torch.set_rng_state(state["cpu"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


class Trainer:
    """One replica's model, optimizer, schedule, loader and run directory."""

    def __init__(self, cfg: Config, dist: DistInfo, stop: StopFlag | None = None):
        self.cfg, self.dist, self.stop = cfg, dist, stop or StopFlag()
        self.device = dist.device
        self.meta = load_meta(cfg.data.root)
        self.num_classes = resolve_num_classes(cfg, self.meta)
        self.has_val = "val" in self.meta["splits"]
        configure_backends(cfg.train.precision, self.device, cfg.train.deterministic)
        self.heartbeat = Heartbeat(dist.rank)
        self.comm = dist.comm.with_before(self.heartbeat.arrive)  # every process: metrics, stops, RNG states
        self.replica = Replica(cfg, dist, self.num_classes, arrive=self.heartbeat.arrive)
        self.layout, self.model, self.forward = self.replica.layout, self.replica.model, self.replica.forward
        self.optimizer = self.replica.optimizer
        torch.manual_seed(dropout_seed(cfg.train.seed, dist.rank))
        splits = ("train", "val") if self.has_val else ("train",)
        self.loader = make_loader(cfg, loader_spec(cfg, dist, self.layout, splits))
        self.steps_per_epoch = self.loader.steps("train")
        self.global_batch = self.layout.global_batch
        self.schedule = LRSchedule(cfg.train, self.steps_per_epoch, self.lr_scale())
        self.ckpt = run_checkpoints(cfg)
        self.writer = BackgroundWriter()
        self.log = MetricsLog(cfg.run.dir, cfg.run.tensorboard) if dist.is_main else None
        self.meter = Meter(self.device)
        self.first_bad = torch.full((), _NO_BAD_STEP, dtype=torch.int64, device=self.device)
        self.epoch = self.step = self.global_step = 0  # next: step `step` of 0-based epoch `epoch`
        self.best_err, self.elapsed_before, self.t0 = math.inf, 0.0, time.perf_counter()
        self.last_val: dict | None = None

    # -- setup ---------------------------------------------------------------------------------------

    def lr_scale(self) -> float:
        """Goyal et al.'s linear scaling: lr x (total batch / reference batch)."""
        if self.cfg.train.lr_scaling == "linear":
            return self.global_batch / self.cfg.train.lr_ref_batch
        return 1.0

    def describe(self) -> str:
        """The resolved setup, printed at start: replicas, global batch, lr, steps, loading, exchange."""
        t, p = self.cfg.train, self.cfg.parallel
        batch = f"global batch {self.global_batch} ({t.batch_size} {self.layout.batch_unit}"
        batch += f", {t.slices} slices)" if t.slices > 1 else ")"
        lr = f"lr {self.schedule.target_lr():g}"
        if self.lr_scale() != 1:
            lr += f" (= {t.lr:g} x {self.lr_scale():g}, linear scaling)"
        now = self.schedule.lr_at(self.global_step)
        if not math.isclose(now, self.schedule.target_lr()):
            lr += f", now {now:g}"
        parts = [f"{self.layout.describe()}, this one on {self.device}", batch, lr,
                 f"{self.steps_per_epoch} steps per epoch", f"loading {self.cfg.data.loading}"]
        if self.dist.distributed and self.dist.data_peers.size > 1:
            every = "" if p.exchange == "gradients" else (
                " every step" if p.exchange_every == 1 else f" every {p.exchange_every} steps")
            parts.append(f"exchange {p.exchange} via {self.dist.transport}{every}")
        return ", ".join(parts)

    def autocast(self):
        return autocast_for(self.cfg.train.precision, self.device)

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.t0

    # -- the loop ------------------------------------------------------------------------------------

    def fit(self) -> dict:
        """Train (or resume) to train.epochs; returns the last validation metrics (or {})."""
        interrupted = False
        try:
            self.resume()
            if self.dist.is_main:  # after resume's checks: a refused resume leaves the run's config as it was
                kept = write_config(Path(self.cfg.run.dir), dump_yaml(self.cfg))
                if kept is not None:
                    print(f"config.yaml changed; the previous one is kept as {kept}", flush=True)
            self.barrier(self.cfg.parallel.timeout)  # replicas load at different speeds
            print0(self.dist, self.describe())
            if self.epoch >= self.cfg.train.epochs:
                print0(self.dist, f"run {self.cfg.run.dir} already finished {self.epoch} epochs")
            while self.epoch < self.cfg.train.epochs:
                if not self.train_one_epoch(self.epoch, self.step):
                    break
                self.end_epoch()
        except KeyboardInterrupt:  # a second Ctrl-C, wherever it lands: do not wait for a write either
            interrupted = True
            raise
        finally:
            self.close(finish_write=not interrupted)
        return self.last_val or {}

    def end_epoch(self) -> None:
        """Validate if due, let the LR policy react, checkpoint, and move to the next epoch."""
        done = self.epoch + 1
        is_best = False
        if self.has_val and (done % self.cfg.train.val_every == 0 or done == self.cfg.train.epochs):
            self.last_val = self.evaluate(done)
            is_best = self.last_val["top1_err"] < self.best_err
            self.best_err = min(self.best_err, self.last_val["top1_err"])
            if self.schedule.on_validation(done, self.last_val["top1_err"]):
                print0(self.dist, f"lr policy auto: lr x {self.cfg.train.lr_gamma} from epoch {done + 1}")
        self.epoch, self.step = done, 0
        self.save(epoch_done=True, is_best=is_best)

    def train_one_epoch(self, epoch: int, start: int) -> bool:
        """Steps start.. of `epoch`; False if it stopped early (signal or train.max_steps)."""
        self.model.train()
        bar = self._bar(epoch, start)
        window = (time.perf_counter(), 0)
        try:
            for batch in self.loader.batches("train", epoch, start):
                lr = self.schedule.apply(self.optimizer, self.global_step)
                self.train_step(batch.x, batch.y)
                self.step, self.global_step = batch.step + 1, self.global_step + 1
                window = (window[0], window[1] + batch.n * self.dist.world)
                bar.update(1)
                boundary = self.step % self.cfg.train.log_every == 0 or self.step == self.steps_per_epoch
                if boundary:
                    self._log_train(epoch, lr, window, bar)
                    window = (time.perf_counter(), 0)
                if self._should_stop(boundary):
                    self.save(epoch_done=False)
                    return False
                if self.cfg.run.save_every_steps and self.global_step % self.cfg.run.save_every_steps == 0:
                    self.save(epoch_done=False)
        finally:
            bar.close()
        return True

    def _should_stop(self, boundary: bool) -> bool:
        """train.max_steps reached, or a stop signal, agreed by all replicas at logging boundaries."""
        limit = self.cfg.train.max_steps
        if limit and self.global_step >= limit:
            return True
        if not self.dist.distributed:
            return self.stop.requested
        if not boundary:
            return False  # replicas must stop at the same step: they agree only here
        flag = torch.tensor([int(self.stop.requested)])
        self.comm.all_reduce(flag, "max")
        if flag.item() and not self.stop.requested:
            self.stop.request(signal.SIGINT)  # a peer was interrupted: stop as if we were too
        return bool(flag.item())

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        loss, logits = self.replica.step(x, y, self.global_step + 1, self.autocast)
        if self.layout.counts_metrics:
            self.meter.update(loss, logits, y)
        step = torch.full((), self.global_step, dtype=torch.int64, device=self.device)
        self.first_bad = torch.where(torch.isfinite(loss), self.first_bad, torch.minimum(self.first_bad, step))

    def check_finite(self, weights: bool = False) -> None:
        """Raise NonFiniteLoss naming the first step whose loss was NaN or inf, or (`weights`: before a
        checkpoint) if any weight or velocity is; one host sync, agreed by all replicas."""
        bad = torch.stack([self.first_bad, -self._weights_bad() if weights else torch.zeros_like(self.first_bad)])
        self.comm.all_reduce(bad, "min")  # the first bad step of any replica; -1 if any replica's weights are bad
        step, weights_bad = int(bad[0]), int(bad[1]) < 0
        if step == _NO_BAD_STEP and not weights_bad:
            return
        what = "the loss became NaN or inf at" if step != _NO_BAD_STEP else "the weights became NaN or inf by"
        step = min(step, self.global_step - 1)
        epoch, it = divmod(step, self.steps_per_epoch)
        raise NonFiniteLoss(f"{what} step {step + 1} (epoch {epoch + 1}, iteration {it + 1}); stopped without "
                            f"saving, {self._last_good()} (lower train.lr, or check the data)")

    def _weights_bad(self) -> torch.Tensor:
        """1 (int64, on the device) if a parameter or a per-parameter optimizer state tensor (a velocity,
        LAMB's moments; not LAMB's step count, a CPU scalar) of this process holds NaN or inf, else 0."""
        state = [v for p, s in self.optimizer.state.items() for v in s.values()
                 if torch.is_tensor(v) and v.shape == p.shape]
        tensors = [*self.model.parameters(), *state]
        finite = torch.stack([torch.isfinite(t).all() for t in tensors]).all()
        return (~finite).to(torch.int64)

    def _last_good(self) -> str:
        """What there is to go back to: the run's newest checkpoint, once its write has finished."""
        try:
            self.writer.wait(beat=self.heartbeat.beat)
        except CheckpointError as e:
            return f"and {e}"
        found = self.ckpt.candidates()
        return f"so {found[0]} is the last good checkpoint" if found else f"and {self.ckpt.root} holds no checkpoint"

    def reduce(self, sums: torch.Tensor) -> torch.Tensor:
        """Sum a metrics vector over replicas (exact counts: every replica adds its own images)."""
        self.comm.all_reduce(sums)
        return sums

    def _log_train(self, epoch: int, lr: float, window: tuple[float, int], bar) -> None:
        self.check_finite()
        stats = Meter.summarize(self.reduce(self.meter.sums.clone()))
        self.meter.reset()
        seconds = max(time.perf_counter() - window[0], 1e-9)
        record = {"split": "train", "epoch": epoch + 1, "iter": self.global_step, **stats, "lr": lr,
                  "img_per_s": window[1] / seconds, "time": self.elapsed()}
        self.write(record)
        bar.set_postfix(loss=f"{stats['loss']:.3f}", top1=f"{1 - stats['top1_err']:.3f}",
                        img_s=f"{record['img_per_s']:.0f}", lr=f"{lr:.2g}", refresh=False)

    @torch.no_grad()
    def evaluate(self, epoch: int) -> dict:
        """Center-crop top-1/top-5 error over the whole validation split (sharded, exact counts)."""
        self.replica.average_statistics()
        self.model.eval()
        meter, start, n = Meter(self.device), time.perf_counter(), 0
        bar = self._bar(epoch - 1, 0, split="val")
        for batch in self.loader.batches("val", 0):
            with self.autocast():
                logits = self.forward(batch.x)
            if batch.n and self.layout.counts_metrics:
                meter.update(F.cross_entropy(logits.float(), batch.y), logits, batch.y)
            n += batch.n
            bar.update(1)
            self.heartbeat.beat()
        bar.close()
        self.model.train()
        stats = Meter.summarize(self.reduce(meter.sums))
        record = {"split": "val", "epoch": epoch, "iter": self.global_step, **stats,
                  "lr": self.schedule.lr_at(max(self.global_step - 1, 0)),
                  "img_per_s": stats["n"] / max(time.perf_counter() - start, 1e-9), "time": self.elapsed()}
        self.write(record)
        print0(self.dist, f"epoch {epoch}: val loss {stats['loss']:.4f}, top-1 error {stats['top1_err']:.4f}, "
                          f"top-5 error {stats['top5_err']:.4f} ({stats['n']} images)")
        return record

    def write(self, record: dict) -> None:
        if self.log is not None:
            self.log.write(record)

    def _bar(self, epoch: int, start: int, split: str = "train"):
        from tqdm import tqdm
        total = self.loader.steps(split)
        desc = f"epoch {epoch + 1}/{self.cfg.train.epochs}" if split == "train" else "  val"
        return tqdm(total=total, initial=start, desc=desc, unit="it", leave=split == "train", dynamic_ncols=True,
                    disable=not (self.dist.is_main and self.cfg.run.progress))

    # -- checkpoints -----------------------------------------------------------------------------------

    def rng_states(self) -> list[dict]:
        """Every replica's dropout RNG state, in rank order."""
        self.heartbeat.arrive()
        return self.comm.all_gather_object(rng_state(self.device))

    def state_dict(self) -> dict:
        """The checkpoint: the single-device model and optimizer state whatever the layout (complete on
        rank 0), plus everything an exact resume needs."""
        model_state, opt_state = self.replica.full_state()
        return {"kind": CHECKPOINT_KIND, "version": 1, "model": model_state,
                "optimizer": opt_state, "schedule": self.schedule.state_dict(),
                "epoch": self.epoch, "step": self.step, "global_step": self.global_step,
                "global_batch": self.global_batch, "best_top1_err": self.best_err, "elapsed": self.elapsed(),
                "meter": self.reduce(self.meter.sums.clone()).cpu(), "rng": self.rng_states(),
                "world": self.dist.world, "config": to_dict(self.cfg), "num_classes": self.num_classes,
                "classes": list(self.meta["classes"]), "image_size": int(self.meta["image_size"]),
                "resize": self.meta.get("resize")}  # the data's geometry, which evaluate.py compares

    def save(self, epoch_done: bool, is_best: bool = False) -> None:
        """Checkpoint (every replica takes part, rank 0 writes); never after a non-finite loss.

        Weights mode between two exchanges: the replicas are averaged first, so the checkpoint holds
        all of them (a run that saves at the same steps does the same, so resuming stays exact).
        """
        self.wait_for_writer()
        self.check_finite(weights=True)
        exchange = self.replica.exchange
        if exchange is not None and self.global_step % exchange.every:
            self.replica.average_now()
        self.replica.average_statistics()
        state = self.state_dict()
        if self.dist.is_main:  # the step loop pays for a host copy; a thread writes it to disk
            host = to_host(state)
            self.writer.submit(lambda: self.ckpt.save(host, epoch_done, is_best))
            if not epoch_done:
                print0(self.dist, f"checkpoint at epoch {self.epoch + 1}, step {self.step}: {self.ckpt.last}")

    def wait_for_writer(self) -> None:
        """Rank 0 finishes writing the previous checkpoint; the other replicas wait for it here, at a
        barrier bounded by run.checkpoint_timeout, not inside a collective bounded by parallel.timeout
        (which a slow disk or network file system would exceed)."""
        if self.dist.is_main:
            self.writer.wait(beat=self.heartbeat.beat)
        self.barrier(self.cfg.parallel.timeout)

    def barrier(self, seconds: float) -> None:
        """All replicas meet here (rank 0 may be late; it waits `seconds` for the others: slow_barrier)."""
        if self.dist.distributed:
            self.heartbeat.arrive()
            slow_barrier(self.dist, seconds)

    def resume(self) -> None:
        """Continue from the run's newest loadable checkpoint, else from run.resume_from if set."""
        state, path = self._resume_state()
        if state is None:
            kept = self.log.start_over() if self.log is not None else None
            if kept is not None:
                print(f"metrics.jsonl held records of an earlier start that left no checkpoint: kept as {kept}",
                      flush=True)
            return
        step, changes = resume_position(self.cfg, self.meta, state, path, self.global_batch, self.steps_per_epoch)
        if self.dist.is_main and path.parent == self.ckpt.root:
            for done in self.ckpt.complete(state, path):
                print(done, flush=True)
        for change in changes:
            print0(self.dist, f"changed on resume: {change}")
        self.replica.load_full_state(state["model"], state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.epoch, self.step = state["epoch"], step
        self.global_step = self.epoch * self.steps_per_epoch + self.step
        if self.log is not None:  # records after the checkpoint, counted in the steps of its run
            self.log.truncate_after(state.get("global_step", self.global_step))
        self.best_err, self.elapsed_before = state["best_top1_err"], state["elapsed"]
        if self.dist.is_main:  # the window's sums were reduced when saved: count them once
            self.meter.sums.copy_(state["meter"])
        ranks = state["rng"]
        if len(ranks) == self.dist.world:
            set_rng_state(ranks[self.dist.rank], self.device)
        else:  # another number of replicas: a fresh, still deterministic, dropout stream
            torch.manual_seed(dropout_seed(self.cfg.train.seed + self.global_step, self.dist.rank))
        if "next_lr" in state:
            self._adopt_lr(float(state["next_lr"]), path)
        source = state.get("source", {})
        if source.get("weights_only"):
            named = f" (published as {source['name']})" if "name" in source else ""
            print0(self.dist, f"starting from the weights of {path}{named}{new_classifier_words(state)}: epoch 1, "
                              "the optimizer at rest")
        else:
            print0(self.dist, f"resumed from {path}: epoch {self.epoch + 1}, step {self.step} "
                              f"(global step {self.global_step})")

    def _resume_state(self) -> tuple[dict | None, Path | None]:
        """(state, path) of what to resume from, loaded to the CPU, or (None, None) for a fresh run.

        CPU first, whatever the device: the RNG states must stay CPU byte tensors, and the optimizer
        moves its state to the parameters itself.
        """
        warn = (lambda msg: print(msg, file=sys.stderr, flush=True)) if self.dist.is_main else (lambda msg: None)
        state, path = newest_own(self.ckpt, warn)
        if state is not None:
            return state, path
        if not self.cfg.run.resume_from:
            return None, None
        # a checkpoint, or weights (by path or published name) as a start
        return load_start(self.cfg, self.meta, progress=self.dist.is_main and self.cfg.run.progress)

    def _adopt_lr(self, lr: float, path: Path) -> None:
        """A converted checkpoint states the lr its run would use next; make ours agree or say so."""
        ours = self.schedule.lr_at(self.global_step)
        if self.cfg.train.lr_policy == "auto" and ours > 0:
            self.schedule.auto_factor *= lr / ours  # the auto policy's state is exactly that factor
        elif not math.isclose(ours, lr, rel_tol=1e-6):
            print0(self.dist, f"warning: {path} continues at lr {lr:g}, but this config gives lr {ours:g} at "
                              f"epoch {self.epoch + 1}; training uses the config's (set train.lr / lr_steps, or "
                              "train.lr_policy=auto to adopt the file's)")

    def close(self, finish_write: bool = True) -> None:
        """Finish the checkpoint being written (its failure is raised), then stop the helpers."""
        try:
            if finish_write:
                self.writer.wait(beat=self.heartbeat.beat)
        finally:
            self.replica.close()
            self.loader.close()
            if self.log is not None:
                self.log.close()
