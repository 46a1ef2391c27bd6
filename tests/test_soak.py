"""The soak's short form (`make soak` runs it for 30 minutes): ~50 s of mixed load through a real
router to two real replicas of the default model (each with a KV disk tier), one SIGKILLed twice,
one drained with SIGTERM, and a hostile client sending slow schemas and over-limit metadata."""
from __future__ import annotations

import json

import pytest

from benchmarks.soak import main
from benchmarks.soak_load import REFUSALS, SCHEMAS

pytestmark = pytest.mark.slow


def test_soak_short(tmp_path):
    rc = main(["--duration", "50", "--kill-every", "20", "--drain-at", "0.1", "--sample-every", "1",
               "--rss-warmup", "10", "--hostile-every", "8", "--grammar-compile-timeout", "5",
               "--port", "0", "--out", str(tmp_path)])
    r = json.loads((tmp_path / "soak.json").read_text())
    assert (tmp_path / "soak.md").is_file()
    # Every request reached a replica, and no failure other than those a SIGKILL allows: a request
    # in flight on the killed replica (a stream already relayed in part, which no router may replay)
    # ends with `replica_failed`. A drain costs nothing: new requests get 503 there and are retried.
    assert r["lost_never_reached_replica"] == 0, r["failures_by_cause"]
    assert r["failed_unexpected"] == 0, r["failures_by_cause"]
    assert set(r["failures_by_cause"]) <= {"midstream:replica_failed", "503:replica_failed"}
    assert r["failed"] == r["failed_allowed_killed_in_flight"] <= 2 * 4  # 2 kills × 4 clients at most
    assert [e["event"] for e in r["events"] if e["event"] in ("sigkill", "sigterm")] == ["sigterm", "sigkill", "sigkill"]
    assert [e["exit"] for e in r["events"] if e["event"] == "sigterm"] == [0]
    # The load was the mix asked for and most of it was served, by both replicas.
    kinds = {(o["kind"], o["stream"]) for o in r["outcomes"] if o["result"] == "ok"}
    assert {k for k, _ in kinds} >= {"chat", "completion", "structured", "tools", "responses"}
    assert {s for _, s in kinds} == {True, False}
    # The hostile client's requests were refused, each within the compile timeout + 5 s (a later or
    # an accepted one would be a failure above): the slow schema with a 400 (its compile timed out)
    # or a 429 (the grammar pool was full), over-limit metadata with a 400 naming `metadata`.
    refused = {o["kind"] for o in r["outcomes"] if o["result"] == "refused"}
    assert refused == set(REFUSALS), r["refusals_by_cause"]
    causes = {"400:response_format.json_schema.schema", "429:grammar_pool_full", "400:metadata"}
    assert {c.split(" ")[1] for c in r["refusals_by_cause"]} <= causes, r["refusals_by_cause"]
    assert r["disconnected"] > 0 and r["ok"] >= 40
    assert len(r["served_by_replica"]) == 2
    # Nothing left behind: no KV block in use, and the grammar cache holds at most the soak's
    # distinct grammars (3 schemas, 1 tool forced two ways, the slow schema once its compile ended).
    # Each replica ran its disk tier (a SIGKILL mid-write leaves no file that fails its checks).
    for name, after in r["after_load"].items():
        assert after["blocks_used"] == after["running"] == after["waiting"] == 0, name
        assert after["grammar_cache_entries"] <= len(SCHEMAS) + 3, name
        assert after["disk_blocks"] is not None and after["disk_load_errors"] == 0, (name, after)
    # (a replica restarted in the soak's last seconds may have compiled none yet: the grammars were
    # used somewhere, not necessarily by every last incarnation)
    assert sum(after["grammar_cache_entries"] for after in r["after_load"].values()) >= 1
    # Resident memory: the router's and the drained replica's (restarted at ~8 s) within ±10% of
    # their median over the last two thirds, from 10 s after a restart (loading and first grammar
    # compiles grow it; measured: +130 MiB in the first seconds of a replica's life, flat after).
    for name in ("router", "replica1"):
        assert r["rss"][name]["flat"] is True and r["rss"][name]["samples"] >= 20, (name, r["rss"][name])
    assert rc == 0 and r["targets_missed"] == []
