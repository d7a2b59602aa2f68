"""EngineConfig: one frozen configuration, validated once (the same error for a bad value whether it comes in an
EngineConfig or as an Engine keyword), reported by the engine's repr and stats()["layout"]["config"]."""
import dataclasses
import math

import numpy as np
import pytest

from fabriclab import Engine, EngineConfig, UsageError

MiB = 1 << 20

BAD = [
    (dict(timeout=-1), "timeout must be a finite number larger than zero, got -1"),
    (dict(timeout=math.nan), "timeout must be a finite number larger than zero, got nan"),
    (dict(link_timeout=math.inf), "link_timeout must be a finite number larger than zero, or 0 to turn failover off"),
    (dict(nics=0), "nics must be between 1 and"),
    (dict(threads=1.5), "threads must be an integer, got 1.5"),
    (dict(batch=0), "batch must be between 1 and 65536, got 0"),
    (dict(in_flight=True), "in_flight must be an integer, got True"),
    (dict(staging_chunk_bytes=100), "staging_chunk_bytes must be at least 4096, got 100"),
    (dict(staging_bytes=1.5), "staging_bytes must be an integer, got 1.5"),
    (dict(staging_bytes=4 * MiB, staging_chunk_bytes=4 * MiB), "must hold at least two staging chunks"),
    (dict(domains=5), "domains must be domain names"),
    (dict(domains=["lo", 3]), "domains must be domain names"),
]


@pytest.mark.parametrize("options, message", BAD, ids=[next(iter(o)) + str(i) for i, (o, _) in enumerate(BAD)])
def test_a_bad_value_gets_the_same_error_as_a_config_and_as_a_keyword(options, message):
    with pytest.raises(UsageError, match=message) as as_config:
        EngineConfig("shm", **options)
    with pytest.raises(UsageError) as as_keyword:
        Engine("shm", pin=False, gpu=False, **options)
    assert str(as_keyword.value) == str(as_config.value)


def test_a_config_is_frozen_normalised_and_replaced_with_validation():
    config = EngineConfig("shm", nics=np.int64(2), domains="shm,", timeout=9, fi_more=1)
    assert (config.nics, config.domains, config.timeout, config.fi_more) == (2, ("shm",), 9.0, True)
    assert type(config.nics) is int and config.link_timeout is None and config.link_timeout_s == 3.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.timeout = 1  # type: ignore[misc]
    assert dataclasses.replace(config, link_timeout=0).link_timeout_s == 0.0
    with pytest.raises(UsageError, match="batch must be between 1"):
        dataclasses.replace(config, batch=-3)
    assert repr(EngineConfig()) == "EngineConfig()"
    assert repr(config) == "EngineConfig(provider='shm', nics=2, domains=('shm',), fi_more=True, timeout=9.0)"
    assert config.as_dict()["domains"] == ["shm"] and config.as_dict()["batch"] == 16


def test_an_engine_built_from_a_config_reports_it():
    config = EngineConfig("shm", nics=2, threads=1, pin=False, gpu=False, timeout=10)
    with Engine(config=config) as engine:
        assert engine.config is config and engine.timeout == 10.0
        assert engine.stats()["layout"]["config"] == config.as_dict()
        assert repr(config) in repr(engine)
        assert (engine.nics, engine.threads) == (2, 1)
        region = engine.register(np.zeros(4096, np.uint8))
        engine.connect(engine.address).write(region, region.descriptor(), length=1024, dst_offset=2048).result(10)
    assert engine.stats()["closed"] and engine.stats()["layout"]["config"] == config.as_dict()


def test_keywords_are_a_shortcut_for_the_same_config():
    with Engine("shm", nics=2, threads=1, pin=False, gpu=False, timeout=10) as engine:
        assert engine.config == EngineConfig("shm", nics=2, threads=1, pin=False, gpu=False, timeout=10)


def test_a_config_and_keywords_together_or_a_config_of_another_type_are_refused():
    config = EngineConfig("shm", pin=False, gpu=False)
    with pytest.raises(UsageError, match="either config=EngineConfig\\(...\\) or its values as keywords"):
        Engine(config=config, timeout=5)
    with pytest.raises(UsageError, match="either config"):
        Engine("shm", config=config)
    with pytest.raises(UsageError, match="config must be an EngineConfig, got dict"):
        Engine(config={"provider": "shm"})
    with pytest.raises(TypeError, match="no_such_option"):
        Engine("shm", no_such_option=1)
