"""The TLS and SASL settings every Kafka client of rlstream gets: the aiokafka clients (transport/kafka.py) and the
Faust streams worker (streams/app.py) speak the same protocol with the same TLS context."""
from __future__ import annotations

import ssl

import faust
import pytest
from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

from rlstream.schemas.config import KafkaConfig
from rlstream.streams.app import faust_credentials
from rlstream.transport.kafka import client_options

pytestmark = pytest.mark.unit


def kafka(protocol: str) -> KafkaConfig:
    sasl = {"sasl_mechanism": "PLAIN", "sasl_plain_username": "u", "sasl_plain_password": "pw"}
    return KafkaConfig(bootstrap_servers="broker:9093", security_protocol=protocol,
                       **(sasl if protocol.startswith("SASL") else {}))


@pytest.mark.parametrize("protocol", ["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"])
def test_faust_speaks_the_protocol_of_the_aiokafka_clients(protocol: str) -> None:
    cfg = kafka(protocol)
    ours = client_options(cfg)
    faust_auth = credentials_to_aiokafka_auth(faust_credentials(cfg))  # what Faust hands its aiokafka clients
    assert ours["security_protocol"] == faust_auth["security_protocol"] == protocol
    with_tls = protocol in ("SSL", "SASL_SSL")
    for auth in (ours, faust_auth):
        context = auth.get("ssl_context")
        assert isinstance(context, ssl.SSLContext) == with_tls
        if with_tls:  # certificates verified and the host name checked
            assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    if protocol.startswith("SASL"):
        assert (faust_auth["sasl_mechanism"], faust_auth["sasl_plain_username"], faust_auth["sasl_plain_password"]) \
            == ("PLAIN", "u", "pw")


def test_faust_sasl_credentials_without_a_context_speak_in_clear() -> None:
    """Pins the Faust behaviour the TLS context guards against: SASL credentials built without one make Faust's
    clients use SASL_PLAINTEXT, whatever rlstream's security_protocol says."""
    bare = faust.SASLCredentials(username="u", password="pw", mechanism="PLAIN")
    assert credentials_to_aiokafka_auth(bare)["security_protocol"] == "SASL_PLAINTEXT"
