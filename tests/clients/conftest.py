"""Clients tested against a real gateway: the gateway tests' fixtures."""

from tests.gateway.conftest import (
    gateway_server,
    gateway_settings,
    ide_key,
    kafka,
    make_key,
    registry,
    start_gateway,
)

__all__ = [
    "gateway_server",
    "gateway_settings",
    "ide_key",
    "kafka",
    "make_key",
    "registry",
    "start_gateway",
]
