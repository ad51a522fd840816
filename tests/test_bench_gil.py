"""``python -m kvhal.bench.shared.gil`` runs its readers and writers side by side on a real Redis server and
writes what it printed; tiny sizes here (the figures are BENCHMARKS.md's, not a test's)."""

from __future__ import annotations

import json

from kvhal.bench.shared import gil


def test_the_bench_measures_every_reader_and_writer_and_writes_json(tmp_path, capsys):
    assert gil.main(["--values", "4", "--kib", "16", "--repeats", "2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gil.json").read_text())
    readers = [row["reader"] for row in result["rows"]]
    assert readers == [
        "kvhal RedisStore, kvhal's reader",
        "kvhal RedisStore, valkey-glide reads",
        "kvhal RedisStore, redis-py + hiredis reads",
        "limit: memcpy of the same bytes",
        "kvhal RedisStore, valkey-glide writes",
        "kvhal RedisStore, redis-py + hiredis writes",
    ]
    assert all(row["alone_s"] > 0 and row["beside_busy_thread_s"] > 0 for row in result["rows"])
    assert all(row["cpu_s"] >= 0 for row in result["rows"])
    assert "beside a busy thread" in capsys.readouterr().out
