"""alexnet/metrics.py: top-k counts, the Meter's sums, metrics.jsonl records, truncation on resume,
TensorBoard scalars (through a stand-in SummaryWriter: tensorboard is optional)."""
from __future__ import annotations

import json
import math
import sys
import types

import pytest
import torch

from alexnet.metrics import Meter, MetricsLog, read_metrics, topk_correct, without_wall_clock

# 3 samples, 6 classes. Ranks of each row's label, counted by hand from these numbers:
# row 0: label 2 holds the largest logit (rank 1); row 1: label 0 is the 3rd largest (rank 3);
# row 2: label 5 is the smallest (rank 6).
LOGITS = torch.tensor([[0.1, 0.2, 0.9, 0.0, 0.3, 0.4],
                       [0.5, 0.9, 0.1, 0.8, 0.2, 0.3],
                       [0.6, 0.5, 0.4, 0.3, 0.2, 0.1]])
LABELS = torch.tensor([2, 0, 5])


@pytest.mark.parametrize("ks, want", [((1, 5), [1, 2]), ((1,), [1]), ((2, 3), [1, 2]), ((3, 6), [2, 3]),
                                      ((6, 1), [3, 1])])
def test_topk_correct_counts_by_hand(ks, want):
    assert topk_correct(LOGITS, LABELS, ks).tolist() == want


def test_topk_with_fewer_classes_than_k_counts_every_sample():
    """4 classes: every label is in the top 5 (a top-5 over all classes), the top 1 as usual."""
    logits = torch.tensor([[4.0, 3, 2, 1], [1.0, 2, 3, 4]])
    assert topk_correct(logits, torch.tensor([3, 3])).tolist() == [1, 2]


def test_meter_sums_and_summary_by_hand():
    meter = Meter(torch.device("cpu"))
    meter.update(torch.tensor(2.0), LOGITS, LABELS)                 # loss 2 over 3 samples: sum 6
    meter.update(torch.tensor(0.5), LOGITS[:1], LABELS[:1])         # 0.5 x 1 sample, top-1 and top-5 hit
    assert meter.sums.tolist() == [6.5, 2.0, 3.0, 4.0]
    other = torch.tensor([1.5, 1, 1, 4], dtype=torch.float32)       # e.g. another replica's sums
    meter.add(other)
    assert meter.sums.dtype == torch.float64
    s = Meter.summarize(meter.sums)
    assert s == {"loss": 8.0 / 8, "top1_err": 1 - 3 / 8, "top5_err": 1 - 4 / 8, "n": 8}
    assert type(s["n"]) is int
    meter.reset()
    assert meter.sums.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_summary_of_no_samples_is_nan():
    s = Meter.summarize(torch.zeros(4, dtype=torch.float64))
    assert s["n"] == 0 and all(math.isnan(s[k]) for k in ("loss", "top1_err", "top5_err"))


class FakeWriter:
    """Records what SummaryWriter would write."""

    instances: list[FakeWriter] = []

    def __init__(self, log_dir: str):
        self.log_dir, self.scalars, self.closed = log_dir, [], False
        FakeWriter.instances.append(self)

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def close(self):
        self.closed = True


@pytest.fixture
def fake_tensorboard(monkeypatch):
    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = FakeWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    FakeWriter.instances = []
    return FakeWriter.instances


def test_records_are_lines_flushed_at_once_and_tensorboard_gets_scalars(tmp_path, fake_tensorboard):
    log = MetricsLog(tmp_path / "runs" / "run")  # the folders are made
    rec = {"split": "train", "iter": 20, "loss": 6.5, "top1_err": 0.9, "lr": 0.01, "img_per_s": 100.0,
           "epoch": 1}
    log.write(rec)
    # readable before close: each record is flushed
    assert (tmp_path / "runs" / "run" / "metrics.jsonl").read_text() == json.dumps(rec) + "\n"
    (writer,) = fake_tensorboard
    assert writer.log_dir == str(tmp_path / "runs" / "run" / "tb")
    assert writer.scalars == [("train/loss", 6.5, 20), ("train/top1_err", 0.9, 20), ("train/lr", 0.01, 20),
                              ("train/img_per_s", 100.0, 20)]
    log.write({"split": "val", "iter": 40, "top5_err": 0.5})
    assert writer.scalars[-1] == ("val/top5_err", 0.5, 40)
    log.close()
    assert writer.closed
    val = {"split": "val", "iter": 40, "top5_err": 0.5}
    assert read_metrics(tmp_path / "runs" / "run" / "metrics.jsonl") == [rec, val]


def test_tensorboard_off_or_missing_writes_no_events(tmp_path, fake_tensorboard, monkeypatch):
    log = MetricsLog(tmp_path / "off", tensorboard=False)
    log.write({"split": "train", "iter": 1, "loss": 1.0})
    log.close()
    assert fake_tensorboard == []
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails: no tensorboard
    said = []
    assert MetricsLog(tmp_path / "off_and_missing", tensorboard=False, say=said.append) and said == []
    log = MetricsLog(tmp_path / "missing", say=said.append)
    log.write({"split": "train", "iter": 1, "loss": 1.0})
    log.close()
    assert len(said) == 1 and "tensorboard is not installed" in said[0] and "run.tensorboard=false" in said[0]
    assert read_metrics(tmp_path / "missing" / "metrics.jsonl") == [{"split": "train", "iter": 1, "loss": 1.0}]


def test_truncate_after_keeps_records_up_to_the_step_and_drops_a_cut_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"split": "train", "iter": i}) for i in (10, 20, 30)]
    path.write_text("\n".join(lines) + "\n\n" + '{"split": "train", "it')  # a blank line, then a cut record
    log = MetricsLog(tmp_path, tensorboard=False)
    log.truncate_after(20)
    assert path.read_text() == lines[0] + "\n" + lines[1] + "\n"
    log.write({"split": "val", "iter": 25})  # appends after the kept records
    log.close()
    assert [r["iter"] for r in read_metrics(path)] == [10, 20, 25]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_truncate_after_keeps_a_complete_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iter": 1}\n{"iter": 2}\n')
    log = MetricsLog(tmp_path, tensorboard=False)
    log.truncate_after(5)
    log.close()
    assert path.read_text() == '{"iter": 1}\n{"iter": 2}\n'


def test_an_existing_log_is_appended_to(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"iter": 1}\n')
    log = MetricsLog(tmp_path, tensorboard=False)
    log.write({"iter": 2})
    log.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"iter": 1}, {"iter": 2}]


def test_without_wall_clock_drops_only_time_and_speed():
    records = [{"iter": 1, "time": 3.5, "img_per_s": 9.0, "loss": 2.0}, {"iter": 2, "lr": 0.1}]
    assert without_wall_clock(records) == [{"iter": 1, "loss": 2.0}, {"iter": 2, "lr": 0.1}]


def test_sums_stay_on_the_meters_device():
    """CPU twin of the GPU case: the accumulators are made on the given device, and add() moves what it
    is given (another replica's sums, maybe elsewhere) to that device as float64."""
    assert Meter(torch.device("meta")).sums.device.type == "meta"
    meter, calls = Meter(torch.device("cpu")), []

    class Elsewhere:  # records how it is moved
        def to(self, *args, **kwargs):
            calls.append((args, kwargs))
            return torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    meter.add(Elsewhere())
    assert calls == [((torch.device("cpu"), torch.float64), {})] and meter.sums.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_a_record_cut_short_never_merges_with_the_next_run(tmp_path):
    """Disk full in epoch 1: the last record lacks its line end; the next run's first record used to be
    appended to it, one line that no later resume could read."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"split": "train", "iter": 1, "loss": 2.0}\n{"split": "train", "iter": 2, "lo')
    said = []
    log = MetricsLog(tmp_path, tensorboard=False, say=said.append)
    log.write({"split": "train", "iter": 1, "loss": 3.0})
    log.close()
    assert path.read_bytes() == (b'{"split": "train", "iter": 1, "loss": 2.0}\n'
                                 b'{"split": "train", "iter": 1, "loss": 3.0}\n')
    assert said == [f"{path}: dropped its last record, cut short by an earlier run (33 bytes without a line end)"]


def test_damaged_lines_are_named_or_skipped_with_their_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"split": "train", "iter": 1}\n{"split": "tr\xe9in"}\n[1, 2]\n{"split": "val", "iter": 3}\n'
                     b'not json\n{"split": "val", "iter": 4}')
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is damaged \(not UTF-8 text\)$"):
        read_metrics(path)
    warnings = []
    assert [r["iter"] for r in read_metrics(path, warn=warnings.append)] == [1, 3]
    assert [w.split(": ", 1)[1] for w in warnings] == [
        "line 2 is damaged (not UTF-8 text); skipped",
        "line 3 is damaged (not a record: a JSON object with an integer iter); skipped",
        "line 5 is damaged (not JSON); skipped", "line 6 is damaged (cut short: no line end); skipped"]


def test_a_resume_trims_past_damaged_lines_without_a_traceback(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"split": "train", "iter": 1}\n{"split": "train", "iter": 2}{"split": "train", "iter": 1}\n'
                     b'{"split": "train", "iter": 3}\n')
    said = []
    log = MetricsLog(tmp_path, tensorboard=False, say=said.append)
    log.truncate_after(2)
    log.close()
    assert read_metrics(path) == [{"split": "train", "iter": 1}]
    assert said == [f"{path}: line 2 is damaged (not JSON); skipped"]


def test_a_fresh_start_keeps_the_records_of_a_start_that_left_no_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"split": "train", "iter": 1}\n')
    log = MetricsLog(tmp_path, tensorboard=False)
    assert log.start_over() == tmp_path / "metrics.prev-1.jsonl"
    log.write({"split": "train", "iter": 1, "loss": 1.0})
    log.close()
    assert read_metrics(path) == [{"split": "train", "iter": 1, "loss": 1.0}]
    log = MetricsLog(tmp_path, tensorboard=False)
    assert log.start_over() == tmp_path / "metrics.prev-2.jsonl"
    assert log.start_over() is None  # nothing to keep
    log.close()
    assert read_metrics(tmp_path / "metrics.prev-1.jsonl") == [{"split": "train", "iter": 1}]
