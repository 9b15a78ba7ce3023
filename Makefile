# Two commands set up a fresh machine without a GPU (see README.md):
#   make demo   generate a small ImageNet-format tree, preprocess it, train, evaluate, plot
#   make test   the CPU test suite (what CI runs)
PYTHON ?= python3
DEMO   ?= demo

.PHONY: setup demo test test-gpu lint clean-demo

# The demo's data: 10 learnable classes, 100 train and 20 val images each, plus the real set's file
# quirks (CMYK, grayscale, PNG named .JPEG, truncated, empty, stray files), preprocessed at 128x128.
demo: setup
	$(PYTHON) scripts/make_synthetic.py --out $(DEMO)/src --classes 10 --train-per-class 100 --val-per-class 20
	$(PYTHON) scripts/preprocess.py --train-dir $(DEMO)/src/train --val-dir $(DEMO)/src/val \
		--val-labels $(DEMO)/src/LOC_val_solution.csv --out $(DEMO)/data --size 128 --per-file 128

setup:
	$(PYTHON) -m pip install -q -r requirements.txt

test: setup
	$(PYTHON) -m pytest -q

# On a GPU machine with torch preinstalled: no install step, GPU-marked tests included.
test-gpu:
	$(PYTHON) -m pytest -q -m gpu

lint:
	ruff check .

clean-demo:
	rm -rf $(DEMO)
