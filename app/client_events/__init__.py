"""Adapters for the events stock IDE clients already send (Continue's data destinations)."""
