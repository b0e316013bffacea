"""Ray Serve replicas and the disk tier: a directory each (shared, the directory lock would leave all but
the first replica without a tier), an equal share of the cap, the same directory after a restart."""

from __future__ import annotations

from pathlib import Path

from conveyor.config import EngineConfig
from conveyor.kv_cache.disk_tier import open_disk_tier
from conveyor.scaleout.ingress import replica_engine_config
from tests.kv_cache.test_disk_tier import BS, IDENTITY, pool_tensors


def test_each_replica_gets_its_own_tier_directory_and_share(tmp_path):
    cfg = EngineConfig(kv_disk_dir=str(tmp_path), kv_disk_gib=12.0)
    got = [replica_engine_config(cfg, i, 3) for i in range(3)]
    assert [Path(c.kv_disk_dir) for c in got] == [tmp_path / f"replica-{i}" for i in range(3)]
    assert {c.kv_disk_gib for c in got} == {4.0}
    assert replica_engine_config(cfg, 1, 3) == got[1]  # a restarted replica finds its own again
    assert replica_engine_config(EngineConfig(), 0, 3) == EngineConfig()  # no tier: nothing changes
    tiers = [open_disk_tier(c.kv_disk_dir, c.kv_disk_gib, IDENTITY, pool_tensors(), BS) for c in got]
    try:
        assert all(t is not None for t in tiers)  # same model on one node: still a tier each
        assert len({t.dir for t in tiers}) == 3
    finally:
        for t in tiers:
            t.close()
