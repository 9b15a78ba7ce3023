# Two commands set up a fresh machine without a GPU (see README.md):
#   make demo   generate a small ImageNet-format tree, preprocess it, train, evaluate, plot
#   make test   the CPU test suite (what CI runs)
# On a GPU machine (torch preinstalled, nothing installed):
#   make gpu-check   prove every GPU path in <= 10 minutes: report in gpu_check/gpu_check.md (and .json, logs/)
PYTHON ?= python3
DEMO   ?= demo

.PHONY: setup demo test test-gpu gpu-check lint clean-demo

# The demo, the main job on generated data: 10 learnable classes, 100 train and 20 val images each,
# plus the real set's file quirks (CMYK, grayscale, PNG named .JPEG, truncated, empty, stray files);
# preprocessed at 128x128, trained with configs/demo.yaml (a loader process, CPU), evaluated with
# 1 and 10 crops, learning curve drawn. Re-running resumes or skips what is done.
demo: setup
	$(PYTHON) scripts/make_synthetic.py --out $(DEMO)/src --classes 10 --train-per-class 100 --val-per-class 20
	$(PYTHON) scripts/preprocess.py --train-dir $(DEMO)/src/train --val-dir $(DEMO)/src/val \
		--val-labels $(DEMO)/src/LOC_val_solution.csv --out $(DEMO)/data --size 128 --per-file 128
	$(PYTHON) train.py configs/demo.yaml data.root=$(DEMO)/data run.dir=$(DEMO)/run
	$(PYTHON) scripts/evaluate.py --data $(DEMO)/data --weights $(DEMO)/run/checkpoints/best.pt \
		--json $(DEMO)/run/eval_1crop.json --no-progress
	$(PYTHON) scripts/evaluate.py --data $(DEMO)/data --weights $(DEMO)/run/checkpoints/best.pt --crops 10 \
		--json $(DEMO)/run/eval_10crop.json --csv $(DEMO)/run/predictions.csv --no-progress
	$(PYTHON) scripts/plot.py $(DEMO)/run --out $(DEMO)/run/learning_curve.png

setup:
	$(PYTHON) -m pip install -q -r requirements.txt

test: setup
	$(PYTHON) -m pytest -q

# On a GPU machine with torch preinstalled: no install step, GPU-marked tests included.
test-gpu:
	$(PYTHON) -m pytest -q -m gpu

# Every GPU path, each step in its own process with a time limit (tests, SIGINT resume, replicas on one
# and on two GPUs, torchrun, evaluation, speed options, benchmarks); exit 1 if a step failed.
# No GPU: `$(PYTHON) scripts/gpu_check.py --device cpu --out DIR` runs the CPU twin (proves the script only).
gpu-check:
	$(PYTHON) scripts/gpu_check.py --out gpu_check

lint:
	ruff check .

clean-demo:
	rm -rf $(DEMO)
