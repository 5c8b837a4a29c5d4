"""benchmarks/rollout_mismatch.py on the CPU (smoke test: the tiny shape, float32 on both sides)."""
import json

from benchmarks import rollout_mismatch


def test_a_row_writes_its_json_and_the_table(tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    rollout_mismatch.main(["--rows", "hf", "--shape", "tiny", "--steps", "2", "--out", str(out),
                           "--cache_dir", str(cache)])
    row = json.load(open(out / "rollout_mismatch" / "hf.json"))
    assert row["status"] == "ok" and row["steps"] == 2 and len(row["diff_mean_per_step"]) == 2
    assert 0 <= row["diff_mean"] < 1e-4 and row["diff_max"] >= row["diff_mean"]  # float32 generate vs forward
    assert 0 < row["entropy"] <= 6.25  # at most log(512): the tiny shape's vocabulary
    table = open(out / "rollout_mismatch" / "rollout_mismatch.md").read()
    assert table.count("| hf |") == 1 and "tiny" in table
