"""``spark-sql`` on a metastore another process holds is refused in one line, before its JVM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.run.spark_sql_guard import HELD, main, metastore_named, refusal

URL = "spark.hadoop.javax.jdo.option.ConnectionURL"


def test_the_metastore_is_read_from_a_conf_before_the_properties_file(tmp_path: Path) -> None:
    props = tmp_path / "spark-defaults.conf"
    props.write_text(
        f"spark.jars a.jar\n{URL} jdbc:derby:;databaseName=/p/_metastore/db;create=true\n"
    )
    conf = f"{URL}=jdbc:derby:;databaseName=/c/_metastore/db"
    assert metastore_named(["--properties-file", str(props)]) == "/p/_metastore/db"
    assert metastore_named([f"--properties-file={props}", "--conf", conf]) == "/c/_metastore/db"
    assert metastore_named([f"--conf={conf}"]) == "/c/_metastore/db"
    assert metastore_named([], spark_home=str(tmp_path.parent)) is None  # no defaults there
    assert metastore_named(["--conf", f"{URL}=jdbc:mysql://db/metastore"]) is None


def test_a_held_metastore_is_refused_naming_the_engines_sql_endpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    database = tmp_path / "lake" / "_metastore" / "db"
    database.mkdir(parents=True)
    (tmp_path / "lake" / "_engine").mkdir()
    (tmp_path / "lake" / "_engine" / "sql.json").write_text(
        json.dumps({"jdbc": "jdbc:hive2://127.0.0.1:10123", "pid": 1})
    )
    args = ["--conf", f"{URL}=jdbc:derby:;databaseName={database};create=true", "-e", "SELECT 1"]
    assert refusal(str(database)) is None and main(args) == 0  # nobody holds it
    holder = subprocess.Popen(  # a process that claims it, as a delayq session does
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | "
         "os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()",
         str(database.parent / "owner.lock")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert main(args) == HELD
        said = capsys.readouterr().err.strip().splitlines()
        assert len(said) == 1
        assert f"open in process {holder.pid}" in said[0]
        assert "beeline -u jdbc:hive2://127.0.0.1:10123" in said[0]
    finally:
        holder.kill()
        holder.wait()
    assert main(args) == 0  # released with its process
