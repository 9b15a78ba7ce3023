# Two commands set up a fresh machine without a GPU (see README.md):
#   make demo   generate a small ImageNet-format tree, preprocess it, train, evaluate, plot, report
#   make test   the CPU test suite (what CI runs)
# On a GPU machine (torch preinstalled, nothing installed):
#   make gpu-check   prove the GPU paths one GPU can prove, in <= 540 s: report in gpu_check/gpu_check.md (.json, logs/)
#   make gpu-bench   the full-size benchmarks, in <= 540 s: report in gpu_check/bench/gpu_check.md
# demo, test and test-fast install into a project .venv that make creates on first use, never into an active
# virtual environment or conda env (a cluster node's own torch stays as it is; Debian 12 and Ubuntu >= 23.04
# refuse pip installs into the system python, PEP 668). The .venv sees the base interpreter's packages
# (--system-site-packages), so what is already installed at the tested versions is not installed again.
# PYTHON=... uses that interpreter instead, and installs into it. CONSTRAINTS (default constraints.txt: the
# tested versions, what CI installs) pins what is installed; CONSTRAINTS= installs by requirements.txt's
# ranges only, keeping a version already there that satisfies them (a node's CUDA build of torch).
VENV ?= .venv
PYTHON ?= $(VENV)/bin/python
CONSTRAINTS ?= constraints.txt
PIN = $(if $(CONSTRAINTS),-c $(CONSTRAINTS),)
# pip takes 3.5 s to find everything already there. In the project's .venv each install leaves a record
# inside it, named by the set and the pins, and runs again only when a file it read is newer than that
# record (deleting .venv deletes the records; a fresh clone, as CI's, has none). Another interpreter
# (PYTHON=...) is asked every time.
RUN_REQS = requirements.txt $(CONSTRAINTS)
DEV_REQS = $(RUN_REQS) requirements-test.txt requirements-dev.txt
record = $(if $(filter $(VENV)/bin/python,$(PYTHON)),$(VENV)/installed-$(1)$(if $(CONSTRAINTS),-$(subst /,_,$(CONSTRAINTS)),))
# $(call pip_once,SET,REQUIREMENTS FILE,THE FILES IT READS)
pip_once = r='$(call record,$(1))'; \
	if [ -n "$$r" ] && [ -e "$$r" ] && [ -z "$$(find $(3) -newer "$$r")" ]; then \
		echo "make: $(2) installed (as recorded in $$r)"; \
	else echo "$(PYTHON) -m pip install -q -r $(2) $(PIN)"; $(PYTHON) -m pip install -q -r $(2) $(PIN) && \
		{ [ -z "$$r" ] || touch "$$r"; }; fi
# gpu-check, gpu-bench, test-gpu: the machine's own Python, with nothing installed.
GPU_PYTHON ?= python3
DEMO   ?= demo

.PHONY: setup demo test test-fast test-gpu gpu-check gpu-bench lint clean-demo mutants mutants-parallel

# The demo, the main job on generated data: 10 learnable classes, 100 train and 20 val images each,
# plus the real set's file quirks (CMYK, grayscale, PNG named .JPEG, truncated, empty, stray files);
# preprocessed at 128x128, trained with configs/demo.yaml (a loader process, CPU), evaluated with
# 1 and 10 crops, learning curve drawn, and demo/run/report.html (figures, per-class results) written.
# Re-running resumes or skips what is done.
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
	$(PYTHON) scripts/report.py $(DEMO)/run --no-progress

setup:
	@if [ "$(PYTHON)" = "$(VENV)/bin/python" ] && [ ! -x "$(VENV)/bin/python" ]; then \
		echo "make: no active virtual environment; creating $(VENV) (python3 -m venv --system-site-packages)"; \
		python3 -m venv --system-site-packages $(VENV) || { rm -rf $(VENV); \
		echo "make: python3 -m venv failed. On Debian/Ubuntu: sudo apt install python3-venv; or activate any virtual environment (or conda env) and run make again." >&2; exit 1; }; \
	fi
	@$(call pip_once,run,requirements.txt,$(RUN_REQS))

# The suite's runner, its oracles and the developer tools it runs (requirements-dev.txt, which includes
# requirements-test.txt) are installed too, and an oracle test that skips fails the run: CI must compare with
# OpenCV and TensorBoard and run mutmut's fork server, not pass over them.
# The project's modules compiled once, as pip compiles a package it installs: where Python may not write
# bytecode (PYTHONDONTWRITEBYTECODE=1, as in some CI images), each of the several hundred processes the tests
# start compiled them from source again, about a tenth of their CPU.
COMPILE = $(PYTHON) -m compileall -q alexnet data layers scripts tools tests train.py

test: setup
	@$(call pip_once,dev,requirements-dev.txt,$(DEV_REQS))
	$(COMPILE)
	ALEXNET_ORACLES_REQUIRED=1 $(PYTHON) -m pytest -q

# The edit loop's tier (<= 60 s on 2 cores): every test that starts no process and is not slow (pytest.ini's
# markers); a test of this tier that starts a process fails, naming the mark it needs (tests/conftest.py).
# There Hypothesis draws a fifth of its examples and a test of named layouts runs a cover of them (every
# setting any of them takes, conftest.tier_cases); make test runs them all.
test-fast: setup
	@$(call pip_once,dev,requirements-dev.txt,$(DEV_REQS))
	$(COMPILE)
	ALEXNET_FAST_TIER=1 $(PYTHON) -m pytest -q -m "not processes and not slow"

# On a GPU machine with torch preinstalled: no install step, GPU-marked tests included.
test-gpu:
	$(GPU_PYTHON) -m pytest -q -m gpu

# The GPU proofs, each step in its own process with a time limit (SIGINT resume with a loader process,
# replicas, evaluation, the gpu-marked tests, model parallelism, speed options; with 2 GPUs the NCCL paths),
# the most valuable first; exit 1 if a step failed. GPU_BUDGET seconds from the process's start, clean-up
# included, so each command ends within a 10-minute limit. `scripts/gpu_check.py --quick` proves the core
# in <= 180 s. No GPU: `$(PYTHON) scripts/gpu_check.py --device cpu --out DIR` runs the CPU twin (proves
# the script only; add --bench for the benchmarks' twin).
GPU_BUDGET ?= 540
gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py --out gpu_check --budget $(GPU_BUDGET)

# scripts/benchmark.py train / loading / exchange at full size, their tables in the report.
gpu-bench:
	$(GPU_PYTHON) scripts/gpu_check.py --bench --out gpu_check/bench --budget $(GPU_BUDGET)

lint:
	ruff check .

clean-demo:
	rm -rf $(DEMO)

# Mutation testing (mutmut, pinned in requirements-dev.txt) of the modules whose tests take seconds; the
# functions: MUTATE (mutmut's name patterns), the tests: pyproject.toml [tool.mutmut]. Each mutant runs
# only the tests that call its function, four at a time on any number of cores (one torch thread each: a
# mutant's session mostly waits, on a hang until its limit or on a launcher's polls; alexnet.launch's 294
# mutants took 253 s two at a time, 142 s four at a time, on 2 cores); a fresh mutants/ (git-ignored) every
# time. Prints the per-module table and every mutant not killed; docs/MUTANTS.md has the
# measured time on 2 cores and why each survivor is equivalent or left. One module: MUTATE='data.reader.*'.
MUTATE ?= alexnet.optim.* alexnet.metrics.* alexnet.rundir.* alexnet.config.* data.augment.* data.reader.* \
	alexnet.checkpoint.x*CheckpointDir* alexnet.checkpoint.x_*link_atomic* $(MUTATE_SINCE_ROUND_4) $(MUTATE_PARALLEL) $(MUTATE_INPUTS)
# Added by issue 28: the label readers, the archive index, geometry, the caffemodel wire reader, and by name
# the class subsets (data.sources), evaluation's metrics and confusions, the report's tables.
MUTATE_SINCE_ROUND_4 = data.devkit.* data.val_labels.* data.classnames.* data.archives.* data.geometry.* \
	alexnet.weights.caffe_proto.* data.sources.x_choose_classes* data.sources.x__listed_wnids* \
	data.sources.x_cap_per_class* data.sources.x__no_empty_classes* alexnet.evaluation.x_predict_log_probs* \
	alexnet.evaluation.x_evaluate__* alexnet.evaluation.x_read_names* alexnet.evaluation.x_class_words* \
	alexnet.evaluation.x__count_per_class* alexnet.evaluation.x__per_class_record* \
	alexnet.evaluation.x__confusion_record* alexnet.evaluation.x__check_outputs* alexnet.evaluation.x__csv_rows* \
	alexnet.evaluation.x__write_rows* alexnet.figures.report.x_checkpoint_rows* alexnet.figures.report.x_class_rows* \
	alexnet.figures.report.x__table* alexnet.figures.report.x__checkpoint_table* \
	alexnet.figures.report.x__class_table* alexnet.figures.report.x__confusion_table* \
	alexnet.figures.report.x__pct* alexnet.figures.report.x__e__*
# Added by issue 32: the parallel code, tested on the rank simulator: all of replica, exchange (but its CUDA
# lines and DDP, marked no mutate), large_batch and model_parallel; of layers/collectives the Comm interface,
# the gathers and their helpers (not TorchComm: real processes); the pure parts of distributed (the mesh,
# placement, transports, devices, the attempt's store namespace, the group of one, the rank-0 helpers) and
# of launch (the heartbeat, the launcher's judgement; not its start of processes); all of layers/lrn.py
# (LRN's own autograd function, the model-parallel halo).
MUTATE_PARALLEL = alexnet.replica.* alexnet.exchange.* alexnet.large_batch.* alexnet.model_parallel.* \
	layers.collectives.x_* layers.collectives.x?Comm?* layers.collectives.x?_Gather?* \
	alexnet.distributed.x_mesh_ranks* alexnet.distributed.x_own_group* alexnet.distributed.x_resolve_transport* \
	alexnet.distributed.x?Placement?* alexnet.distributed.x?DistInfo?* alexnet.distributed.x_replica_device_name* \
	alexnet.distributed.x_device_for* alexnet.distributed.x_exchange_placement* alexnet.distributed.x_attempt_store* \
	alexnet.distributed.x__first_line* alexnet.distributed.x__ranks* alexnet.distributed.x_print0* \
	alexnet.distributed.x_slow_barrier* alexnet.distributed.x_alone* \
	alexnet.launch.x?Heartbeat?* alexnet.launch.x_report_gave_up* alexnet.launch.x__how* \
	alexnet.launch.x?Launcher?_[!_]* layers.lrn.*
# Added by issues 33 and 34: the declared option domains, published weights by name, where files take their
# names, a pool's waits and stop, a child's end with its parent.
MUTATE_INPUTS = data.domains.* alexnet.weights.hub.* alexnet.weights.start.* alexnet.weights.mean_image.* data.fsutil.x_commit* data.fsutil.x__write_point* data.fsutil.x_temp_path* \
	data.procs.x_stops_between_calls* data.procs.x_in_threads* data.procs.x_run_all* \
	data.procs.x_die_with_parent* data.procs.x_follow_parent* data.procs.x_watched_env* data.fsutil.x_pid_alive*
MUTMUT = $(PYTHON) -c 'from mutmut.__main__ import cli; cli()'
# The parallel code's set alone (issue 32; docs/MUTANTS.md has its results and time).
mutants-parallel:
	$(MAKE) mutants MUTATE='$(MUTATE_PARALLEL)'

mutants: setup
	@$(call pip_once,dev,requirements-dev.txt,$(DEV_REQS))
	rm -rf mutants
	OMP_NUM_THREADS=1 $(MUTMUT) run --max-children 4 $(foreach m,$(MUTATE),'$(m)')
	$(MUTMUT) results --all true | $(PYTHON) tools/mutmut_table.py $(foreach m,$(MUTATE),'$(m)')
