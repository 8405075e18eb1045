"""The feedback tests' gateway (a real one, in this process), for Continue's events."""

from tests.feedback.conftest import client, feedback_topic, ide_key, make_key

__all__ = ["client", "feedback_topic", "ide_key", "make_key"]
