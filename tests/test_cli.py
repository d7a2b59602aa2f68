"""The command line's shared parsing: rates in either notation, sizes as people write them, and bad
input refused with a message that says what would do."""
import argparse

import pytest

from fabriclab import cli, fi


@pytest.mark.parametrize("text, bps", [
    ("3.2G", 3.2e9), ("800M", 800e6), ("1e9", 1e9), ("3.2Gbps", 3.2e9), ("100mbit", 100e6), ("1gbit", 1e9),
    ("500kbit", 500e3), ("100 Mbit/s", 100e6), ("1.5T", 1.5e12), (" 10g ", 10e9), ("0", 0.0), (25_000_000, 25e6),
])
def test_rates_in_either_notation(text, bps):
    assert cli.parse_rate(text) == pytest.approx(bps)
    assert isinstance(cli.parse_rate(text), float)


@pytest.mark.parametrize("bad", ["fast", "100 furlongs", "", "-1G", "1.2.3G", "Gbps", "nan", "inf", "1e999", -5,
                                 float("nan")])
def test_a_bad_rate_says_what_a_rate_looks_like(bad):
    with pytest.raises(fi.UsageError, match=r"is not a rate in bits per second \(examples: 3.2G, .*100mbit"):
        cli.parse_rate(bad)


def test_rate_as_an_argparse_type():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", type=cli.bits_per_second)
    assert parser.parse_args(["--rate", "100mbit"]).rate == 100e6
    with pytest.raises(SystemExit):
        parser.parse_args(["--rate", "fast"])


@pytest.mark.parametrize("n, text", [
    (4096, "4 KiB"), (64 << 10, "64 KiB"), (1 << 20, "1 MiB"), (256 << 20, "256 MiB"), (3 << 30, "3 GiB"),
    (1536 << 10, "1536 KiB"), (1000, "1000 B"), (3 * 65536 + 123, "196731 B"), (0, "0 B"),
])
def test_format_size(n, text):
    assert cli.format_size(n) == text
    assert cli.parse_size(text.replace(" ", "")) == n


@pytest.mark.parametrize("bad", ["inf", "-inf", "1e999", "nan", "4K.5", ""])
def test_a_bad_size_says_what_a_size_looks_like(bad):
    """Issue 21's sweep: ``bench --total inf`` ended in an OverflowError traceback."""
    with pytest.raises(ValueError, match=r"is not a size \(examples: 4096, 64K"):
        cli.parse_size(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="is not a size"):
        cli.positive_size(bad)
