"""``ab_latency``: source trees from directories and archives, timed in
turn, each run in a process of its own (the tiny preset on CPU)."""

import json
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).parents[3]
SCRIPT = ROOT / "benchmarks" / "tuning" / "ab_latency.py"


def ab_latency(*args: str) -> subprocess.CompletedProcess:
    tiny = ["--preset", "tiny", "--input-len", "8", "--output-len", "4"]
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args, *tiny, "--num-iters", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_an_archive_and_a_directory_in_turn(tmp_path):
    archive = tmp_path / "before.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        for part in ("vllm", "benchmarks"):
            tar.add(ROOT / part, arcname=part)
    table = tmp_path / "ab.json"
    run = ab_latency(
        str(archive), ".", "--repeats", "2", "--batch-size", "2",
        "--output-json", str(table),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    runs = json.loads(table.read_text())
    assert all(row["batch_size"] == 2 for entry in runs for row in entry["runs"])
    assert "tiny, batch 2, 8 in / 4 out" in run.stdout
    assert [(entry["tree"], len(entry["runs"])) for entry in runs] == [
        (str(archive), 2),
        (".", 2),
    ]
    assert all(row["tpot_ms"] > 0 for entry in runs for row in entry["runs"])
    lines = run.stdout.splitlines()
    order = [line.split(":")[0] for line in lines if line.startswith("none ")]
    assert order == [f"none {archive}", "none .", f"none {archive}", "none ."]
    first, second = (line for line in lines if line.startswith("| none"))
    assert first.startswith(f"| none | {archive} |") and "| 1.000 |" in first
    assert second.startswith("| none | . |")


def test_a_tree_that_fails_is_named_as_given(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    archive = tmp_path / "empty.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(empty, arcname="vllm")
    for tree in (empty, archive):
        run = ab_latency(str(tree), "--repeats", "1")
        assert run.returncode != 0 and f"{tree} (none):" in run.stderr
