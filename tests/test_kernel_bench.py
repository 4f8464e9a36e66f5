"""bench/kernels.py runs end to end on a CPU, every backend in interpret mode, and checks its rows."""

from bench import kernels


def test_kernel_benchmark_runs_every_backend_and_agrees_with_the_reference(tmp_path, capsys):
    results = tmp_path / "RESULTS.md"
    kernels.main([
        "--backends", "pallas", "reference", "jax-shipped", "--interpret",
        "--batches", "2", "--contexts", "40", "--num-q-heads", "8", "--num-kv-heads", "2",
        "--head-dim", "64", "--dtype", "float32", "--iters", "1", "--markdown", str(results),
    ])
    rows = [line.split("|") for line in results.read_text().splitlines() if line.startswith("| ") and "backend" not in line]
    assert [r[1].strip() for r in rows] == ["pallas", "reference", "jax-shipped"]
    assert all(float(r[6]) < 1e-4 for r in rows), rows
    assert "python bench/kernels.py --backends" in capsys.readouterr().out
