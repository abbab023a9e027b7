"""The README check itself: which blocks it runs, and that a broken line fails it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.readme import Background, blocks, shell_script, sql_as_python, sql_statements

DOC = """Intro.

```bash
make run
make test
```
<!-- readme-check: skip "make test" (CI runs it) -->

<!-- illustrative: needs a broker -->
```bash
make kafka-up
```

```python
x = 1
```

```
plain output, not run
```
"""


def run(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=False)


def test_blocks_are_found_with_their_marks() -> None:
    found = blocks(DOC)
    assert [(b.language, b.line) for b in found] == [("bash", 3), ("bash", 10), ("python", 14)]
    assert found[0].skip == ("make test",) and found[1].illustrative == "needs a broker"
    assert "make test" not in shell_script(found[0]) and "make run" in shell_script(found[0])


def test_a_failing_line_fails_the_block_and_names_it() -> None:
    (block,) = blocks("```bash\ntrue\nfalse   # a broken line\necho after\n```\n")
    done = run(shell_script(block))
    assert done.returncode == 1 and "README line failed (exit 1): false" in done.stderr
    assert "after" not in done.stdout


def test_exit_1_passes_only_where_the_comment_says_so() -> None:
    (allowed,) = blocks("```bash\n(exit 1)   # exit 1 while no engine runs\necho on\n```\n")
    assert run(shell_script(allowed)).stdout.strip() == "on"
    (other,) = blocks("```bash\n(exit 2)   # exit 1 while no engine runs\necho on\n```\n")
    assert run(shell_script(other)).returncode == 1


def test_a_background_block_and_the_block_that_stops_it_are_marked() -> None:
    found = blocks(
        '<!-- readme-check: background until "answering" -->\n```bash\ndelayq run\n```\n\n'
        "<!-- readme-check: stop background -->\n```python\nx = 1\n```\n"
    )
    assert [(b.background_until, b.stops_background) for b in found] == [
        ("answering", False),
        (None, True),
    ]


def _serving(on_ctrl_c: str) -> str:
    return (
        '<!-- readme-check: background until "ready" -->\n```bash\n'
        f"trap '{on_ctrl_c}' INT; echo ready; while true; do sleep 0.1; done\n```\n"
    )


def test_a_background_block_runs_until_ctrl_c_and_must_end_cleanly(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin"}
    (clean,) = blocks(_serving("exit 0"))
    server = Background(clean, env, tmp_path, "README.md:2", tmp_path / "a.log")
    assert "ready" in server.printed()
    server.stop()
    (unclean,) = blocks(_serving("exit 3"))
    server = Background(unclean, env, tmp_path, "README.md:2", tmp_path / "b.log")
    with pytest.raises(AssertionError, match="exit 3"):
        server.stop()


def test_a_sql_blocks_statements_run_one_by_one_in_the_python_session() -> None:
    (block,) = blocks(
        "```sql\nSELECT topic FROM delayq.pending;   -- what waits\n"
        "SELECT * FROM delayq.orders WHERE body = 'a;b -- c';\n```\n"
    )
    assert block.language == "sql"
    assert sql_statements(block.code) == [
        "SELECT topic FROM delayq.pending",
        "SELECT * FROM delayq.orders WHERE body = 'a;b -- c'",
    ]
    shown: list[str] = []

    class Spark:
        def sql(self, statement: str) -> Spark:
            shown.append(statement)
            return self

        def show(self, truncate: bool) -> None:
            assert truncate is False

    exec(sql_as_python(block.code), {"spark": Spark()})
    assert shown == sql_statements(block.code)


def test_a_block_followed_by_a_prints_mark_must_print_it() -> None:
    (block,) = blocks(
        '```bash\necho \'{"id": 1}\'\n```\n<!-- readme-check: prints `{"id": 1}` -->\n'
    )
    assert block.prints == '{"id": 1}'
    assert block.prints in run(shell_script(block)).stdout
