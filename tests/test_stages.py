"""Chapters 4 and 5 end to end: a server process and a client, over shm and tcp (loopback)."""
import gc
import hashlib
import subprocess
import sys
import time

import numpy as np
import pytest

from fabriclab import bidirectional, fi, unidirectional
from fabriclab.tools.peers import ServerExited, start_server
from conftest import open_fds, provider_args

SIZES = [1, 4096, 65536 + 3, 1 << 20, 16 << 20]


def payload(size, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8)


def test_unidirectional_delivers_byte_exact(fabric):
    with start_server("fabriclab.unidirectional", *provider_args(*fabric)) as server:
        with unidirectional.open_endpoint(*fabric) as stack:
            sender = unidirectional.Sender(stack, server.address_hex)
            for size in SIZES:
                data = payload(size, size)
                sender.send(data)
                got = server.wait_for_log(r"received (\d+) bytes sha256=(\w+)")
                assert int(got.group(1)) == size
                assert got.group(2) == hashlib.sha256(data).hexdigest()


def test_bidirectional_replies_byte_exact(fabric):
    with start_server("fabriclab.bidirectional", *provider_args(*fabric), "--max-message", "16M",
                      "--slots", "4") as server:
        with bidirectional.open_endpoint(*fabric) as stack:
            client = bidirectional.Client(stack, server.address_hex, in_flight=4)
            for size in SIZES:
                sent = [payload(size, seed) for seed in range(3 if size < (16 << 20) else 2)]
                replies = client.exchange(sent)
                assert [len(r) for r in replies] == [size] * len(sent)
                assert all(r == s.tobytes() for r, s in zip(replies, sent))
            client.close()
        server.wait_for_log(r"client \d+ left")


def test_two_clients_share_a_server(fabric):
    with start_server("fabriclab.bidirectional", *provider_args(*fabric)) as server:
        with bidirectional.open_endpoint(*fabric) as a, bidirectional.open_endpoint(*fabric) as b:
            first = bidirectional.Client(a, server.address_hex)
            second = bidirectional.Client(b, server.address_hex)
            assert first.client_id != second.client_id
            assert second.request(b"from b") == b"from b"
            assert first.request(b"from a") == b"from a"


def test_same_stage_twice_in_one_process(fabric):
    for _ in range(2):
        with start_server("fabriclab.bidirectional", *provider_args(*fabric)) as server:
            with bidirectional.open_endpoint(*fabric) as stack:
                assert bidirectional.Client(stack, server.address_hex).request(b"again") == b"again"


def test_server_killed_while_client_waits(fabric):
    gc.collect()
    before = open_fds()
    with start_server("fabriclab.bidirectional", *provider_args(*fabric)) as server:
        stack = bidirectional.open_endpoint(*fabric)
        client = bidirectional.Client(stack, server.address_hex, timeout=2.0)
        assert client.request(b"alive?") == b"alive?"
        server.kill()
        start = time.monotonic()
        with pytest.raises(fi.FabricError) as err:
            client.request(b"anyone there?")
        assert time.monotonic() - start < 8.0
        assert "within" in str(err.value) or err.value.call == "completion"
        stack.close()
    gc.collect()
    assert open_fds() <= before + 2  # the server's pipes may linger until collected


def test_message_larger_than_the_server_buffer_is_refused(fabric):
    with start_server("fabriclab.unidirectional", *provider_args(*fabric), "--max-message", "4K") as server:
        with unidirectional.open_endpoint(*fabric) as stack:
            sender = unidirectional.Sender(stack, server.address_hex)
            with pytest.raises(fi.UsageError, match="larger than the server's 4096-byte receive buffer"):
                sender.send(payload(4097))
            for bad in (0, -5):
                with pytest.raises(fi.UsageError, match="positive"):
                    sender.check_message(bad)
            stack.info.max_msg_size = 1000  # as a provider with a 1000-byte limit would report
            with pytest.raises(fi.UsageError, match="exceeds provider .* maximum of 1000 bytes"):
                sender.send(payload(1001))


def test_server_that_cannot_start_is_reported():
    with pytest.raises(ServerExited, match="stopped before printing its address.*exited with status 2"):
        start_server("fabriclab.unidirectional", "--provider", "no-such-provider")


def run_cli(*args, timeout=60):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, message", [
    (["-m", "fabriclab.unidirectional", "connect", "xyz"], "not a hexadecimal digit"),
    (["-m", "fabriclab.bidirectional", "connect", "464c4144"], "truncated address"),
    (["-m", "fabriclab.unidirectional", "serve", "--provider", "bogus"], "unknown or unusable provider 'bogus'"),
    (["-m", "fabriclab.unidirectional", "connect", "00", "--size", "0"], "must be larger than zero"),
])
def test_cli_errors_are_one_line(args, message):
    result = run_cli(*args)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_round_trip(fabric):
    with start_server("fabriclab.bidirectional", *provider_args(*fabric)) as server:
        result = run_cli("-m", "fabriclab.bidirectional", "connect", server.address_hex, *provider_args(*fabric),
                         "--count", "20", "--size", "4K")
        assert result.returncode == 0, result.stderr
        assert "replies intact: True" in result.stdout


def test_info_command_lists_providers():
    result = run_cli("-m", "fabriclab", "info")
    assert result.returncode == 0
    for provider in fi.available_providers():
        assert provider in result.stdout
