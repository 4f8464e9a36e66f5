"""bench/kernels.py runs end to end on a CPU, every interpretable backend, and checks its rows."""

import json

from sluice.bench import kernels


def test_kernel_benchmark_runs_every_backend_and_agrees_with_the_reference(tmp_path, capsys):
    results, rows_json = tmp_path / "RESULTS.md", tmp_path / "rows.json"
    kernels.main([
        "--backends", "pallas-triton", "pallas-mosaic", "reference", "jax-shipped", "--interpret",
        "--batches", "2", "--contexts", "40", "--num-q-heads", "8", "--num-kv-heads", "2",
        "--head-dim", "64", "--dtype", "float32", "--calls", "1", "--repeats", "1",
        "--markdown", str(results), "--json", str(rows_json),
    ])
    rows = [line.split("|") for line in results.read_text().splitlines() if line.startswith("| ") and "backend" not in line]
    assert [r[1].strip() for r in rows] == ["pallas-triton", "pallas-mosaic", "reference", "jax-shipped"]
    timed = [r for r in rows if r[1].strip() != "pallas-mosaic"]
    assert all(float(r[8]) < 1e-4 for r in timed), rows  # the largest difference, after the traced columns
    assert "no interpret mode" in rows[1][4]
    saved = json.loads(rows_json.read_text())["rows"]
    assert [r["backend"] for r in saved if "error" not in r] == ["pallas-triton", "reference", "jax-shipped"]
    assert all(r["gbps"] > 0 for r in saved if "error" not in r)
    assert "python -m sluice.bench.kernels --backends" in capsys.readouterr().out
