# The two commands of the README: each sets everything up (scripts/setup.sh), then runs.
#   make demo   the whole pipeline on this machine: Redis, a generated camera, ingest, encoder, qa
#   make test   the whole test suite (what CI runs through .ci/run)
.PHONY: demo test setup

PYTHON := .venv/bin/python

setup:
	scripts/setup.sh

demo:
	scripts/setup.sh demo
	$(PYTHON) -m apps.cli demo

test: setup
	$(PYTHON) -m pytest -q
