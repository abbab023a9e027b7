# Delayed delivery on Spark + Delta. `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON    ?= python3.11
VENV      := .venv
BIN       := $(VENV)/bin
JARS      := .jars
SPARK_PROPS := $(JARS)/spark-defaults.conf
# The classes a delayq Spark loads, mapped at each start (engine/lakehouse/catalog/session.py).
CLASS_ARCHIVE := $(JARS)/classes.jsa
USE_ARCHIVE := -XX:SharedArchiveFile=$(abspath $(CLASS_ARCHIVE)) -Xlog:cds=off -Xlog:cds+dynamic=off
# spark-submit runs the job with the venv's Python, driver and workers alike.
export PYSPARK_PYTHON := $(abspath $(BIN)/python)
export PYSPARK_DRIVER_PYTHON := $(abspath $(BIN)/python)
# Local runs bind Spark to loopback (set SPARK_LOCAL_IP yourself on a cluster node).
export SPARK_LOCAL_IP ?= 127.0.0.1
SUBMIT    := $(BIN)/spark-submit --properties-file $(SPARK_PROPS)
PYTEST_ARGS ?=
# Test files run on this many pytest-xdist workers, each file whole on one (its broker, S3
# server or engine started once); 0 runs them one after the other in this process.
TEST_WORKERS ?= 2
# make bench MODE=full for the long run; BENCH_ARGS="--workloads steady,spike" to pick.
MODE      ?= quick
BENCH_ARGS ?=
# The Apache RocketMQ peer harness `make bench-peers` runs (WITH_PEERS=1: right after `make bench`).
PEERS     ?= ../shared/peers/rocketmq
WITH_PEERS ?=

KAFKA_HOME := .kafka
CLUSTER_HOME := .cluster
S3_HOME   := .s3

.PHONY: help setup venv dev jars kafka-jars kafka-up kafka-down s3-jars s3-up s3-down s3-status cluster-up cluster-down cluster-status ingest run engine sql-server status test test-quick bench bench-peers check lint typecheck imports docs docs-serve clean distclean

help: ## Show this help
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

setup: venv dev jars kafka-jars s3-jars ## Install everything: the Python environment with the dev tools, the JVM jars, the servers' jars

venv: $(VENV)/.installed $(VENV)/.spark-launcher ## Create .venv and install the package (what the jobs and commands need)

dev: venv $(VENV)/.dev ## Add the test and docs tools to .venv (pytest, ruff, mypy, MkDocs, ...)

$(VENV)/.installed: pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found: install Python 3.11 (e.g. pyenv install 3.11)"; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -q -e .
	@touch $@

$(VENV)/.dev: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e '.[test,docs]'
	@touch $@

# PySpark's find-spark-home asks the python3 on PATH where PySpark is: without the venv
# activated that is another Python, and .venv/bin/spark-submit fails (/bin/spark-class).
# This venv's Spark and Python instead, activated or not; spark-submit, spark-sql, beeline
# and pyspark read it when SPARK_HOME is not set (with SPARK_HOME set they use that Spark,
# and PYSPARK_PYTHON says which Python). Written again if pip puts PySpark's back.
$(BIN)/find-spark-home: $(VENV)/.installed

$(VENV)/.spark-launcher: $(VENV)/.installed $(BIN)/find-spark-home Makefile
	@home=$$($(BIN)/python -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))') \
	  && [ -n "$$home" ] || { echo "error: PySpark not found in $(VENV)"; exit 1; }; \
	{ echo '# Written by make venv: this venv'"'"'s Spark and Python, with or without activation'; \
	  echo "export SPARK_HOME=\"$$home\""; \
	  echo 'if [ -z "$${PYSPARK_PYTHON}" ]; then export PYSPARK_PYTHON="$(abspath $(BIN)/python)"; fi'; \
	  echo '# spark-sql on a metastore a running engine holds: one line naming its SQL endpoint, exit 3'; \
	  echo 'if [ "$$(basename "$$0")" = spark-sql ]; then "$(abspath $(BIN)/python)" -m engine.run.spark_sql_guard "$$@" || { [ $$? -ne 3 ] || exit 3; }; fi'; \
	} > $(BIN)/find-spark-home
	@touch $@

jars: $(SPARK_PROPS) $(JARS)/.class-archive ## Resolve Delta's, Spark's Kafka connector's and S3A's jars into .jars/, build delayq's LogStores, write the JVM class archive (~1-2 min)

JVM_SRC := $(shell find build/jvm/src -name '*.java')

$(SPARK_PROPS): build/pom.xml build/s3a/pom.xml build/jvm/pom.xml $(JVM_SRC) Makefile $(VENV)/.installed
	@command -v java >/dev/null || { echo "error: java not found: install a JDK 17 (apt-get install openjdk-17-jdk-headless)"; exit 1; }
	@v=$$(java -version 2>&1 | awk -F'"' '/version/ {print $$2}' | cut -d. -f1); \
	  [ "$${v:-0}" -ge 17 ] 2>/dev/null || { echo "error: Java $$v found, Spark 4 needs Java 17 or newer: install openjdk-17-jdk-headless"; exit 1; }
	@command -v mvn >/dev/null || { echo "error: mvn not found: install Maven (apt-get install maven)"; exit 1; }
	@rm -rf $(JARS) && mkdir -p $(JARS)
	mvn -q -B -f build/pom.xml dependency:copy-dependencies -DexcludeTransitive=true -DoutputDirectory=$(abspath $(JARS))
	mvn -q -B -f build/s3a/pom.xml dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory=$(abspath $(JARS))
	mvn -q -B -f build/jvm/pom.xml package -DbuildDir=$(abspath $(JARS))/jvm-build \
	  -DsparkJars=$(abspath $(VENV))/lib/python3.11/site-packages/pyspark/jars
	@cp $(JARS)/jvm-build/delayq-jvm-*.jar $(JARS)/
	@{ echo "# Written by 'make jars': pass to spark-submit with --properties-file"; \
	   echo "spark.jars $$(ls $(abspath $(JARS))/*.jar | paste -sd, -)"; \
	   echo "spark.sql.extensions io.delta.sql.DeltaSparkSessionExtension"; \
	   echo "spark.sql.catalog.spark_catalog org.apache.spark.sql.delta.catalog.DeltaCatalog"; \
	   echo "spark.sql.session.timeZone UTC"; \
	   echo "# Delta's commits on s3a:// with S3's conditional PUT, safe with several writers (build/jvm)"; \
	   echo "spark.delta.logStore.s3a.impl delayq.s3.ConditionalPutLogStore"; \
	   echo "# ... and on file: paths with a hard link, as the engine's own commits (build/jvm)"; \
	   echo "spark.delta.logStore.file.impl delayq.fs.LinkLogStore"; \
	   echo "# Delta on the driver's own class path too: the SQL endpoint's JDBC sessions need it"; \
	   echo "spark.driver.extraClassPath $$(ls $(abspath $(JARS))/*.jar | paste -sd: -)"; \
	   echo "# Table names kept with the default lakehouse (sql.catalog = embedded): spark-sql and"; \
	   echo "# pyspark see delayq.<topic>. delayq's own jobs point these at their lakehouse."; \
	   echo "spark.sql.catalogImplementation hive"; \
	   echo "spark.hadoop.javax.jdo.option.ConnectionURL jdbc:derby:;databaseName=$(abspath lakehouse)/_metastore/db;create=true"; \
	   echo "spark.sql.warehouse.dir $(abspath lakehouse)/_warehouse"; \
	   echo "spark.hadoop.hive.downloaded.resources.dir $${TMPDIR:-/tmp}/delayq-hive/\$${hive.session.id}_resources"; \
	   echo "spark.driver.extraJavaOptions -Duser.timezone=UTC -Dlog4j2.configurationFile=file:$(abspath conf/log4j2.properties) -Dderby.stream.error.file=$(abspath lakehouse)/_metastore/derby.log $(USE_ARCHIVE)"; } > $@
	@echo "jars ready in $(JARS)/"

# Tried once per set of jars (the stamp); not a failure when it cannot be written: every
# Spark then starts a few seconds slower.
$(JARS)/.class-archive: $(SPARK_PROPS) $(VENV)/.installed
	@echo "writing the JVM class archive $(CLASS_ARCHIVE) (once, about 2 min: then each Spark starts ~25% sooner)"
	@$(BIN)/python -m jobs.tools.class_archive --out $(abspath $(CLASS_ARCHIVE)) 2>$(JARS)/class-archive.log \
	  || echo "warning: no class archive (see $(JARS)/class-archive.log): Sparks start slower"
	@touch $@

kafka-jars: $(KAFKA_HOME)/lib/.resolved ## Resolve the Kafka broker's jars with Maven into .kafka/lib/

$(KAFKA_HOME)/lib/.resolved: build/kafka/pom.xml
	@command -v mvn >/dev/null || { echo "error: mvn not found: install Maven (apt-get install maven)"; exit 1; }
	@rm -rf $(KAFKA_HOME)/lib && mkdir -p $(KAFKA_HOME)/lib
	mvn -q -B -f build/kafka/pom.xml dependency:copy-dependencies -DoutputDirectory=$(abspath $(KAFKA_HOME)/lib)
	@touch $@

kafka-up: venv kafka-jars ## Start a local Kafka broker (KRaft) on 127.0.0.1:9092, data in .kafka/
	$(BIN)/python -m jobs.tools.broker up --home $(KAFKA_HOME) $(ARGS)

kafka-down: venv ## Stop the local Kafka broker
	$(BIN)/python -m jobs.tools.broker down --home $(KAFKA_HOME)

s3-jars: $(S3_HOME)/lib/.resolved ## Resolve the local S3 server (S3Proxy) with Maven into .s3/lib/

$(S3_HOME)/lib/.resolved: build/s3proxy/pom.xml
	@command -v mvn >/dev/null || { echo "error: mvn not found: install Maven (apt-get install maven)"; exit 1; }
	@rm -rf $(S3_HOME)/lib && mkdir -p $(S3_HOME)/lib
	mvn -q -B -f build/s3proxy/pom.xml dependency:copy-dependencies -DexcludeTransitive=true -DoutputDirectory=$(abspath $(S3_HOME)/lib)
	@touch $@

s3-up: venv s3-jars ## Start a local S3 server (S3Proxy) on 127.0.0.1:9000 with bucket delayq, data in .s3/
	$(BIN)/python -m jobs.tools.objectstore up --home $(S3_HOME) $(ARGS)

s3-down: venv ## Stop the local S3 server
	$(BIN)/python -m jobs.tools.objectstore down --home $(S3_HOME)

s3-status: venv ## Show the local S3 server's address and buckets
	$(BIN)/python -m jobs.tools.objectstore status --home $(S3_HOME)

cluster-up: setup ## Start a local Spark standalone cluster: master spark://127.0.0.1:7077, 2 workers, in .cluster/
	$(BIN)/python -m jobs.tools.cluster up --home $(CLUSTER_HOME) $(ARGS)

cluster-down: venv ## Stop the local Spark cluster
	$(BIN)/python -m jobs.tools.cluster down --home $(CLUSTER_HOME)

cluster-status: venv ## Show the cluster's master, workers (cores, memory) and running applications
	$(BIN)/python -m jobs.tools.cluster status --home $(CLUSTER_HOME)

ingest: venv jars ## Run the Kafka ingest job (kafka.ingest_topics -> commitlog) until Ctrl-C
	$(SUBMIT) jobs/kafka_ingest.py $(ARGS)

# Only what the engine needs: the servers' jars come with the targets that start them, and the
# class archive (each later Spark starts sooner) with `make setup`, `make engine` or `make test`.
run: venv $(SPARK_PROPS) ## Set up what the engine needs, then run it on a demo set until everything is delivered
	$(SUBMIT) jobs/delay_engine.py --demo --until-idle $(ARGS)

engine: venv jars ## Run the engine until Ctrl-C (ARGS="--set key=value ..." to configure)
	$(SUBMIT) jobs/delay_engine.py $(ARGS)

sql-server: venv jars ## Run the engine serving JDBC on 127.0.0.1:10000 and Spark Connect on :15002
	$(SUBMIT) jobs/delay_engine.py --set sql.server.enabled=true $(ARGS)

status: venv jars ## Show pending per level, delivered and quarantined counts
	$(BIN)/delayq status $(ARGS)

test: setup check ## Set up, lint, type-check and run the whole test suite (TEST_WORKERS=2)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

test-quick: dev ## Run the unit tests only: no JVM, no Maven, Kafka or S3 set-up (under a minute)
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

bench: setup ## Benchmark (MODE=quick, ~25 min, or MODE=full): JSON + PNG in bench/out/
	$(SUBMIT) --driver-memory 12g jobs/bench.py --mode $(MODE) $(BENCH_ARGS)
	@if [ -n "$(WITH_PEERS)" ]; then $(MAKE) --no-print-directory bench-peers; fi

bench-peers: setup ## RocketMQ 5.5 on the newest bench run's workloads, side by side (PEERS=harness)
	$(BIN)/python -m jobs.tools.peers --harness $(PEERS) $(PEERS_ARGS)

check: lint typecheck imports ## ruff, mypy and the import contracts

lint: dev ## ruff check and ruff format --check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: dev ## mypy (strict) over engine, schemas and jobs
	$(BIN)/mypy

imports: dev ## The layout's import contracts (pyproject.toml [tool.importlinter])
	$(BIN)/lint-imports

docs: dev ## Build the docs site into site/ (strict: a broken link or missing page fails)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --config-file docs/mkdocs.yml --site-dir $(abspath site)

docs-serve: dev ## Serve the docs site at http://127.0.0.1:8000, rebuilt as pages change
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --config-file docs/mkdocs.yml --dev-addr 127.0.0.1:8000

clean: ## Remove the local lakehouse and test leftovers (keeps .venv and .jars)
	rm -rf lakehouse spark-warehouse metastore_db derby.log site .pytest_cache .mypy_cache .ruff_cache

distclean: clean ## Also remove .venv, .jars, .kafka, .s3 and .cluster (stop them first: make kafka-down s3-down cluster-down)
	rm -rf $(VENV) $(JARS) $(KAFKA_HOME) $(S3_HOME) $(CLUSTER_HOME)
