# Set-up is part of every target: a fresh clone needs only `make demo` or `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
STAMP := $(VENV)/.hetero-installed
HVD_STAMP := $(VENV)/.horovod-installed
BENCH_JOBS ?= 2

.PHONY: install horovod demo test bench bench-scheduler bench-aggregation clean

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=23"
	$(PY) -m pip install -q -c constraints.txt -e ".[test,demo]" mpi4py mpich cmake
	@touch $(STAMP)

install: $(STAMP)

# Horovod 0.28.1 patched for torch 2.x (C++17), built once and cached in ~/.cache/hetero_plugins.
$(HVD_STAMP): $(STAMP) scripts/install_horovod.sh
	bash scripts/install_horovod.sh $(PY)
	@touch $(HVD_STAMP)

horovod: $(HVD_STAMP)

# The main job, then the report of its HeteroDDPStrategy run: the command a user runs on a run.
demo: $(STAMP)
	$(VENV)/bin/hetero-plugins demo --out demo_output
	$(VENV)/bin/hetero-plugins report demo_output/run --out demo_output/report.png

# Two passes, both always run: the single-process tests in TEST_WORKERS pytest-xdist workers (one torch thread
# each), then the multi-process ones (marked distributed or horovod) one at a time, as their timeouts assume.
TEST_WORKERS ?= 2
test: $(STAMP) $(HVD_STAMP)
	@rc=0; \
	OMP_NUM_THREADS=1 PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -m "not distributed and not horovod" \
		-n $(TEST_WORKERS) || rc=$$?; \
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -m "distributed or horovod" || rc=$$?; \
	exit $$rc

bench: $(STAMP) $(HVD_STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) benchmarks/horovod_bench.py --out bench_output/horovod.json
	$(VENV)/bin/hetero-plugins bench --horovod-json bench_output/horovod.json

# The learned scheduler against its targets on the simulator; updates the table in docs/scheduler.md. The scenarios
# run in BENCH_JOBS processes (the decision time is measured after them, alone).
bench-scheduler: $(STAMP)
	$(PY) benchmarks/scheduler_bench.py --out bench_output/scheduler.json --update-docs docs/scheduler.md \
		--update-readme README.md --jobs $(BENCH_JOBS)

# The aggregation modes under stalls, a mid-epoch speed change and local SGD; updates README.md.
bench-aggregation: $(STAMP)
	$(PY) benchmarks/aggregation_bench.py --out bench_output/aggregation.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

.PHONY: gpu-check bench-balancing bench-placement

# What runs on one NVIDIA GPU (NVML, NCCL, two ranks sharing it, the memory cap, MPS), as a table; < 5 min.
# Without a GPU it says so and exits 0 (see docs/gpu.md).
gpu-check: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) scripts/gpu_check.py

# The balancing core's decision latency at 1024 ranks and the oracle bound on the simulator.
bench-balancing: $(STAMP)
	$(PY) benchmarks/balancing_bench.py --out bench_output/balancing.json

# What any choice among the learned relocator's moves could reach, and what of it is foresight (~7 min).
bench-placement: $(STAMP)
	$(PY) benchmarks/placement_ceiling.py --split val --out bench_output/placement_ceiling_val.json
