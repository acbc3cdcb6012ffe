from pathlib import Path

import pytest

from eagletree.train.loop import TrainConfig

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_parse(path):
    cfg = TrainConfig.from_sources(path)
    assert cfg.steps > 0 and cfg.out_dir
