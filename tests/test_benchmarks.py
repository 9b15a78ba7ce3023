"""scripts/benchmark.py: every subcommand at a tiny size writes the JSON keys (and prints the table)
that gpu_check and docs/benchmarks/*.json rely on.

`loading` and `exchange` run in the CPU twin of `make gpu-bench` with these flags
(tests/test_gpu_check.py checks their keys with `check_keys`), so not twice. Not run at all, for time:
`exchange --table1` (four train.py runs), `loading`'s CPU full-size row, and `parallel`'s measured layouts
beyond one process (tests/test_model_parallel.py measures three of them).
"""
import json
import sys

import pytest

from tests.conftest import REPO, run_script

TINY = ["--width", "0.125", "--crop", "67", "--batch-size", "8", "--steps", "2", "--warmup", "1", "--repeat", "1"]
CASES = {  # subcommand: (flags, top-level keys, keys of each row)
    "preprocess": (["--images", "20", "--workers", "2"],
                   ["benchmark", "images", "cpu_count", "draft_speedup", "rows"],
                   [["what", "workers", "img_per_s", "img_per_s_per_worker"]] * 6),
    "read": (["--files", "3", "--per-file", "16", "--size", "32", "--batch-sizes", "16", "--threads", "2",
              "--repeat", "1"],
             ["benchmark", "cpu", "images", "image_size", "files", "shuffle_window", "threads", "repeat", "data",
              "rows"],
             [["what", "batch", "img_per_s", "GB_per_s", "vs_memory_bound"]] * 8),
    "train": ([*TINY, "--precisions", "fp32", "bf16"],
              ["benchmark", "device", "arch", "width", "crop", "batch_size", "compile", "rows"],
              [["precision", "channels_last", "img_per_s", "s_per_20_iter", "vs_fp32"]] * 4),
    "loading": ([*TINY, "--files-per-epoch", "2", "--no-cpu-full-size"],
                ["benchmark", "device", "arch", "width", "crop", "batch_size", "precision", "channels_last", "data",
                 "rows"],
                [["what", "img_per_s", "s_per_20_iter", "vs_upper_bound"]] * 5),
    "exchange": (["--width", "0.125", "--batch-size", "8", "--warmup", "1", "--repeat", "1"],
                 ["benchmark", "replicas", "arch", "width", "device", "rows"],
                 # on the CPU: ipc and gloo exchanges, gloo gradient all-reduce, 2 DDP steps, then the step
                 [["what", "mbytes", "ms", "vs_step"]] * 5 + [["what", "mbytes", "ms"]]),
    "checkpoint": (["--width", "0.125", "--repeat", "1"],
                   ["benchmark", "device", "arch", "width", "mbytes", "dir", "rows"],
                   [["what", "step_loop_ms", "write_ms"], ["what", "step_loop_ms", "write_ms", "vs_synchronous"]]),
}


IN_GPU_BENCH_TWIN = ("loading", "exchange")


def check_keys(what: str, result: dict, stdout: str) -> None:
    """A benchmark's --json result and printed table against CASES[what]."""
    _, keys, row_keys = CASES[what]
    assert list(result) == keys and result["benchmark"] == what
    assert [list(row) for row in result["rows"]] == row_keys
    header = stdout.splitlines()[0].split()
    assert header == list(dict.fromkeys(k for ks in row_keys for k in ks))  # the table of the rows


@pytest.mark.parametrize("what", [w for w in CASES if w not in IN_GPU_BENCH_TWIN])
def test_subcommand_writes_its_keys(tmp_path, what):
    flags = CASES[what][0]
    out = tmp_path / f"{what}.json"
    r = run_script("scripts/benchmark.py", what, *flags, "--json", str(out), timeout=300)
    assert r.returncode == 0, r.stderr
    check_keys(what, json.loads(out.read_text()), r.stdout)


def test_parallel_writes_its_keys(monkeypatch):
    """benchmark.py parallel's result with one measured layout and one skipped (more processes than devices)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from bench import parallel
    monkeypatch.setattr(parallel, "LAYOUTS", (("1 device", 1, 1, "fc"), ("16 data parallel", 16, 1, "fc")))
    args = parallel.add_parser(_subparsers()).parse_args(
        ["--batch-size", "16", "--width", "0.125", "--steps", "1", "--warmup", "1", "--device", "cpu"])
    result = args.run(args)
    assert list(result) == ["benchmark", "device", "width", "global_batch", "precision", "rows", "cost_model"]
    measured, skipped = result["rows"]
    assert list(measured) == ["layout", "processes", "batch_per_process", "ms_per_step", "img_per_s",
                              "MB_sent_per_step", "MB_params_per_process", "speedup", "yadan_speedup"]
    assert list(skipped) == ["layout", "status"] and skipped["status"].startswith("skipped: needs 16 devices")
    assert list(result["cost_model"]) == ["assumed_step_ms", "rows"] and len(result["cost_model"]["rows"]) == 9
    links = [f"{link} {what}" for link in ("PCIe 3.0 x16", "PCIe 4.0 x16", "NVLink (H100)")
             for what in ("ms", "vs step")]
    assert all(list(row) == ["layout", "MB_per_step", *links] for row in result["cost_model"]["rows"])
    assert args.tables == (("cost_model", "cost model (full-size AlexNet, global batch 256; a model, not a "
                                          "measurement)"),)


def _subparsers():
    import argparse
    return argparse.ArgumentParser().add_subparsers()
