"""A request's source address (app/sources.py; issue 53 §6): the socket peer, or X-Forwarded-For's rightmost address
that is not a trusted proxy when the peer is one; a client that is not a trusted proxy cannot pick its address."""
from __future__ import annotations

import pytest

from app.settings import Settings
from app.sources import source_address

XFF = b"x-forwarded-for"


def test_without_trusted_proxies_the_peer_is_the_source_whatever_the_header_says():
    assert source_address([(XFF, b"198.51.100.1")], ("10.0.0.5", 4321), []) == "10.0.0.5"


def test_a_trusted_proxys_forwarded_address_is_the_source():
    trusted = ["10.0.0.0/8"]
    assert source_address([(XFF, b"198.51.100.1")], ("10.0.0.5", 1), trusted) == "198.51.100.1"
    # the client's own claim (left) is skipped: the rightmost address not of a trusted proxy is who reached the proxy
    assert source_address([(XFF, b"1.2.3.4, 198.51.100.1, 10.1.2.3")], ("10.0.0.5", 1), trusted) == "198.51.100.1"
    assert source_address([(XFF, b"1.2.3.4"), (XFF, b"198.51.100.2")], ("10.0.0.5", 1), trusted) == "198.51.100.2"


def test_an_untrusted_peer_cannot_choose_its_address_and_no_header_means_the_peer():
    trusted = ["127.0.0.1"]
    assert source_address([(XFF, b"198.51.100.1")], ("192.0.2.8", 1), trusted) == "192.0.2.8"
    assert source_address([], ("127.0.0.1", 1), trusted) == "127.0.0.1"
    assert source_address([(XFF, b"127.0.0.1")], ("127.0.0.1", 1), trusted) == "127.0.0.1"


def test_a_bad_trusted_proxies_entry_is_refused_at_start_naming_it():
    with pytest.raises(ValueError, match="trusted_proxies: 'ten' is not an IP address"):
        Settings(trusted_proxies=["ten"])
